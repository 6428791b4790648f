"""Telemetry: each linear's captured operands (x, w, dy) and the quantization probe on them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from run_steps import initial, probe_of, run_optimizer, train_step_of

import nvfp4_ops
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.blocks.linear import QuantLinear
from nvfp4_train.model.blocks.mamba import SSM_STATS
from nvfp4_train.model.config import LINEAR_NAMES, block_linear_names, linear_paths
from nvfp4_train.model.decoder import linear_keys, unstacked
from nvfp4_train.model.structure import LINEAR_ORDER
from nvfp4_train.observe.telemetry import (
    capture_linear_operands,
    linear_recipes,
    make_telemetry_probe,
)
from nvfp4_train.precision.policy import run_layout
from nvfp4_train.training.step import forward_with_amax, step_key


@functools.cache
def tiny_cfg(recipe: str = "nvfp4", dtype: str = "bfloat16", first: int = 0, accum: int = 1):
    """A 2-layer model; `first` leading layers stay BF16."""
    return config_from_dict(
        {
            "model": {
                "vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 2,
                "num_kv_heads": 1, "mlp_dim": 64, "max_seq_len": 16, "dtype": dtype,
            },
            "precision": {"recipe": recipe, "bf16_first_layers": first, "bf16_last_layers": 0},
            "train": {"steps": 4, "seed": 3, "batch_size": 4, "seq_len": 16,
                      "grad_accum_steps": accum},
        }
    )  # fmt: skip


def random_batch(seed: int = 1, batch: int = 4, length: int = 16):
    tokens = jax.random.randint(jax.random.key(seed), (batch, length + 1), 0, 64, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


@functools.cache
def captured(recipe: str = "nvfp4", dtype: str = "bfloat16"):
    cfg = tiny_cfg(recipe, dtype)
    graphdef, state = initial(cfg)
    capture = jax.jit(capture_linear_operands)
    return cfg, graphdef, state, capture(graphdef, state.params, random_batch(), jax.random.key(5))


def kernel_of(params, path: str) -> jax.Array:
    node = run_layout(tiny_cfg()).to_canonical(params)  # the same with stacked blocks
    for part in path.split("."):
        node = node[part]
    return node["kernel"]


def test_capture_covers_every_linear_with_shapes_and_dtypes():
    cfg, _, state, operands = captured()
    assert sorted(operands) == sorted(linear_paths(cfg.model))  # jit returns dicts key-sorted
    for path, (x, w, dy) in operands.items():
        kernel = kernel_of(state.params, path)
        assert x.dtype == w.dtype == dy.dtype == jnp.bfloat16
        assert x.shape == (4, 16, kernel.shape[0]) and dy.shape == (4, 16, kernel.shape[1])
        assert bool(jnp.all(jnp.isfinite(dy.astype(jnp.float32)))) and float(jnp.abs(dy).max()) > 0


def test_w_is_the_kernel_in_the_compute_dtype():
    _, _, state, operands = captured()
    for path, (_, w, _) in operands.items():
        np.testing.assert_array_equal(w, kernel_of(state.params, path).astype(jnp.bfloat16))


def test_x_is_what_the_gemm_receives_its_amax_matches_the_sown_one():
    _, graphdef, state, operands = captured()
    batch = random_batch()
    _, amax_tree = forward_with_amax(graphdef, state.params, batch["inputs"], jax.random.key(5))
    for path, (x, _, _) in operands.items():
        node = amax_tree
        for part in path.split("."):
            node = node[part]
        assert float(jnp.abs(x).max()) == float(node)


def test_dy_and_x_give_the_kernel_gradient():
    """For BF16 linears in float32, d loss / d kernel = x^T dy exactly (up to f32 sum order)."""
    _, graphdef, state, operands = captured("bf16", "float32")
    batch = random_batch()

    def mean_loss(params):
        model = nnx.merge(graphdef, params)
        logits = model(batch["inputs"])
        return jnp.mean(
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        )

    grads = jax.grad(mean_loss)(state.params)
    for path, (x, _, dy) in operands.items():
        wgrad = jnp.einsum("bli,blo->io", x, dy, precision="highest")
        np.testing.assert_allclose(wgrad, kernel_of(grads, path), rtol=1e-4, atol=1e-7)


def test_dy_matches_a_finite_difference_of_the_loss():
    """<dy, v> = (loss(y + eps v) - loss(y - eps v)) / 2 eps for the last down projection."""
    _, graphdef, state, operands = captured("bf16", "float32")
    batch = random_batch()
    path = "layers.1.mlp.down"
    dy = operands[path][2]
    v = 0.1 * jax.random.normal(jax.random.key(9), dy.shape, jnp.float32)  # ~5% of the residual

    def loss_with_offset(eps):
        model = unstacked(nnx.merge(graphdef, state.params))
        down = model.layers["1"].mlp.down
        plain = type(down).__call__
        down.__class__ = type("Shifted", (QuantLinear,), {
            "__call__": lambda self, x, key=None: plain(self, x, key) + eps * v
        })  # fmt: skip
        logits = model(batch["inputs"])
        nll = (
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        )
        return float(jnp.mean(nll))

    eps = 1e-2
    finite_difference = (loss_with_offset(eps) - loss_with_offset(-eps)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(dy, v)), finite_difference, rtol=1e-2)


def _plain_call(self, x_NxI, key=None):
    """`QuantLinear.__call__` as it was before capture mode existed (the reference graph)."""
    from nvfp4_train.model.blocks.linear import INPUT_AMAX, _zero_f32

    x = x_NxI.astype(self.dtype)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    self.sow(nnx.Intermediate, INPUT_AMAX, amax, reduce_fn=jnp.maximum, init_fn=_zero_f32)
    w = self.kernel[...].astype(self.dtype)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    y = nvfp4_ops.dot_general(
        x, w, dims, preferred_element_type=jnp.float32, recipe=self.recipe, key=key
    )
    return y.astype(self.dtype)


def _train_step_jaxpr(cfg) -> str:
    graphdef, state = initial(cfg)
    step = train_step_of(cfg, graphdef, run_optimizer(cfg))
    return str(jax.make_jaxpr(step)(state, random_batch()))


def test_capture_off_leaves_the_train_step_jaxpr_unchanged(monkeypatch):
    cfg = tiny_cfg("nvfp4", accum=2)
    graphdef, state = initial(cfg)
    capture_linear_operands(graphdef, state.params, random_batch(), jax.random.key(0))
    with_capture_code = _train_step_jaxpr(cfg)
    monkeypatch.setattr(QuantLinear, "__call__", _plain_call)
    assert with_capture_code == _train_step_jaxpr(cfg)
    merged = nnx.merge(graphdef, state.params)
    assert not any(
        m.capture_operands for _, m in nnx.iter_modules(merged) if isinstance(m, QuantLinear)
    )


def test_capture_on_changes_only_the_probe():
    """Sanity check of the test above: capture mode does add to the traced graph."""
    cfg = tiny_cfg("nvfp4")
    graphdef, state = initial(cfg)
    batch = random_batch()
    key = jax.random.key(0)
    plain = jax.make_jaxpr(lambda p: forward_with_amax(graphdef, p, batch["inputs"], key)[0])
    probe = jax.make_jaxpr(lambda p: capture_linear_operands(graphdef, p, batch, key))
    assert len(probe(state.params).eqns) > len(plain(state.params).eqns)


@pytest.mark.parametrize("bad", ["inputs", "targets"])
def test_capture_names_a_missing_batch_key(bad):
    cfg = tiny_cfg()
    graphdef, state = initial(cfg)
    batch = dict(random_batch())
    del batch[bad]
    with pytest.raises(ValueError, match=f"batch must hold 'inputs' and 'targets'.*{bad}"):
        capture_linear_operands(graphdef, state.params, batch)


# ----------------------------------------------------------------------------- the probe


@functools.cache
def probed(accum: int = 1):
    """(cfg, probe output, operands of the first microbatch) of a model whose layer 0 is BF16;
    one jit, so both see the same x (eager and jitted bf16 results may differ in the last bit)."""
    cfg = tiny_cfg("nvfp4", first=1, accum=accum)
    graphdef, state = initial(cfg)
    probe = probe_of(cfg, graphdef)

    def both(params, batch, key):
        first = {k: v[: v.shape[0] // accum] for k, v in batch.items()}
        micro_key = jax.random.fold_in(key, 0)
        operands = capture_linear_operands(graphdef, params, first, micro_key)
        return probe(params, batch, key), operands

    stats, operands = jax.jit(both)(state.params, random_batch(), step_key(cfg.train.seed, 3))
    return cfg, stats, operands


def test_probe_covers_only_the_quantized_linears_with_every_role_and_stat():
    cfg, stats, _ = probed()
    assert sorted(stats) == sorted(p for p in linear_paths(cfg.model) if p.startswith("layers.1"))
    roles = {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"}  # 2D weights: no dgrad_w
    for path, by_role in stats.items():
        assert set(by_role) == roles, path
        for values in by_role.values():
            assert set(values) == set(nvfp4_ops.STATS)
            assert all(bool(jnp.isfinite(v)) for v in values.values())
            assert 0 < float(values["rel_error"]) < 0.5


def test_probe_stats_are_the_operand_stats_of_the_captured_operands():
    """fprop_x is `operand_stats` of the captured x; dgrad_dy uses the linear's own SR key."""
    cfg, stats, operands = probed()
    micro_key = jax.random.fold_in(step_key(cfg.train.seed, 3), 0)
    recipe = nvfp4_ops.get_recipe("nvfp4")
    for path in ("layers.1.attn.qkv", "layers.1.mlp.down"):
        x, _, dy = operands[path]
        fprop_x = nvfp4_ops.operand_stats(x, recipe.fprop_input)
        for stat in nvfp4_ops.STATS:
            assert float(stats[path]["fprop_x"][stat]) == float(fprop_x[stat]), (path, stat)
        i, j = int(path.split(".")[1]), LINEAR_NAMES.index(path.split(".", 2)[2])
        linear_key = jax.random.fold_in(jax.random.fold_in(micro_key, i), j)
        dy_key = jax.random.split(linear_key, 6)[2]  # qdot.KEY_SLOTS: fprop_x, fprop_w, dgrad_dy
        dgrad_dy = nvfp4_ops.operand_stats(dy.reshape(1, -1, dy.shape[-1]), recipe.grad, dy_key)
        for stat in nvfp4_ops.STATS:
            assert float(stats[path]["dgrad_dy"][stat]) == float(dgrad_dy[stat]), (path, stat)
        other_key = nvfp4_ops.operand_stats(
            dy.reshape(1, -1, dy.shape[-1]), recipe.grad, linear_key
        )
        assert float(other_key["rel_error"]) != float(dgrad_dy["rel_error"])  # the key matters


