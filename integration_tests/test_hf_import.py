"""`model.init_from`: transformers is the referee of the imported model.

For every architecture and option `hf_models.CASES` lists, transformers builds a small random
model and saves it; the trainer imports it and must compute what transformers computes: logits of
the BF16 recipe in float32 within max |diff| / max |logit| <= 1e-5 on real text, the same with the
blocks stacked and scanned, and the first train step's loss equal to transformers' loss on the
same batch.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_models  # noqa: E402

TOLERANCE = 1e-5


def _import(model_dir, **model_keys):
    import jax

    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.mesh.sharding import make_mesh, tree_shardings
    from nvfp4_train.model.hf.weights import load_hf_params
    from nvfp4_train.training.resume import abstract_state

    cfg = config_from_dict(
        {
            "model": {"init_from": str(model_dir), "dtype": "float32", **model_keys},
            "precision": {"recipe": "bf16"},
            "train": {"batch_size": 2, "seq_len": 48},
        }
    )
    mesh = make_mesh(cfg.mesh, jax.devices())
    graphdef, abstract = abstract_state(cfg)
    shardings = tree_shardings(abstract, abstract.params, mesh)
    params, unused = load_hf_params(
        cfg.model.init_from, cfg.model, abstract.params, shardings.params
    )
    return cfg, graphdef, params, unused


@pytest.fixture(scope="module", params=sorted(hf_models.CASES))
def hf_case(request, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    return request.param, model_dir, hf_models.make_model(request.param, model_dir)


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def _rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_logits_match_transformers(hf_case, scan):
    import jax.numpy as jnp

    from nvfp4_train.training.step import forward

    case, model_dir, model = hf_case
    cfg, graphdef, params, unused = _import(model_dir, scan_layers=scan)
    assert cfg.model.architecture == hf_models.ARCHITECTURE[case]
    assert unused == []
    tokens = hf_models.text_batch(2, 48)
    ours = np.asarray(forward(graphdef, params, jnp.asarray(tokens)))
    ref = _hf_logits(model, tokens)
    assert ours.shape == ref.shape
    assert _rel(ours, ref) <= TOLERANCE, (case, _rel(ours, ref))


def test_first_step_loss_matches_transformers(hf_case):
    import jax
    import torch

    from nvfp4_train.optim.optimizer import make_optimizer
    from nvfp4_train.training.resume import run_train_step
    from nvfp4_train.training.step import state_from_params

    case, model_dir, model = hf_case
    cfg, graphdef, params, _ = _import(model_dir)
    tokens = hf_models.text_batch(2, 49)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    optimizer = make_optimizer(cfg.optimizer, cfg.train.steps)
    state = state_from_params(cfg.model, params, optimizer)
    _, metrics = jax.jit(run_train_step(cfg, graphdef, optimizer))(state, batch)
    with torch.no_grad():
        ref = model(
            torch.tensor(tokens, dtype=torch.long), labels=torch.tensor(tokens, dtype=torch.long)
        ).loss
    loss = float(metrics["loss"])
    assert abs(loss - float(ref)) / float(ref) <= TOLERANCE, (case, loss, float(ref))
