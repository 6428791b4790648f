"""Skip-step on non-finite gradients and dynamic loss scaling, as optax gradient transformations.

Both wrap an inner transformation, in the shape of `optax.apply_if_finite`:

    tx = dynamic_loss_scaling(skip_nonfinite(optax.adamw(...)), initial_scale=2.0**15)

`dynamic_loss_scaling` expects the gradients of `loss * scale` (read the scale with
`current_loss_scale(opt_state)`), divides them by the scale, and halves the scale on a
non-finite step or doubles it after `growth_interval` finite steps. `skip_nonfinite` leaves
params and inner state unchanged (zero updates) on a non-finite step and counts it.
`LossScalingConfig` is the run config's `optimizer.loss_scaling` section that chooses them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu

LOSS_SCALING_MODES = ("none", "dynamic")


@dataclasses.dataclass(frozen=True)
class LossScalingConfig:
    """Loss scaling and the skip-step it relies on (`optimizer.loss_scaling`).

    Attributes:
        mode: "none" or "dynamic" (`dynamic_loss_scaling`, for float16 compute).
        initial_scale: the dynamic loss scale at step 0.
        growth_interval: consecutive finite steps after which the dynamic scale doubles.
        skip_nonfinite: skip the update (params and optimizer state unchanged) when any gradient
            is NaN/Inf (`skip_nonfinite`); the count is kept in the optimizer state. Required by
            "dynamic" (an overflowed step must be skipped).

    Example:
        >>> LossScalingConfig(mode="dynamic", initial_scale=1024.0).growth_interval
        2000
    """

    mode: str = "none"
    initial_scale: float = 2.0**15
    growth_interval: int = 2000
    skip_nonfinite: bool = True

    def __post_init__(self) -> None:
        where = "optimizer.loss_scaling"
        if self.mode not in LOSS_SCALING_MODES:
            raise ValueError(f"{where}.mode must be one of {LOSS_SCALING_MODES}, got {self.mode!r}")
        if self.mode == "dynamic" and not self.skip_nonfinite:
            raise ValueError(
                f"{where}.skip_nonfinite must be true when {where}.mode is 'dynamic' "
                "(an overflowed step must be skipped), got false"
            )
        if not self.initial_scale > 0:
            raise ValueError(f"{where}.initial_scale must be > 0, got {self.initial_scale}")
        if self.growth_interval < 1:
            raise ValueError(f"{where}.growth_interval must be >= 1, got {self.growth_interval}")


def all_finite(tree) -> jax.Array:
    """Scalar bool: every leaf of `tree` is finite."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


class SkipNonFiniteState(NamedTuple):
    """State of `skip_nonfinite`.

    Attributes:
        skipped_steps: int32 total number of skipped updates.
        last_skipped: bool, whether the most recent update was skipped.
        inner_state: The wrapped transformation's state (unchanged by a skipped update).
    """

    skipped_steps: jax.Array
    last_skipped: jax.Array
    inner_state: optax.OptState


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Applies `inner` only when all gradients are finite; otherwise returns zero updates.

    Example:
        >>> tx = skip_nonfinite(optax.sgd(0.1))
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> updates, state = tx.update({"w": jnp.array([jnp.nan, 1.0])}, state, {"w": jnp.ones(2)})
        >>> int(state.skipped_steps), updates["w"].tolist()
        (1, [0.0, 0.0])
    """

    def init_fn(params):
        return SkipNonFiniteState(
            skipped_steps=jnp.zeros((), jnp.int32),
            last_skipped=jnp.zeros((), bool),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        finite = all_finite(updates)
        safe_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        new_updates, new_inner = inner.update(safe_updates, state.inner_state, params, **extra_args)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state
        )
        return new_updates, SkipNonFiniteState(
            skipped_steps=state.skipped_steps + (~finite).astype(jnp.int32),
            last_skipped=~finite,
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class DynamicLossScaleState(NamedTuple):
    """State of `dynamic_loss_scaling`.

    Attributes:
        loss_scale: float32 scalar the loss is multiplied by before differentiation.
        good_steps: int32 finite steps since the scale last changed.
        inner_state: The wrapped transformation's state.
    """

    loss_scale: jax.Array
    good_steps: jax.Array
    inner_state: optax.OptState


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
) -> optax.GradientTransformation:
    """Unscales gradients of `loss * loss_scale`, then adapts the scale.

    A non-finite gradient multiplies the scale by `backoff_factor` (not below `min_scale`); after
    `growth_interval` consecutive finite steps it is multiplied by `growth_factor`. Wrap an inner
    `skip_nonfinite(...)` so that the non-finite step itself is skipped.

    Example:
        >>> tx = dynamic_loss_scaling(skip_nonfinite(optax.sgd(0.1)), initial_scale=8.0)
        >>> state = tx.init({"w": jnp.ones(2)})
        >>> _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, state)
        >>> float(current_loss_scale(state))
        4.0
    """
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
    if not (growth_factor >= 1.0 and 0.0 < backoff_factor < 1.0):
        raise ValueError(
            f"need growth_factor >= 1 and 0 < backoff_factor < 1, "
            f"got {growth_factor} and {backoff_factor}"
        )

    def init_fn(params):
        return DynamicLossScaleState(
            loss_scale=jnp.asarray(initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        inv_scale = 1.0 / state.loss_scale
        unscaled = jax.tree.map(lambda g: (g * inv_scale).astype(g.dtype), updates)
        finite = all_finite(unscaled)
        new_updates, new_inner = inner.update(unscaled, state.inner_state, params, **extra_args)
        grow = finite & (state.good_steps + 1 >= growth_interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, state.loss_scale * growth_factor, state.loss_scale),
            jnp.maximum(state.loss_scale * backoff_factor, min_scale),
        )
        good_steps = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        return new_updates, DynamicLossScaleState(
            loss_scale=scale.astype(jnp.float32),
            good_steps=good_steps.astype(jnp.int32),
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def current_loss_scale(opt_state: optax.OptState) -> jax.Array:
    """The dynamic loss scale held in `opt_state`, or 1.0 when loss scaling is off."""
    return jnp.asarray(otu.tree_get(opt_state, "loss_scale", default=1.0), jnp.float32)


def skipped_steps(opt_state: optax.OptState) -> jax.Array:
    """Total skipped (non-finite) updates recorded in `opt_state` (0 when skipping is off)."""
    return jnp.asarray(otu.tree_get(opt_state, "skipped_steps", default=0), jnp.int32)


def last_step_skipped(opt_state: optax.OptState) -> jax.Array:
    """Whether the latest update recorded in `opt_state` was skipped (False when skipping is off)."""
    return jnp.asarray(otu.tree_get(opt_state, "last_skipped", default=False), bool)


def with_loss_scaling(
    tx: optax.GradientTransformation, cfg: LossScalingConfig
) -> optax.GradientTransformation:
    """`tx` wrapped as `cfg` says: in `skip_nonfinite`, then in `dynamic_loss_scaling`.

    Example:
        >>> tx = with_loss_scaling(optax.sgd(0.1), LossScalingConfig(mode="dynamic"))
        >>> float(current_loss_scale(tx.init({"w": jnp.ones(2)})))
        32768.0
    """
    if cfg.skip_nonfinite:
        tx = skip_nonfinite(tx)
    if cfg.mode == "dynamic":
        tx = dynamic_loss_scaling(
            tx, initial_scale=cfg.initial_scale, growth_interval=cfg.growth_interval
        )
    return tx
