"""`model.init_from` for Mixture-of-Experts models: transformers is the referee.

For each MoE class (`hf_models.MOE_CASES`: Qwen3-MoE, Mixtral, Qwen2-MoE with its gated shared
expert; per-expert checkpoints as `save_pretrained` writes them and the fused 3-D layout that
transformers 5 holds), transformers builds a small random model and saves it; the trainer imports
it and must compute what transformers computes in float32 with the BF16 recipe: logits within
the dense parity tolerance (max |diff| / max |logit| <= 1e-5) and the same routing decisions
(the top-k set of every token in every MoE block; 0 tokens may differ).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models  # noqa: E402
from test_hf_import import TOLERANCE, _hf_logits, _import, _rel  # noqa: E402


@pytest.fixture(scope="module", params=sorted(hf_models.MOE_CASES))
def moe_case(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param.replace("-", "_"))
    return request.param, model_dir, hf_models.make_model(request.param, model_dir)


def _hf_routing(model, tokens: np.ndarray) -> list[np.ndarray]:
    """Each MoE block's chosen experts [T, k] (sorted per token) in transformers."""
    import torch

    chosen: list[np.ndarray] = []
    routers = [m for name, m in model.named_modules() if name.endswith(("mlp.gate",))]
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: chosen.append(np.sort(out[2].numpy(), -1)))
        for r in routers
    ]
    try:
        with torch.no_grad():
            model(torch.tensor(tokens, dtype=torch.long))
    finally:
        for h in hooks:
            h.remove()
    return chosen


def _our_routing(graphdef, params, tokens, monkeypatch) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits, each MoE block's chosen experts [T, k] sorted per token) of the imported model,
    run eagerly with the router's choices recorded."""
    import jax.numpy as jnp

    from nvfp4_train.model.moe import layer as moe
    from nvfp4_train.training.step import forward

    chosen: list[np.ndarray] = []
    route = moe.route

    def recording(*args, **kwargs):
        routing = route(*args, **kwargs)
        chosen.append(np.sort(np.asarray(routing.experts_TxK), -1))
        return routing

    monkeypatch.setattr(moe, "route", recording)
    logits = np.asarray(forward(graphdef, params, jnp.asarray(tokens)))
    return logits, chosen


def test_moe_logits_and_routing_match_transformers(moe_case, monkeypatch):
    case, model_dir, model = moe_case
    cfg, graphdef, params, unused = _import(model_dir, scan_layers=False)
    assert cfg.model.architecture == hf_models.ARCHITECTURE[case]
    assert cfg.model.moe.num_experts == 4 and unused == []
    tokens = hf_models.text_batch(2, 48)
    ours, our_routes = _our_routing(graphdef, params, tokens, monkeypatch)
    ref = _hf_logits(model, tokens)
    hf_routes = _hf_routing(model, tokens)
    assert len(our_routes) == len(hf_routes) >= 1
    differing = sum(int((a != b).any(-1).sum()) for a, b in zip(our_routes, hf_routes, strict=True))
    print(f"{case}: max |diff| / max |logit| = {_rel(ours, ref):.2e}; "
          f"{differing} of {sum(len(r) for r in hf_routes)} token top-k sets differ")  # fmt: skip
    assert differing == 0
    assert _rel(ours, ref) <= TOLERANCE, (case, _rel(ours, ref))


def test_a_scanned_moe_import_computes_the_same(tmp_path):
    """One class is enough: scanned blocks read experts with the same code for every class."""
    import jax.numpy as jnp

    from nvfp4_train.training.step import forward

    model = hf_models.make_model("qwen3_moe", tmp_path)
    cfg, graphdef, params, _ = _import(tmp_path, scan_layers=True)
    tokens = hf_models.text_batch(2, 48)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens)))
    assert _rel(ours, _hf_logits(model, tokens)) <= TOLERANCE
