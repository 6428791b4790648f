"""`model.init_from` of Nemotron-H: transformers' `NemotronHForCausalLM` is the referee.

transformers builds a small random Nemotron-H (`hf_models.NEMOTRON_H_CASES`: Mamba-2, squared-ReLU
MLP and attention blocks, `M-M-*-`) and saves it twice: as the Hub holds it (`backbone.*`, with
config.json rewritten in the legacy `hybrid_override_pattern` / `mamba_*` form) and in its own
layout (`model.*`, config.json as transformers 5 writes it). The trainer imports each, its
repeating blocks stacked and scanned (one compiled program for both; the unrolled blocks get the
same weights, packages/nvfp4-train/tests/test_hf_nemotron_h.py), and must compute what
transformers computes in float32 with the BF16 recipe: logits within the dense parity tolerance
(max |diff| / max |logit| <= 1e-5) and the same top-5 tokens at every position (0 may differ).

transformers runs its PyTorch path here (no mamba_ssm / causal_conv1d kernels on a CPU). Over a
whole sequence it computes dt as NVIDIA's kernels do and as the trainer does:
clip(softplus(dt + dt_bias), time_step_limit). The paths part only in the one-token decode step
(the cache path, which the kernels' `selective_state_update` runs without the clip), which
training never runs. The model's limit [0.4, 1.0] is chosen to bind, on both sides, for some dt
(checked below), so the clip's place is tested, not assumed.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from test_hf_import import TOLERANCE, _hf_logits, _import, _rel  # noqa: E402

TOP_K = 5


@pytest.fixture(scope="module", params=sorted(hf_models.NEMOTRON_H_CASES))
def nemotron_h_case(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    return request.param, model_dir, hf_models.make_model(request.param, model_dir)


def _clipped_dt(model, tokens: np.ndarray) -> tuple[float, float]:
    """(the fraction of softplus(dt + dt_bias) below, above the model's time_step_limit) over
    every Mamba block of transformers' forward pass."""
    import torch

    low, high = model.config.time_step_limit
    below, above, count = [], [], []

    def record(mixer):
        def hook(_module, _inputs, out):
            dt = torch.nn.functional.softplus(out[..., -mixer.num_heads :] + mixer.dt_bias)
            below.append(int((dt < low).sum()))
            above.append(int((dt > high).sum()))
            count.append(dt.numel())

        return hook

    mixers = [m for m in model.modules() if type(m).__name__ == "NemotronHMamba2Mixer"]
    hooks = [m.in_proj.register_forward_hook(record(m)) for m in mixers]
    try:
        _hf_logits(model, tokens)
    finally:
        for h in hooks:
            h.remove()
    return sum(below) / sum(count), sum(above) / sum(count)


def _top_k(logits: np.ndarray) -> np.ndarray:
    return np.sort(np.argsort(-logits, axis=-1)[..., :TOP_K], axis=-1)


def test_nemotron_h_logits_match_transformers(nemotron_h_case):
    import jax.numpy as jnp
    import transformers

    from nvfp4_train.training.step import forward

    case, model_dir, model = nemotron_h_case
    reread = transformers.AutoConfig.from_pretrained(model_dir)  # the legacy form reads the same
    assert reread.layers_block_type == model.config.layers_block_type
    assert list(reread.time_step_limit) == list(model.config.time_step_limit)
    cfg, graphdef, params, unused = _import(model_dir, scan_layers=True)
    assert (cfg.model.architecture, cfg.model.pattern, unused) == ("nemotron_h", "M-M-*-", [])
    assert list(cfg.model.mamba.time_step_limit) == [0.4, 1.0]
    assert any("-" in key for key in params["layers"])  # (M-) x 2 stacked
    tokens = hf_models.text_batch(2, 48)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens)))
    ref = _hf_logits(model, tokens)
    below, above = _clipped_dt(model, tokens)
    differing = int((_top_k(ours) != _top_k(ref)).any(-1).sum())
    print(f"{case}: max |diff| / max |logit| = {_rel(ours, ref):.2e}; {differing} of "
          f"{tokens.size} top-{TOP_K} sets differ; dt clipped below {below:.0%}, above "
          f"{above:.0%}")  # fmt: skip
    assert below > 0 and above > 0  # the clip binds: its place in the order of operations counts
    assert ours.shape == ref.shape
    assert differing == 0
    assert _rel(ours, ref) <= TOLERANCE, (case, _rel(ours, ref))
