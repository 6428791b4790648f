"""`model.init_from` of Nemotron 3: transformers' `NemotronHForCausalLM` with MoE blocks is the
referee.

transformers builds two small random Nemotron 3 models (`hf_models.NEMOTRON3_CASES`, M E * E): a
Nano-style one (sigmoid router with a random `e_score_correction_bias`, grouped top-k over 4
groups of which 2 are searched, routing scale 2.5, squared-ReLU experts and a shared expert) and
a Super-style one with LatentMoE. Each is saved as the Hub holds it (`backbone.*`, experts one by
one, legacy config.json) and in transformers' own layout (`model.*`, experts stacked); the
trainer imports each and must compute what transformers computes in float32 with the BF16
recipe: logits within the dense parity tolerance (max |diff| / max |logit| <= 1e-5) and the same
top-5 tokens at every position (0 may differ). The routing is checked to be non-trivial: the
bias and the groups change some tokens' experts. MTP layers (which transformers does not build)
are tested against hand-made checkpoints in packages/nvfp4-train/tests/test_hf_nemotron3.py.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from test_hf_import import TOLERANCE, _hf_logits, _import, _rel  # noqa: E402
from test_hf_nemotron_h_import import _top_k  # noqa: E402


@pytest.fixture(scope="module", params=sorted(hf_models.NEMOTRON3_CASES))
def nemotron3_case(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    return request.param, model_dir, hf_models.make_model(request.param, model_dir)


def _changed_choices(model, tokens: np.ndarray) -> float:
    """The fraction of (block, token) routings in transformers' forward whose top-k set differs
    from the plain top-k of the sigmoid scores (without the bias and the groups)."""
    import torch

    changed, count = [], []

    def hook(router, inputs, out):
        logits, _, chosen = out
        plain = torch.topk(logits.sigmoid(), router.top_k, dim=-1)[1]
        differ = (plain.sort(-1)[0] != chosen.sort(-1)[0]).any(-1)
        changed.append(int(differ.sum()))
        count.append(differ.numel())

    routers = [m for m in model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    hooks = [r.register_forward_hook(hook) for r in routers]
    try:
        _hf_logits(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    return sum(changed) / sum(count)


def test_nemotron3_logits_match_transformers(nemotron3_case):
    import jax.numpy as jnp
    import safetensors

    from nvfp4_train.training.step import forward

    case, model_dir, model = nemotron3_case
    names = set(safetensors.safe_open(model_dir / "model.safetensors", "np").keys())
    hub = not case.endswith("-library")
    assert ("backbone.layers.1.mixer.experts.7.up_proj.weight" in names) == hub
    assert ("model.layers.1.mixer.experts.up_proj" in names) == (not hub)
    cfg, graphdef, params, unused = _import(model_dir)
    moe = cfg.model.moe
    assert (cfg.model.pattern, unused) == ("ME*E", [])
    assert (moe.router, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (
        "sigmoid", 4, 2, 2.5
    )  # fmt: skip
    assert moe.latent_dim == (32 if "latent" in case else 0)
    tokens = hf_models.text_batch(2, 48)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens)))
    ref = _hf_logits(model, tokens)
    changed = _changed_choices(model, tokens)
    differing = int((_top_k(ours) != _top_k(ref)).any(-1).sum())
    print(f"{case}: max |diff| / max |logit| = {_rel(ours, ref):.2e}; {differing} of "
          f"{tokens.size} top-5 sets differ; bias and groups change {changed:.0%} of the "
          "routings")  # fmt: skip
    assert changed > 0  # the correction bias and the groups decide some choices
    assert ours.shape == ref.shape
    assert differing == 0
    assert _rel(ours, ref) <= TOLERANCE, (case, _rel(ours, ref))
