"""Health of the quantization statistics: warn when a layer's statistic leaves its healthy range.

A pure tracker in the optax style: `make_health_tracker(cfg)` returns `init()` and
`update(state, stats, step=None) -> (state, warnings)`. A statistic above its limit for `patience`
consecutive probes gets ONE warning line naming the layer, the GEMM operand role, the statistic,
its value, the limit and for how many probes; one more line when it comes back in range. A
non-finite amax is reported at once (no patience).

Example:
    >>> tracker = make_health_tracker(QuantHealthConfig(patience=1))
    >>> stats = {"layers.1.mlp.down": {"wgrad_dy": {"amax": 1.0, "underflow": 0.0,
    ...                                              "saturation": 0.0, "rel_error": 0.5}}}
    >>> state, lines = tracker.update(tracker.init(), stats, step=100)
    >>> print(lines[0])
    quant health: layers.1.mlp.down wgrad_dy rel_error 0.5 above its limit 0.2 for 1 probe (since step 100)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

ROLE_FAMILIES = {
    "fprop_x": "activation",
    "wgrad_x": "activation",
    "fprop_w": "weight",
    "dgrad_w": "weight",
    "dgrad_dy": "gradient",
    "wgrad_dy": "gradient",
}
"""The family (and so the limits) of each GEMM operand role of `nvfp4_ops.gemm_operand_stats`."""

LIMITED_STATS = ("underflow", "saturation", "rel_error")
"""The statistics with an upper limit; `amax` is only checked for being finite."""

Stats = Mapping[str, Mapping[str, Mapping[str, float]]]
"""{linear path: {role: {stat: value}}} (host floats; None for a non-finite value read back)."""


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value}")


@dataclasses.dataclass(frozen=True)
class StatLimits:
    """Upper limits of the statistics of one family of operands (fractions, see docs/telemetry.md).

    Attributes:
        underflow: fraction of nonzero blocks whose scale decodes to 0.
        saturation: fraction of nonzero elements clipped at the format's max (+-6 for FP4).
        rel_error: ||x - Q(x)|| / ||x||.
    """

    underflow: float = 0.01
    saturation: float = 0.1
    rel_error: float = 0.2

    def __post_init__(self) -> None:
        for name in LIMITED_STATS:
            _check_fraction(name, getattr(self, name))


@dataclasses.dataclass(frozen=True)
class QuantHealthConfig:
    """When the quantization statistics count as unhealthy (`logging.quant_health`).

    The defaults are the largest values of healthy NVFP4 runs (examples/configs/tiny.yaml, 300
    steps, and small.yaml, 600 steps, probed every 10 / 25 steps) with 1.3x-5x headroom; see
    docs/telemetry.md for the measured values.

    Attributes:
        activation: limits for the layer inputs (roles fprop_x, wgrad_x).
        weight: limits for the kernels (roles fprop_w, dgrad_w).
        gradient: limits for the incoming gradients (roles dgrad_dy, wgrad_dy).
        patience: consecutive probes a statistic must stay above its limit before a warning.
    """

    activation: StatLimits = dataclasses.field(
        default_factory=lambda: StatLimits(underflow=0.01, saturation=0.1, rel_error=0.15)
    )
    weight: StatLimits = dataclasses.field(
        default_factory=lambda: StatLimits(underflow=0.01, saturation=0.02, rel_error=0.15)
    )
    gradient: StatLimits = dataclasses.field(
        default_factory=lambda: StatLimits(underflow=0.02, saturation=0.06, rel_error=0.2)
    )
    patience: int = 3

    def __post_init__(self) -> None:
        if self.patience < 1:
            raise ValueError(f"logging.quant_health.patience must be >= 1, got {self.patience}")

    def limits(self, role: str) -> StatLimits:
        """The limits of `role` (one of `ROLE_FAMILIES`)."""
        if role not in ROLE_FAMILIES:
            raise ValueError(f"role must be one of {sorted(ROLE_FAMILIES)}, got {role!r}")
        return getattr(self, ROLE_FAMILIES[role])


class HealthState(NamedTuple):
    """What the tracker remembers between probes.

    Attributes:
        streaks: (path, role, stat) -> (consecutive probes out of range, step of the first).
        reported: the (path, role, stat) currently warned about.
    """

    streaks: Mapping[tuple[str, str, str], tuple[int, Any]]
    reported: frozenset[tuple[str, str, str]]


class HealthTracker(NamedTuple):
    """Pure functions: `init() -> state`, `update(state, stats, step=None) -> (state, lines)`."""

    init: Callable[[], HealthState]
    update: Callable[..., tuple[HealthState, list[str]]]


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(float(value))


def _fmt(value: Any) -> str:
    return "null" if value is None else f"{float(value):.4g}"


def _intervals(n: int) -> str:
    return f"{n} probe" if n == 1 else f"{n} probes"


def _checks(cfg: QuantHealthConfig, role: str, values: Mapping[str, Any]):
    """(stat, value, limit or None, out of range, patience) of one role's statistics."""
    if "amax" in values:
        yield "amax", values["amax"], None, not _finite(values["amax"]), 1
    limits = cfg.limits(role)
    for stat in LIMITED_STATS:
        if stat in values:
            value, limit = values[stat], getattr(limits, stat)
            bad = not _finite(value) or float(value) > limit
            yield stat, value, limit, bad, cfg.patience


def _started(what: tuple[str, str, str], value, limit, count: int, since) -> str:
    path, role, stat = what
    if limit is None:
        at = f" at step {since}" if since is not None else ""
        return f"quant health: {path} {role} {stat} is {_fmt(value)}, not finite{at}"
    where = f" (since step {since})" if since is not None else ""
    return (
        f"quant health: {path} {role} {stat} {_fmt(value)} above its limit {limit:g} "
        f"for {_intervals(count)}{where}"
    )


def _recovered(what: tuple[str, str, str], value, limit, count: int) -> str:
    path, role, stat = what
    bound = "finite" if limit is None else f"<= {limit:g}"
    return (
        f"quant health: {path} {role} {stat} back in range ({_fmt(value)}, {bound}) "
        f"after {_intervals(count)}"
    )


def make_health_tracker(cfg: QuantHealthConfig) -> HealthTracker:
    """The tracker of `cfg`'s limits; see the module docstring."""

    def init() -> HealthState:
        return HealthState({}, frozenset())

    def update(state: HealthState, stats: Stats, step: Any = None):
        streaks, reported, lines = dict(state.streaks), set(state.reported), []
        for path, roles in stats.items():
            for role, values in roles.items():
                for stat, value, limit, bad, patience in _checks(cfg, role, values):
                    what = (path, role, stat)
                    count, since = streaks.pop(what, (0, step))
                    if bad:
                        streaks[what] = (count + 1, since)
                        if count + 1 >= patience and what not in reported:
                            reported.add(what)
                            lines.append(_started(what, value, limit, count + 1, since))
                    elif what in reported:
                        reported.discard(what)
                        lines.append(_recovered(what, value, limit, count))
        return HealthState(streaks, frozenset(reported)), lines

    return HealthTracker(init, update)