def test_probe_sees_the_first_microbatch_only():
    _, stats, operands = probed(accum=2)
    x = operands["layers.1.mlp.gate_up"][0]
    assert x.shape[0] == 2
    assert float(stats["layers.1.mlp.gate_up"]["fprop_x"]["amax"]) == float(jnp.abs(x).max())


def test_probe_of_an_all_bf16_model_is_empty():
    cfg = tiny_cfg("bf16")
    graphdef, state = initial(cfg)
    probe = jax.jit(probe_of(cfg, graphdef))
    assert probe(state.params, random_batch(), step_key(cfg.train.seed, 0)) == {}


def test_linear_keys_are_the_keys_the_model_folds():
    cfg = tiny_cfg()
    key = jax.random.key(11)
    keys = linear_keys(cfg.model, key)
    assert list(keys) == linear_paths(cfg.model)
    expected = jax.random.fold_in(jax.random.fold_in(key, 1), 3)
    np.testing.assert_array_equal(
        jax.random.key_data(keys["layers.1.mlp.down"]), jax.random.key_data(expected)
    )
    assert set(linear_keys(cfg.model, None).values()) == {None}


def test_linear_recipes_lists_quantized_linears_in_model_order():
    cfg = tiny_cfg("nvfp4", first=1)
    graphdef, state = initial(cfg)
    recipes = linear_recipes(graphdef, state.params)
    assert list(recipes) == [p for p in linear_paths(cfg.model) if p.startswith("layers.1")]
    assert all(r == nvfp4_ops.get_recipe("nvfp4") for r in recipes.values())


