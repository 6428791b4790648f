"""MXFP4 (OCP Microscaling v1.0): E2M1 elements in 32-element blocks with an E8M0 power-of-two scale.

No tensor scale; 4.25 bits per element. Two rules choose a block's exponent e (scale 2^e):

- "ocp": e = floor(log2(amax_block)) - 2, the OCP spec's rule (the block max may clip at 6).
- "ceil": e = ceil(log2(amax_block / 6)), NVIDIA's rule: the smallest e with 6 * 2^e >= amax_block,
  computed exactly, so nothing clips.

e is clamped to [-127, 125]: the E8M0 range, capped at 125 so that every decoded value stays finite
in float32 (only the "ceil" rule can ask for more, for blocks with amax > 6 * 2^125 ~ 2.6e38, which
then clip at 6 instead of decoding to Inf); an all-zero block gets e = -127 (byte 0). Scales are
stored as E8M0 bytes, e + 127 (compressed-tensors' `weight_scale` layout); byte 255 is NaN and marks
a block with non-finite input on the JAX path.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from nvfp4_format._namespace import (
    check_fields,
    check_finite,
    check_float,
    check_logical_shape,
    check_rounding,
    check_uniform,
    is_jax_array,
    namespace,
)
from nvfp4_format._pytree import register_dataclass
from nvfp4_format.e2m1 import E2M1_MAX, encode_e2m1
from nvfp4_format.packing import decode_packed, pack_fp4, unpack_fp4

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_NAN = 255
MAX_EXPONENT = 125
SCALE_RULES = ("ocp", "ceil")


@dataclasses.dataclass(frozen=True, eq=False)
class MXFP4Array:
    """An MXFP4-quantized tensor. Blocks of 32 run along the last axis.

    Attributes:
      packed: uint8 [..., K/2], two E2M1 codes per byte (even index in the low nibble).
      scales: uint8 [..., K/32], E8M0 biased exponents: the block scale is 2^(byte - 127).
      shape: the logical shape [..., K].
      scale_rule: "ocp" or "ceil", the rule that chose the exponents.
    """

    packed: Any
    scales: Any
    shape: tuple[int, ...]
    scale_rule: str = "ocp"

    def __post_init__(self) -> None:
        shape = check_logical_shape("MXFP4Array", self.shape, MX_BLOCK_SIZE)
        object.__setattr__(self, "shape", shape)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(
                f"MXFP4Array.scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}"
            )
        lead, k = shape[:-1], shape[-1]
        check_fields("MXFP4Array", shape, {
            "packed": (self.packed, np.uint8, (*lead, k // 2)),
            "scales": (self.scales, np.uint8, (*lead, k // MX_BLOCK_SIZE)),
        })  # fmt: skip

    def codes(self) -> Any:
        """The unpacked uint8 E2M1 codes [..., K]."""
        return unpack_fp4(self.packed)


register_dataclass(MXFP4Array, ["packed", "scales"], ["shape", "scale_rule"])


def quantize_mxfp4(
    x: Any, scale_rule: str = "ocp", *, rounding: str = "rne", uniform: Any = None
) -> MXFP4Array:
    """Quantize `x` [..., K] (K % 32 == 0) to MXFP4 with blocks of 32 along the last axis.

    Example:
      >>> q = quantize_mxfp4(np.full(32, 3.0, np.float32))
      >>> int(q.scales[0]) - 127, dequantize_mxfp4(q)[:2]
      (-1, array([3., 3.], dtype=float32))
    """
    check_float("x", x)
    xp = namespace(x, uniform)
    check_rounding(rounding)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if x.ndim < 1 or x.shape[-1] % MX_BLOCK_SIZE:
        raise ValueError(
            f"x's last dimension K must be a multiple of 32 for MXFP4 blocks, got shape {tuple(x.shape)}"
        )
    check_finite("x", x)
    if rounding == "stochastic":
        check_uniform("uniform", uniform, tuple(x.shape))
    if x.size == 0:
        *lead, k = x.shape
        empty = (
            xp.zeros((*lead, k // 2), xp.uint8),
            xp.zeros((*lead, k // MX_BLOCK_SIZE), xp.uint8),
        )
        return MXFP4Array(*empty, tuple(x.shape), scale_rule)
    x32 = xp.asarray(x, dtype=xp.float32)
    blocks = x32.reshape(*x32.shape[:-1], -1, MX_BLOCK_SIZE)
    amax = mx_block_amax(xp, blocks)
    exponent = _block_exponent(xp, amax, scale_rule)
    scaled = xp.clip(xp.ldexp(blocks, -exponent[..., None]), -E2M1_MAX, E2M1_MAX)
    codes = encode_e2m1(scaled.reshape(x32.shape), rounding=rounding, uniform=uniform)
    scales = xp.where(xp.isfinite(amax), exponent + E8M0_BIAS, E8M0_NAN).astype(xp.uint8)
    return MXFP4Array(pack_fp4(codes), scales, tuple(x.shape), scale_rule)


def dequantize_mxfp4(a: MXFP4Array, dtype: Any = np.float32) -> Any:
    """Decode an `MXFP4Array`: e2m1_value * 2^(scale byte - 127), then cast (byte 255 -> NaN)."""
    if not isinstance(a, MXFP4Array):
        raise TypeError(f"a must be an MXFP4Array, got {type(a).__name__}")
    xp = namespace(a.packed, a.scales)
    if math.prod(a.shape) == 0:
        return xp.zeros(a.shape, dtype)
    values = decode_packed(a.packed)
    blocks = values.reshape(*values.shape[:-1], -1, MX_BLOCK_SIZE)
    exponent = a.scales.astype(xp.int32) - E8M0_BIAS
    out = xp.ldexp(blocks, exponent[..., None])
    out = xp.where((a.scales == E8M0_NAN)[..., None], xp.float32(np.nan), out)
    return out.reshape(a.shape).astype(dtype)


def _block_exponent(xp: Any, amax: Any, scale_rule: str) -> Any:
    """int32 block exponents, clamped to [-127, 125]; -127 for all-zero (or non-finite) blocks."""
    # Largest exponent: 125, so that every decoded value 6 * 2^e stays finite in float32 (the OCP
    # rule never exceeds it; the "ceil" rule would reach 126 for amax > 6 * 2^125 and then clip).
    return mx_block_exponent(
        xp, amax, scale_rule, elem_max=E2M1_MAX, elem_emax=2, max_exponent=MAX_EXPONENT
    )


def mx_block_amax(xp: Any, blocks: Any) -> Any:
    """float32 max|x| of each block (the last axis of `blocks`), NaN where the block holds NaN.

    `max` alone is not enough under XLA: XLA:CPU (jax 0.10) reduces rows of 32 or more with a
    vector max that drops NaN (seen under `jax.vmap`), and a NaN block must get the NaN scale
    byte. NumPy input never gets here with NaN (`check_finite` raised).
    """
    amax = xp.max(xp.abs(blocks), axis=-1)
    if is_jax_array(blocks):
        amax = xp.where(xp.any(xp.isnan(blocks), axis=-1), xp.float32(np.nan), amax)
    return amax


def mx_block_exponent(
    xp: Any, amax: Any, scale_rule: str, *, elem_max: float, elem_emax: int, max_exponent: int
) -> Any:
    """int32 E8M0 exponents of blocks with amax `amax` for elements whose largest value is
    `elem_max` = m * 2^elem_emax (E2M1: 6 = 1.5 * 2^2; E4M3: 448 = 1.75 * 2^8).

    "ocp": floor(log2(amax)) - elem_emax. "ceil": the smallest e with elem_max * 2^e >= amax,
    exact. Clamped to [-127, max_exponent]; -127 for all-zero (or non-finite) blocks.
    """
    usable = (amax > 0) & xp.isfinite(amax)
    safe = xp.where(usable, amax, xp.float32(1.0))
    _, e = xp.frexp(safe)  # safe = m * 2^e with m in [0.5, 1): floor(log2(safe)) = e - 1
    floor_log2 = e.astype(xp.int32) - 1
    if scale_rule == "ocp":
        exponent = floor_log2 - elem_emax
    else:
        # elem_max * 2^k < 2^(elem_emax + 1 + k) <= amax for k = floor_log2 - elem_emax - 1, and
        # elem_max * 2^k >= 2^(elem_emax + k) > amax for k = floor_log2 - elem_emax + 1: the answer
        # is one or two steps up from the first. amax * 2^-k (~2^(elem_emax + 1), exact) is
        # compared instead of elem_max * 2^k, which would overflow float32 near FLT_MAX.
        k = floor_log2 - elem_emax - 1
        for _ in range(3):
            k = xp.where(xp.ldexp(safe, -k) > xp.float32(elem_max), k + 1, k)
        exponent = k
    exponent = xp.clip(exponent, -E8M0_BIAS, max_exponent)
    return xp.where(usable, exponent, -E8M0_BIAS).astype(xp.int32)
