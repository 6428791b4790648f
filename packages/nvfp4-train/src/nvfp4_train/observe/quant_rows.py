"""The quantization-telemetry rows of `metrics.jsonl`, and their one-phrase summary.

A telemetry row is `{"step", "quant": {path: {role: {stat: value}}}}` (`quant_row`), one path per
quantized linear and, for a routed experts' grouped linear, one per expert (`expert_path`); the
progress line shows the worst of it (`summarize_quant`). `nvfp4_train.observe.metrics`
re-exports these names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

EXPERT_TOKENS = "tokens"
"""The entry an expert's x and dy roles carry besides the statistics: the expert's rows (token
assignments) in the probed microbatch, an int."""


def expert_path(path: str, expert: int) -> str:
    """The telemetry path of one expert of a routed experts' grouped linear:
    `layers.1.mlp.experts.gate_up[3]`."""
    return f"{path}[{expert}]"


def _host_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _host_role(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """One role's host values; None for the x or dy role of an expert that got no tokens."""
    if EXPERT_TOKENS in values and int(values[EXPERT_TOKENS]) == 0:
        return None
    return {s: int(v) if s == EXPERT_TOKENS else _host_float(v) for s, v in values.items()}


def quant_row(
    step: int,
    stats: Mapping[str, Mapping[str, Mapping[str, Any]]],
    ssm: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The metrics row of one telemetry probe: `{"step": step, "quant": {path: {role: {stat:
    float}}}}`, from the probe's output (device or host scalars; None stays None). An expert's
    x and dy roles carry `EXPERT_TOKENS` (an int); an expert without tokens has none of them
    (its weight roles only), so no empty statistic reaches a reader or the health checks. A model
    with Mamba blocks adds `"ssm": {"layers.{i}": {dt_min, dt_max, dt_mean, state_norm}}`.

    Example:
        >>> quant_row(4, {}, {"layers.0": {"dt_min": 0.5}})
        {'step': 4, 'quant': {}, 'ssm': {'layers.0': {'dt_min': 0.5}}}
    """
    ssm_row = {b: {k: _host_float(v) for k, v in st.items()} for b, st in (ssm or {}).items()}
    quant = {}
    for path, roles in stats.items():
        host = {role: _host_role(values) for role, values in roles.items()}
        if kept := {role: values for role, values in host.items() if values is not None}:
            quant[path] = kept
    return {"step": int(step), "quant": quant} | ({"ssm": ssm_row} if ssm_row else {})


def _worst(quant: Mapping[str, Any], stat: str) -> tuple[float, str, str] | None:
    """(value, path, role) of the largest `stat`, a non-finite or null one counting as inf;
    None when no role carries `stat`."""
    worst = None
    for path, roles in quant.items():
        for role, values in roles.items():
            if stat not in values:
                continue
            value = None if values[stat] is None else float(values[stat])
            rank = value if value is not None and math.isfinite(value) else math.inf
            if worst is None or rank > worst[0]:
                worst = (rank, path, role)
    return worst


def _short(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else "non-finite"


def summarize_quant(stats: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """One short phrase for the progress line: the layer and role with the largest relative
    error, plus the largest underflow and saturation fractions.

    Example:
        >>> summarize_quant({"layers.3.mlp.down": {"wgrad_dy": {"rel_error": 0.142,
        ...                  "underflow": 0.0, "saturation": 0.035}}})
        'quant worst layers.3.mlp.down wgrad_dy err 0.142  max uf 0  sat 0.035'
    """
    worst = _worst(stats, "rel_error")
    if worst is None:
        return "quant -"
    parts = [f"quant worst {worst[1]} {worst[2]} err {_short(worst[0])}"]
    maxima = [(label, _worst(stats, stat)) for stat, label in (("underflow", "uf"),
              ("saturation", "sat"))]  # fmt: skip
    shown = [f"{label} {_short(w[0])}" for label, w in maxima if w is not None]
    if shown:
        parts.append("max " + "  ".join(shown))
    return "  ".join(parts)
