"""Schedules at key steps, weight-decay mask, optimizer assembly and config errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nvfp4_train.optim.loss_scaling import LossScalingConfig, current_loss_scale, skipped_steps
from nvfp4_train.optim.optimizer import OptimizerConfig, decay_mask, make_optimizer, make_schedule

PEAK = 1e-3


def lr_at(cfg: OptimizerConfig, total: int, steps) -> list[float]:
    schedule = jax.jit(make_schedule(cfg, total))
    return [float(schedule(jnp.int32(s))) for s in steps]


def test_cosine_key_steps():
    cfg = OptimizerConfig(learning_rate=PEAK, warmup_steps=10, min_lr_ratio=0.1)
    got = lr_at(cfg, 100, [0, 4, 9, 54, 99, 150])
    # warmup (s+1)/10; cosine progress (s - 10 + 1) / 90 -> 0.5 at s=54, 1 at s=99; clamped after.
    want = [1e-4, 5e-4, 1e-3, 1e-4 + 0.9e-3 * 0.5, 1e-4, 1e-4]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cosine_is_non_increasing_after_warmup():
    cfg = OptimizerConfig(learning_rate=PEAK, warmup_steps=5)
    values = lr_at(cfg, 60, range(4, 60))
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:], strict=False))


@pytest.mark.parametrize(("shape", "mid"), [("linear", 0.5), ("1-sqrt", math.sqrt(0.5))])
def test_wsd_key_steps(shape, mid):
    cfg = OptimizerConfig(
        learning_rate=PEAK, schedule="wsd", warmup_steps=10, decay_fraction=0.2,
        wsd_decay_shape=shape, min_lr_ratio=0.0,
    )  # fmt: skip
    # decay starts at 100 - 20 = 80; progress (s - 80 + 1) / 20 -> 0.5 at s=89.
    got = lr_at(cfg, 100, [0, 9, 10, 50, 79, 89, 99])
    want = [1e-4, PEAK, PEAK, PEAK, PEAK, PEAK * (1 - mid), 0.0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_constant_and_warmup_fraction():
    cfg = OptimizerConfig(learning_rate=PEAK, schedule="constant", warmup_fraction=0.1)
    assert cfg.resolved_warmup_steps(200) == 20
    np.testing.assert_allclose(
        lr_at(cfg, 200, [0, 19, 20, 199]), [5e-5, PEAK, PEAK, PEAK], rtol=1e-6
    )
    no_warmup = OptimizerConfig(learning_rate=PEAK, schedule="constant", warmup_steps=0)
    np.testing.assert_allclose(lr_at(no_warmup, 10, [0, 9]), [PEAK, PEAK], rtol=1e-6)


def params_tree():
    return {
        "embed": {"embedding": jnp.ones((8, 16))},
        "layers": {"0": {"attn_norm": {"scale": jnp.ones(16)}, "mlp": {"down": {"kernel": jnp.ones((16, 16))}}}},
        "lm_head": {"kernel": jnp.ones((16, 8))},
    }  # fmt: skip


def test_decay_mask_excludes_norms_and_embeddings_by_default():
    mask = decay_mask(OptimizerConfig(), params_tree())
    assert mask["embed"]["embedding"] is False
    assert mask["layers"]["0"]["attn_norm"]["scale"] is False
    assert mask["layers"]["0"]["mlp"]["down"]["kernel"] is True
    assert mask["lm_head"]["kernel"] is True
    custom = decay_mask(OptimizerConfig(no_decay=("lm_head",)), params_tree())
    assert custom["embed"]["embedding"] is True and custom["lm_head"]["kernel"] is False


def test_weight_decay_only_touches_masked_in_params():
    cfg = OptimizerConfig(learning_rate=0.1, schedule="constant", warmup_steps=0, weight_decay=0.5)
    tx = make_optimizer(cfg, total_steps=10)
    params = params_tree()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    np.testing.assert_allclose(updates["layers"]["0"]["mlp"]["down"]["kernel"], -0.05)
    np.testing.assert_allclose(updates["lm_head"]["kernel"], -0.05)
    np.testing.assert_array_equal(updates["embed"]["embedding"], 0.0)
    np.testing.assert_array_equal(updates["layers"]["0"]["attn_norm"]["scale"], 0.0)


def test_clipping_bounds_the_first_sgd_like_step():
    # Adam's first step is nearly scale-free, so look at its state: mu = (1 - b1) * clipped grad.
    cfg = OptimizerConfig(b1=0.5, grad_clip_norm=1.0, weight_decay=0.0)
    tx = make_optimizer(cfg, total_steps=10)
    params = {"w": jnp.zeros(4)}
    grads = {"w": jnp.array([30.0, 40.0, 0.0, 0.0])}  # norm 50 -> clipped to norm 1
    _, state = tx.update(grads, tx.init(params), params)
    mu = optax.tree_utils.tree_get(state, "mu")
    np.testing.assert_allclose(mu["w"], 0.5 * np.array([0.6, 0.8, 0.0, 0.0]), rtol=1e-6)


def test_make_optimizer_wraps_the_loss_scaling_section():
    scaling = LossScalingConfig(mode="dynamic", initial_scale=64.0)
    state = make_optimizer(OptimizerConfig(loss_scaling=scaling), 10).init({"w": jnp.ones(3)})
    assert float(current_loss_scale(state)) == 64.0
    assert int(skipped_steps(state)) == 0
    plain = make_optimizer(OptimizerConfig(), total_steps=10).init({"w": jnp.ones(3)})
    assert float(current_loss_scale(plain)) == 1.0
    assert optax.tree_utils.tree_get(plain, "skipped_steps") is not None  # skip-step by default
    bare = OptimizerConfig(loss_scaling=LossScalingConfig(skip_nonfinite=False))
    assert optax.tree_utils.tree_get(make_optimizer(bare, 10).init({"w": jnp.ones(3)}),
                                     "skipped_steps") is None  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule": "linear"}, "optimizer.schedule must be one of"),
        ({"learning_rate": 0.0}, "optimizer.learning_rate must be > 0"),
        ({"warmup_steps": -3}, "optimizer.warmup_steps must be >= 0 or -1"),
        ({"decay_fraction": 1.5}, "optimizer.decay_fraction must be in \\[0, 1\\]"),
        ({"wsd_decay_shape": "cosine"}, "optimizer.wsd_decay_shape must be one of"),
        ({"b2": 1.0}, "optimizer.b2 must be in \\[0, 1\\)"),
        ({"no_decay": "norm"}, "optimizer.no_decay must be a list"),
        ({"no_decay": ("(",)}, "bad regex"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_schedule_rejects_empty_run():
    with pytest.raises(ValueError, match="total_steps must be >= 1, got 0"):
        make_schedule(OptimizerConfig(), 0)
