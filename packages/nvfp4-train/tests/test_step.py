"""The train and eval steps on a tiny model: every recipe trains, reruns are bit-identical,
gradient accumulation and loss scaling change nothing, non-finite steps are skipped."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from run_steps import eval_step_of, initial, run_optimizer, train_step_of

from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.model.config import linear_paths
from nvfp4_train.model.decoder import unstacked
from nvfp4_train.precision.policy import run_layout
from nvfp4_train.training.step import (
    TrainState,
    count_params,
    flat_amax,
    with_vocab_size,
)

RECIPES = [
    "nvfp4",
    "nvfp4-no-rht",
    "nvfp4-no-sr",
    "nvfp4-no-2d",
    "nvfp4-naive",
    "mxfp4",
    "fp8",
    "bf16",
]


@functools.cache
def run_config(recipe="nvfp4", dtype="bfloat16", accum=1, loss_scaling="none", vocab=256):
    """A 2-layer model with EVERY linear on `recipe` (no BF16 layers), constant lr 1e-2."""
    return config_from_dict(
        {
            "model": {
                "vocab_size": vocab, "d_model": 64, "num_layers": 2, "num_heads": 4,
                "num_kv_heads": 2, "mlp_dim": 128, "max_seq_len": 32, "dtype": dtype,
            },
            "precision": {
                "recipe": recipe, "bf16_first_layers": 0, "bf16_last_layers": 0,
            },
            "optimizer": {
                "learning_rate": 1e-2, "schedule": "constant", "warmup_steps": 0,
                "loss_scaling": {"mode": loss_scaling, "initial_scale": 1024.0},
            },
            "train": {"steps": 20, "seed": 7, "batch_size": 4, "seq_len": 32, "grad_accum_steps": accum},
        }
    )  # fmt: skip


@functools.cache
def compiled(cfg):
    """(graphdef, jitted train_step) for a config; compiled once per test session."""
    graphdef, _ = initial(cfg)
    step = train_step_of(cfg, graphdef, run_optimizer(cfg))
    return graphdef, jax.jit(step, donate_argnums=0)


def fixed_batch(vocab=256):
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, vocab, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def train(cfg, steps: int, state: TrainState | None = None):
    _, step = compiled(cfg)
    state = initial(cfg)[1] if state is None else state
    losses, batch = [], fixed_batch()
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, metrics


ABLATIONS = ("nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-no-2d", "nvfp4-naive")
"""The full recipe with features switched off: the same quantized `dot_general` as "nvfp4" with
fewer transforms."""

_RECIPE_TEST = "test_every_recipe_trains_and_loss_falls"
SCANNED_ELSEWHERE = {
    **{
        f"{_RECIPE_TEST}[{name}]": "an ablation of nvfp4 (the same quantized dot_general with "
        "fewer transforms; each is a 30 s compile here)"
        for name in ABLATIONS
    },
    f"{_RECIPE_TEST}[nvfp4]": "test_scan.py trains nvfp4 scanned and unscanned bit-identically; "
    "here the rerun, rounding-key and float16 tests train it scanned",
    f"{_RECIPE_TEST}[bf16]": "test_scan.py trains bf16 scanned and unscanned bit-identically",
    "test_dynamic_loss_scaling_gives_the_same_training": "the scale multiplies the loss and "
    "divides the gradients outside the model, whose scanned backward test_scan.py shows "
    "bit-identical; float16 loss scaling runs scanned here",
    "test_gradient_accumulation_matches_one_big_batch": "the microbatch loop is outside the "
    "model; scanned, it runs in test_activation_amax_is_max_reduced_over_microbatches",
}
"""What the scanned re-run (`--scan-layers-from`) skips, and where that claim is shown scanned.
It trains mxfp4, fp8, nvfp4 (rerun, rounding keys, float16) and bf16 (the other tests)."""


@pytest.fixture(autouse=True)
def _scanned_elsewhere(request):
    if request.config.getoption("--scan-layers-from") is None:
        return
    if (reason := SCANNED_ELSEWHERE.get(request.node.name)) is not None:
        pytest.skip(f"scanned: {reason}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_and_loss_falls(recipe):
    cfg = run_config(recipe)
    _, start = initial(cfg)
    initial_params = jax.tree.map(np.asarray, start.params)
    state, losses, metrics = train(cfg, 12, start)
    assert int(state.step) == 12
    assert set(metrics) >= {"loss", "grad_norm", "lr", "skipped"}
    assert all(np.isfinite(losses)) and float(metrics["grad_norm"]) > 0
    assert int(metrics["skipped"]) == 0 and float(metrics["lr"]) == pytest.approx(1e-2)
    assert abs(losses[0] - np.log(256)) < 0.3  # starts near uniform
    assert losses[-1] < losses[0] - 1.0, losses
    per_layer = run_layout(cfg).to_canonical  # the same test whether the blocks are stacked
    kernel = per_layer(state.params)["layers"]["0"]["mlp"]["down"]["kernel"]
    initial_kernel = per_layer(initial_params)["layers"]["0"]["mlp"]["down"]["kernel"]
    assert not np.array_equal(kernel, initial_kernel)
    assert kernel.dtype == jnp.float32


def test_rerun_is_bit_identical_with_stochastic_rounding():
    cfg = run_config("nvfp4")
    state_a, losses_a, _ = train(cfg, 5)
    state_b, losses_b, _ = train(cfg, 5)
    assert losses_a == losses_b
    jax.tree.map(np.testing.assert_array_equal, state_a.params, state_b.params)


@pytest.mark.parametrize(("recipe", "differs"), [("nvfp4", True), ("nvfp4-no-sr", False)])
def test_rounding_key_comes_from_the_step_number(recipe, differs):
    """Same params and batch at steps 0 and 3 (constant lr): only SR makes the updates differ."""
    cfg = run_config(recipe)
    _, step = compiled(cfg)
    _, state = initial(cfg)
    copy = functools.partial(jax.tree.map, jnp.array)
    at_zero, _ = step(copy(state), fixed_batch())
    at_three, _ = step(copy(state._replace(step=jnp.int32(3))), fixed_batch())
    same = jax.tree.all(jax.tree.map(jnp.array_equal, at_zero.params, at_three.params))
    assert same is not differs


def sgd_gradient(cfg):
    """The gradient a train step computes: its update under plain SGD with lr 1."""
    graphdef, state = initial(cfg)
    sgd = optax.sgd(1.0)
    step = jax.jit(train_step_of(cfg, graphdef, sgd))
    before = jax.tree.map(np.asarray, state.params)
    state = state._replace(opt_state=sgd.init(state.params))
    new, metrics = step(state, fixed_batch())
    return jax.tree.map(lambda b, a: b - np.asarray(a), before, new.params), metrics


def test_gradient_accumulation_matches_one_big_batch():
    grads_one, m_one = sgd_gradient(run_config("bf16", "float32", accum=1))
    grads_two, m_two = sgd_gradient(run_config("bf16", "float32", accum=2))
    np.testing.assert_allclose(m_one["loss"], m_two["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_one["grad_norm"], m_two["grad_norm"], rtol=1e-5)
    assert float(m_one["grad_norm"]) > 0
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7), grads_one, grads_two
    )


def test_dynamic_loss_scaling_gives_the_same_training():
    plain, losses_plain, _ = train(run_config("bf16", "float32"), 3)
    scaled, losses_scaled, metrics = train(run_config("bf16", "float32", loss_scaling="dynamic"), 3)
    assert float(metrics["loss_scale"]) == 1024.0
    np.testing.assert_allclose(losses_plain, losses_scaled, rtol=1e-5)
    jax.tree.map(
        functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
        plain.params,
        scaled.params,
    )


def test_float16_with_dynamic_loss_scaling_trains():
    cfg = run_config("nvfp4", "float16", loss_scaling="dynamic")
    _, losses, metrics = train(cfg, 10)
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 1.0, losses
    scale = float(metrics["loss_scale"])
    assert scale >= 1.0 and np.log2(scale) == int(np.log2(scale))
    assert 0 <= int(metrics["skipped_total"]) < 5


def test_nonfinite_gradients_skip_the_step():
    cfg = run_config("bf16", "float32")
    _, step = compiled(cfg)
    _, state = initial(cfg)
    params = jax.tree.map(np.array, state.params)  # writable copies
    params["final_norm"]["scale"][3] = np.nan  # every gradient becomes NaN
    poisoned = state._replace(params=jax.tree.map(jnp.asarray, params))
    opt_before = jax.tree.map(np.asarray, state.opt_state)
    new, metrics = step(poisoned, fixed_batch())
    assert int(metrics["skipped"]) == 1 and int(metrics["skipped_total"]) == 1
    assert int(new.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, new.params), params)
    inner = jax.tree.map(np.asarray, new.opt_state.inner_state)
    jax.tree.map(np.testing.assert_array_equal, inner, opt_before.inner_state)


def test_eval_step_matches_train_loss():
    cfg = run_config("bf16", "float32")
    graphdef, _ = compiled(cfg)
    _, state = initial(cfg)
    loss_sum, count = jax.jit(eval_step_of(cfg, graphdef))(state.params, fixed_batch())
    _, _, metrics = train(cfg, 1, state)
    assert int(count) == 4 * 32 and count.dtype == jnp.int32
    np.testing.assert_allclose(float(loss_sum) / int(count), float(metrics["loss"]), rtol=1e-6)


def test_with_vocab_size_fills_from_data():
    assert with_vocab_size(run_config(vocab=0), 300).model.vocab_size == 300
    padded = run_config(vocab=512)
    assert with_vocab_size(padded, 300) == padded  # an explicit, larger size is kept
    with pytest.raises(ConfigError, match=">= the data's vocabulary size 300"):
        with_vocab_size(run_config(vocab=256), 300)
    with pytest.raises(ValueError, match="must be > 0, got 0"):
        with_vocab_size(run_config(vocab=0), 0)


def test_count_params_and_vocab_from_data():
    cfg = run_config(vocab=0)
    with pytest.raises(ValueError, match="vocab_size must be > 0"):
        initial(cfg)
    _, state = initial(with_vocab_size(cfg, 256))
    d, v, mlp, qkv = 64, 256, 128, (4 + 2 * 2) * 16
    per_layer = 2 * d + d * qkv + 64 * d + d * 2 * mlp + mlp * d
    assert count_params(state.params) == v * d + 2 * per_layer + d + d * v
    assert int(state.step) == 0 and state.step.dtype == jnp.int32


def test_batch_must_split_into_microbatches():
    cfg = run_config("bf16", "float32", accum=2)
    graphdef, _ = compiled(cfg)
    step = train_step_of(cfg, graphdef, run_optimizer(cfg))
    _, state = initial(cfg)
    batch = jax.tree.map(lambda x: x[:3], fixed_batch())
    with pytest.raises(ValueError, match="multiple of train.grad_accum_steps=2, got batch size 3"):
        step(state, batch)


def _linear_inputs(cfg, params, inputs_BxL):
    """Inputs (compute dtype) of layers.0.attn.qkv and layers.0.mlp.gate_up, computed directly."""
    from flax import nnx

    from nvfp4_train.model.stacked_blocks import layer_keys

    graphdef, _ = compiled(cfg)
    model = unstacked(nnx.merge(graphdef, params))
    block = model.layers["0"]
    keys = layer_keys(jax.random.fold_in(jax.random.key(cfg.train.seed), 0), 0)
    x_BxLxD = model.embed(inputs_BxL)
    qkv_in = block.attn_norm(x_BxLxD).astype(cfg.model.compute_dtype)
    h_BxLxD = x_BxLxD + block.attn(block.attn_norm(x_BxLxD), keys[0:2])
    gate_up_in = block.mlp_norm(h_BxLxD).astype(cfg.model.compute_dtype)
    return {"layers.0.attn.qkv": qkv_in, "layers.0.mlp.gate_up": gate_up_in}


def test_activation_amax_is_the_max_abs_linear_input():
    cfg = run_config("nvfp4")
    _, step = compiled(cfg)
    _, state = initial(cfg)
    assert all(float(v) == 0.0 for v in flat_amax(state.activation_amax).values())
    expected = {
        path: float(jnp.max(jnp.abs(x.astype(jnp.float32))))
        for path, x in _linear_inputs(cfg, state.params, fixed_batch()["inputs"]).items()
    }
    new, _ = step(state, fixed_batch())
    amax = {k: float(v) for k, v in flat_amax(new.activation_amax).items()}
    assert sorted(amax) == sorted(linear_paths(cfg.model))
    assert amax["layers.0.attn.qkv"] == expected["layers.0.attn.qkv"] > 0
    assert amax["layers.0.mlp.gate_up"] == pytest.approx(expected["layers.0.mlp.gate_up"], rel=1e-2)
    assert all(np.isfinite(v) and v > 0 for v in amax.values())
    again, _ = step(new, fixed_batch())  # a running max never falls
    assert all(float(v) >= amax[k] for k, v in flat_amax(again.activation_amax).items())


def test_activation_amax_is_max_reduced_over_microbatches():
    one, _, _ = train(run_config("bf16", "float32", accum=1), 1)
    two, _, _ = train(run_config("bf16", "float32", accum=2), 1)
    a, b = flat_amax(one.activation_amax), flat_amax(two.activation_amax)
    assert float(a["layers.0.attn.qkv"]) == float(b["layers.0.attn.qkv"]) > 0


def test_skipped_or_nonfinite_steps_leave_the_running_amax():
    from nvfp4_train.training.step import _updated_amax

    old = {"a": jnp.float32(2.0), "b": jnp.float32(2.0), "c": jnp.float32(2.0)}
    new = {"a": jnp.float32(3.0), "b": jnp.float32(jnp.inf), "c": jnp.float32(1.0)}
    kept = _updated_amax(old, new, jnp.bool_(False))
    assert {k: float(v) for k, v in kept.items()} == {"a": 3.0, "b": 2.0, "c": 2.0}
    skipped = _updated_amax(old, new, jnp.bool_(True))
    assert {k: float(v) for k, v in skipped.items()} == {"a": 2.0, "b": 2.0, "c": 2.0}
