"""Rotary position embedding (RoPE) frequencies, scaled by Hugging Face's `rope_scaling` formulas.

The rope types export writes (`ROPE_TYPES`): "default" (no scaling), "linear" (every frequency
divided by `factor`) and "llama3" (long wavelengths divided by `factor`, short ones kept, a
smooth blend between), computed in float32."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nvfp4_export.errors import ExportError

ROPE_TYPES = ("default", "linear", "llama3")
"""The `rope_scaling.rope_type` values a model spec may have."""


def rope_scaling_of(section: Any) -> dict[str, Any] | None:
    """A training config's `model.rope_scaling` as a spec holds it: None for none or "default".

    Raises:
        ExportError: it is not a mapping.
    """
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ExportError(
            f"the checkpoint config's model.rope_scaling must be a mapping, got {section!r}"
        )
    return dict(section) if section.get("rope_type", "default") != "default" else None


def scaled_rope(rope_scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`rope_scaling` as a dict unless it is None or of rope_type "default" (then None)."""
    scaling = rope_scaling or {}
    return dict(scaling) if scaling.get("rope_type", "default") != "default" else None


def rope_inv_freq(
    head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None
) -> np.ndarray:
    """float32 [head_dim / 2] RoPE frequencies, scaled by `rope_scaling` (HF's formulas).

    Example:
        >>> rope_inv_freq(4, 10000.0, None)
        array([1.  , 0.01], dtype=float32)
    """
    half = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope_theta) ** half)).astype(np.float32)
    scaling = scaled_rope(rope_scaling)
    if scaling is None:
        return inv_freq
    factor = np.float32(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return (inv_freq / factor).astype(np.float32)
    low, high = np.float32(scaling["low_freq_factor"]), np.float32(scaling["high_freq_factor"])
    old = np.float32(scaling["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
