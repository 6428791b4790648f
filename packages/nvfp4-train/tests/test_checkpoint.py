"""Orbax checkpoints: round trip, retention, and a plain on-disk schema readable without a target."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.items import decode_iterator_state, encode_iterator_state


class _State(NamedTuple):
    step: jax.Array
    params: dict[str, Any]
    opt_state: Any


def _state(seed: int) -> _State:
    keys = jax.random.split(jax.random.key(seed), 3)
    params = {
        "embed": {"embedding": jax.random.normal(keys[0], (8, 16))},
        "layers": {"0": {"attn": {"qkv": {"kernel": jax.random.normal(keys[1], (16, 48))}}}},
        "final_norm": {"scale": jax.random.normal(keys[2], (16,)).astype(jnp.bfloat16)},
    }
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = optimizer.update(grads, opt_state, params)  # non-zero moments
    return _State(jnp.asarray(0, jnp.int32), params, opt_state)


def _assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_restores_state_iterator_and_config(tmp_path):
    state = _state(0)
    config = {"train": {"steps": 10}, "precision": {"recipe": "nvfp4"}}
    with Checkpoints(tmp_path / "ckpt", keep=2) as ckpts:
        ckpts.save(7, state, data_iter_state=b'{"next": 3}', config=config)
        assert ckpts.latest_step() == 7
        assert ckpts.read_config(7) == config
        restored = ckpts.restore(7, jax.eval_shape(lambda: _state(1)))
    assert restored.step == 7 and int(restored.state.step) == 7
    assert restored.data_iter_state == b'{"next": 3}'
    assert restored.config == config
    _assert_trees_equal(restored.state.params, state.params)
    _assert_trees_equal(restored.state.opt_state, state.opt_state)


def test_keeps_only_the_newest(tmp_path):
    with Checkpoints(tmp_path, keep=2) as ckpts:
        assert ckpts.latest_step() is None
        for step in (2, 4, 6):
            ckpts.save(step, _state(step), data_iter_state={"i": step}, config={})
        assert ckpts.all_steps() == [4, 6]
        with pytest.raises(ValueError, match=r"no checkpoint at step 2; have steps \[4, 6\]"):
            ckpts.restore(2, _state(0))


def test_async_save_completes_on_close(tmp_path):
    state = _state(3)
    with Checkpoints(tmp_path, keep=1, async_save=True) as ckpts:
        ckpts.save(1, state, data_iter_state={"i": 1}, config={})
    with Checkpoints(tmp_path, keep=1) as ckpts:
        _assert_trees_equal(ckpts.restore(1, state).state.params, state.params)


def test_on_disk_schema_is_plain(tmp_path):
    """What docs/checkpoint-schema.md promises a reader that does not import nvfp4_train."""
    state = _state(0)
    recipes = {"layers.0.attn.qkv": "nvfp4"}
    with Checkpoints(tmp_path, keep=1) as ckpts:
        ckpts.save(
            5, state, data_iter_state={"next_index": 9}, config={"a": [1, 2]},
            quant_stats={"recipes": recipes},
        )  # fmt: skip
    step_dir = tmp_path / "5"
    items = {"params", "opt_state", "data_iter", "config", "quant_stats"}
    assert {p.name for p in step_dir.iterdir()} >= items
    assert json.loads((step_dir / "quant_stats" / "metadata").read_text()) == {"recipes": recipes}
    params = ocp.StandardCheckpointer().restore(step_dir / "params")  # no target
    assert params["layers"]["0"]["attn"]["qkv"]["kernel"].dtype == np.float32
    assert params["final_norm"]["scale"].dtype == jnp.bfloat16
    _assert_trees_equal(params, state.params)
    assert json.loads((step_dir / "config" / "metadata").read_text()) == {"a": [1, 2]}
    iterator = json.loads((step_dir / "data_iter" / "metadata").read_text())
    assert iterator == {"kind": "json", "value": {"next_index": 9}}


@pytest.mark.parametrize("state", [b'{"version": 2, "x": [1]}', {"next_index": 4}])
def test_iterator_state_encoding_round_trips(state):
    encoded = encode_iterator_state(state)
    json.dumps(encoded)
    assert decode_iterator_state(encoded) == state


def test_iterator_state_decoding_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind must be 'bytes' or 'json', got 'pickle'"):
        decode_iterator_state({"kind": "pickle", "value": ""})


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        Checkpoints(tmp_path, keep=0)
