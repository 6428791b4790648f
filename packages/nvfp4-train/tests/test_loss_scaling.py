"""skip_nonfinite and dynamic_loss_scaling as optax transformations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nvfp4_train.optim.loss_scaling import (
    LossScalingConfig,
    all_finite,
    current_loss_scale,
    dynamic_loss_scaling,
    last_step_skipped,
    skip_nonfinite,
    skipped_steps,
)

PARAMS = {"a": jnp.array([1.0, -2.0, 3.0]), "b": jnp.ones((2, 2))}


def grads(value: float = 0.5, bad=None):
    g = jax.tree.map(lambda p: jnp.full_like(p, value), PARAMS)
    if bad is not None:
        g["b"] = g["b"].at[0, 1].set(bad)
    return g


def assert_trees_equal(x, y):
    jax.tree.map(np.testing.assert_array_equal, x, y)


def test_all_finite():
    assert bool(all_finite(grads()))
    assert not bool(all_finite(grads(bad=jnp.nan)))
    assert not bool(all_finite(grads(bad=-jnp.inf)))
    assert bool(all_finite({}))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_skip_nonfinite_leaves_params_and_state_unchanged(bad):
    tx = skip_nonfinite(optax.adam(0.1))
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    updates, state = update(grads(), state, PARAMS)  # one good step first
    params = optax.apply_updates(PARAMS, updates)
    inner_before = state.inner_state

    updates, state = update(grads(bad=bad), state, params)
    assert_trees_equal(optax.apply_updates(params, updates), params)
    assert_trees_equal(state.inner_state, inner_before)
    assert int(skipped_steps(state)) == 1 and bool(last_step_skipped(state))

    updates, state = update(grads(), state, params)
    assert float(jnp.abs(updates["a"]).max()) > 0
    assert int(skipped_steps(state)) == 1 and not bool(last_step_skipped(state))
    assert int(optax.tree_utils.tree_get(state, "count")) == 2  # Adam saw the 2 good steps only


def test_dynamic_loss_scaling_unscales_gradients():
    tx = dynamic_loss_scaling(skip_nonfinite(optax.sgd(1.0)), initial_scale=1024.0)
    state = tx.init(PARAMS)
    scaled = jax.tree.map(lambda g: g * current_loss_scale(state), grads(0.25))
    updates, _ = tx.update(scaled, state, PARAMS)
    jax.tree.map(lambda u: np.testing.assert_allclose(u, -0.25), updates)


def test_dynamic_loss_scale_grows_after_interval_and_shrinks_on_overflow():
    tx = dynamic_loss_scaling(
        skip_nonfinite(optax.sgd(1.0)), initial_scale=8.0, growth_interval=3, min_scale=2.0
    )
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    scales = []
    for bad in (None, None, None, None, jnp.inf, jnp.nan, jnp.nan, jnp.nan, None):
        _, state = update(grads(bad=bad), state, PARAMS)
        scales.append(float(current_loss_scale(state)))
    # 3 finite steps -> x2; overflow -> /2 each time, floored at min_scale=2.
    assert scales == [8.0, 8.0, 16.0, 16.0, 8.0, 4.0, 2.0, 2.0, 2.0]
    assert int(skipped_steps(state)) == 4
    assert int(state.good_steps) == 1


def test_overflowing_step_is_skipped_under_loss_scaling():
    tx = dynamic_loss_scaling(skip_nonfinite(optax.adam(0.1)), initial_scale=4.0)
    state = tx.init(PARAMS)
    updates, state = tx.update(grads(bad=jnp.inf), state, PARAMS)
    assert_trees_equal(optax.apply_updates(PARAMS, updates), PARAMS)
    assert bool(last_step_skipped(state)) and float(current_loss_scale(state)) == 2.0


def test_defaults_without_the_transforms():
    state = optax.adam(0.1).init(PARAMS)
    assert float(current_loss_scale(state)) == 1.0
    assert int(skipped_steps(state)) == 0
    assert not bool(last_step_skipped(state))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"growth_interval": 0}, "growth_interval must be >= 1"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
    ],
)
def test_dynamic_loss_scaling_argument_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dynamic_loss_scaling(optax.sgd(1.0), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "static"}, "optimizer.loss_scaling.mode must be one of"),
        ({"mode": "dynamic", "skip_nonfinite": False}, "skip_nonfinite must be true"),
        ({"growth_interval": 0}, "optimizer.loss_scaling.growth_interval must be >= 1"),
        ({"initial_scale": 0.0}, "optimizer.loss_scaling.initial_scale must be > 0"),
    ],
)
def test_loss_scaling_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossScalingConfig(**kwargs)