# ----------------------------------------------------------------------------- hybrid models


def hybrid_cfg(pattern: str, scan: bool = False, **model):
    """A tiny hybrid model (Mamba, relu2 MLP, attention), every linear NVFP4."""
    return config_from_dict(
        {
            "model": {
                "vocab_size": 64, "d_model": 32, "num_layers": len(pattern), "num_heads": 2,
                "num_kv_heads": 1, "mlp_dim": 64, "max_seq_len": 16, "architecture": "nemotron_h",
                "pattern": pattern, "mlp_activation": "relu2", "rope": False, "scan_layers": scan,
                "mamba": {"num_heads": 16, "head_dim": 4, "state_dim": 8, "n_groups": 1,
                          "chunk_size": 8},
                **model,
            },
            "precision": {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0},
            "train": {"steps": 4, "seed": 3, "batch_size": 4, "seq_len": 16},
        }
    )  # fmt: skip


def test_hybrid_probe_covers_mamba_and_relu2_linears_and_reports_ssm_per_layer():
    cfg = hybrid_cfg("MM-", scan=True)  # the two Mamba blocks stacked and scanned
    graphdef, state = initial(cfg)
    probe = make_telemetry_probe(graphdef, cfg.model)
    out = jax.jit(probe)(state.params, random_batch(), step_key(cfg.train.seed, 0))
    assert sorted(out["quant"]) == sorted(linear_paths(cfg.model))
    assert "layers.0.mamba.in_proj" in out["quant"] and "layers.2.mlp.up" in out["quant"]
    assert list(out["ssm"]) == ["layers.0", "layers.1"]  # per layer, stacked or not
    for stats in out["ssm"].values():
        assert sorted(stats) == sorted(SSM_STATS)
        values = {k: float(v) for k, v in stats.items()}
        assert 0 < values["dt_min"] <= values["dt_mean"] <= values["dt_max"]
        assert values["state_norm"] > 0
    assert float(out["ssm"]["layers.0"]["dt_max"]) != float(out["ssm"]["layers.1"]["dt_max"])


def test_linear_order_is_every_block_kinds_sr_key_order():
    moe = {"num_experts": 4, "expert_mlp_dim": 32, "shared_experts": 1}
    for cfg in (tiny_cfg(), hybrid_cfg("M*-E", moe=moe)):
        for i in range(cfg.model.num_layers):
            names = block_linear_names(cfg.model, i)
            assert sorted(names, key=LINEAR_ORDER.index) == list(names)
