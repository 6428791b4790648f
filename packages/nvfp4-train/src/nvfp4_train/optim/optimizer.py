"""AdamW with warmup + cosine / WSD / constant schedules, clipping, decay mask, skip-step.

`make_optimizer` builds, outermost first:
    dynamic_loss_scaling (optimizer.loss_scaling.mode == "dynamic")
      -> skip_nonfinite (optimizer.loss_scaling.skip_nonfinite)
        -> clip_by_global_norm (grad_clip_norm > 0)
          -> adamw(schedule, mask = no decay on paths matching `no_decay`)
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import optax

from nvfp4_train.model.moe.layer import ROUTER_BIAS
from nvfp4_train.model.stacking import canonical_path, global_norm
from nvfp4_train.optim.loss_scaling import LossScalingConfig, with_loss_scaling
from nvfp4_train.tree_paths import key_names

SCHEDULES = ("cosine", "wsd", "constant")
WSD_DECAY_SHAPES = ("linear", "1-sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule.

    Attributes:
        learning_rate: Peak learning rate.
        schedule: "cosine" (warmup, then cosine to min), "wsd" (warmup, stable, decay over the
            last `decay_fraction` of the steps) or "constant" (warmup, then flat).
        warmup_steps: Linear warmup length; -1 = round(warmup_fraction * total_steps).
        warmup_fraction: Warmup length as a fraction of the run, used when warmup_steps == -1.
        min_lr_ratio: Final learning rate as a fraction of the peak (cosine and wsd).
        decay_fraction: WSD: fraction of the steps spent decaying.
        wsd_decay_shape: WSD: "linear" or "1-sqrt".
        b1: Adam beta1.
        b2: Adam beta2.
        eps: Adam epsilon.
        weight_decay: Decoupled weight decay.
        no_decay: Regexes (re.search) on dotted parameter paths such as
            `layers.0.attn_norm.scale` that get no weight decay (by default norms, biases
            (Mamba's dt_bias too), embeddings, and Mamba's A_log and D, as Mamba-2 trains).
        grad_clip_norm: Global-norm clipping threshold; 0 disables clipping.
        loss_scaling: loss scaling and skip-step on non-finite gradients (`LossScalingConfig`).

    Example:
        >>> schedule = make_schedule(OptimizerConfig(learning_rate=1e-3, warmup_steps=10), 100)
        >>> [round(float(schedule(s)), 6) for s in (0, 9, 99)]
        [0.0001, 0.001, 0.0001]
    """

    learning_rate: float = 3e-4
    schedule: str = "cosine"
    warmup_steps: int = -1
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    wsd_decay_shape: str = "linear"
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("norm", "bias", "embed", "A_log", r"mamba\.D$")
    grad_clip_norm: float = 1.0
    loss_scaling: LossScalingConfig = dataclasses.field(default_factory=LossScalingConfig)

    def __post_init__(self):
        checks = [
            ("learning_rate", self.learning_rate > 0, "> 0"),
            ("schedule", self.schedule in SCHEDULES, f"one of {SCHEDULES}"),
            ("warmup_steps", self.warmup_steps >= -1, ">= 0 or -1 (use warmup_fraction)"),
            ("warmup_fraction", 0 <= self.warmup_fraction <= 1, "in [0, 1]"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("decay_fraction", 0 <= self.decay_fraction <= 1, "in [0, 1]"),
            ("wsd_decay_shape", self.wsd_decay_shape in WSD_DECAY_SHAPES, f"one of {WSD_DECAY_SHAPES}"),
            ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("grad_clip_norm", self.grad_clip_norm >= 0, ">= 0 (0 disables clipping)"),
        ]  # fmt: skip
        for key, ok, expected in checks:
            if not ok:
                raise ValueError(f"optimizer.{key} must be {expected}, got {getattr(self, key)!r}")
        if isinstance(self.no_decay, str):
            raise ValueError(f"optimizer.no_decay must be a list of regexes, got {self.no_decay!r}")
        for pattern in self.no_decay:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"optimizer.no_decay: bad regex {pattern!r}: {err}") from err

    def resolved_warmup_steps(self, total_steps: int) -> int:
        """Warmup length in steps for a run of `total_steps`."""
        if self.warmup_steps >= 0:
            return self.warmup_steps
        return int(round(self.warmup_fraction * total_steps))


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step (0-based), jit-friendly.

    Warmup: lr(s) = peak * (s + 1) / W for s < W, so step 0 already trains. Cosine: from peak at
    step W - 1 down to `min_lr_ratio * peak` at the last step `total_steps - 1`. WSD: peak until
    the decay starts at D = total_steps - round(decay_fraction * total_steps) (not before W),
    then linear or 1-sqrt down to the minimum at the last step. Constant: peak after warmup.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    peak, floor = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    warmup = min(cfg.resolved_warmup_steps(total_steps), total_steps)
    decay_start = max(total_steps - int(round(cfg.decay_fraction * total_steps)), warmup)

    def progress(step, start):
        return jnp.clip((step - start + 1) / max(total_steps - start, 1), 0.0, 1.0)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1) / max(warmup, 1)
        if cfg.schedule == "constant":
            after = jnp.asarray(peak, jnp.float32)
        elif cfg.schedule == "cosine":
            after = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress(step, warmup)))
        else:
            p = progress(step, decay_start)
            shape = p if cfg.wsd_decay_shape == "linear" else jnp.sqrt(p)
            after = jnp.where(step < decay_start, peak, peak - (peak - floor) * shape)
        return jnp.where(step < warmup, warm, after).astype(jnp.float32)

    return schedule


def decay_mask(cfg: OptimizerConfig, params) -> dict:
    """Pytree of bools like `params`: True where weight decay applies (path matches no
    `no_decay`; never the MoE routers' balancing bias, which the optimizer must leave as it is:
    its gradient is zero, so AdamW without decay does not move it)."""
    patterns = [re.compile(p) for p in cfg.no_decay]

    def decays(path, _leaf) -> bool:
        names = key_names(path)
        if names[-1] == ROUTER_BIAS:
            return False
        dotted = canonical_path(".".join(names))  # a stacked run decays as its blocks
        return not any(p.search(dotted) for p in patterns)

    return jax.tree_util.tree_map_with_path(decays, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with the norm of `stacking.global_norm`: stacked blocks
    (`model.scan_layers`) sum their squares in the same order as unstacked ones, so they are
    clipped by the very same factor."""

    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip_fn, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    """The training optimizer of `cfg` (the run config's `optimizer` section).

    Args:
        cfg: AdamW, its schedule, clipping, decay mask and `loss_scaling`.
        total_steps: Length of the run (for the schedule).

    Example:
        >>> tx = make_optimizer(OptimizerConfig(), total_steps=100)
        >>> state = tx.init({"w": jnp.ones((16, 16))})
    """
    adamw = optax.adamw(
        make_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=lambda params: decay_mask(cfg, params),
    )  # fmt: skip
    tx = adamw if cfg.grad_clip_norm == 0 else optax.chain(
        clip_by_global_norm(cfg.grad_clip_norm), adamw
    )  # fmt: skip
    return with_loss_scaling(tx, cfg.loss_scaling)
