"""MXFP8 (OCP Microscaling v1.0): E4M3 elements in 32-element blocks with an E8M0 power-of-two scale.

No tensor scale; 8.25 bits per element. Elements are `float8_e4m3fn` (largest 448 = 1.75 * 2^8, no
Inf, S.1111.111 is NaN). Two rules choose a block's exponent e (scale 2^e), as for MXFP4:

- "ocp": e = floor(log2(amax_block)) - 8, the OCP spec's rule (8 = emax of E4M3). The block max
  lands in [256, 512) and values above 448 saturate to 448.
- "ceil": e = ceil(log2(amax_block / 448)), the smallest e with 448 * 2^e >= amax_block, computed
  exactly, so nothing saturates (NVIDIA's rounded-up rule, as in TransformerEngine's MXFP8 recipe).

Elements: x * 2^-e (exact in float32), clipped to [-448, 448] and rounded to E4M3, round to nearest,
ties to even: values beyond 448 SATURATE to +-448 (the clip; a bare cast would give NaN), values
below 2^-6 land on E4M3's subnormals k * 2^-9 and below 2^-10 on (signed) zero.

e is clamped to [-127, 119]: the E8M0 range, capped at 119 so that every decoded value stays
finite in float32 (448 * 2^119 ~ 3.0e38; only the "ceil" rule can ask for more, for blocks with
amax > 448 * 2^119, which then saturate). An all-zero block gets e = -127 (byte 0). Scales are
stored as E8M0 bytes e + 127; byte 255 is NaN and marks a block with non-finite input on the JAX
path (NumPy input with NaN or Inf raises ValueError), exactly as `quantize_mxfp4` does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from nvfp4_format._block_scaling import E4M3_MAX
from nvfp4_format._namespace import (
    check_fields,
    check_finite,
    check_float,
    check_logical_shape,
    namespace,
)
from nvfp4_format._pytree import register_dataclass
from nvfp4_format.mxfp4 import (
    E8M0_BIAS,
    E8M0_NAN,
    MX_BLOCK_SIZE,
    SCALE_RULES,
    mx_block_amax,
    mx_block_exponent,
)

E4M3_EMAX = 8
MXFP8_MAX_EXPONENT = 119


@dataclasses.dataclass(frozen=True, eq=False)
class MXFP8Array:
    """An MXFP8-quantized tensor. Blocks of 32 run along the last axis.

    Attributes:
      data: float8_e4m3fn [..., K], the E4M3 elements (one byte each).
      scales: uint8 [..., K/32], E8M0 biased exponents: the block scale is 2^(byte - 127).
      shape: the logical shape [..., K].
      scale_rule: "ocp" or "ceil", the rule that chose the exponents.
    """

    data: Any
    scales: Any
    shape: tuple[int, ...]
    scale_rule: str = "ocp"

    def __post_init__(self) -> None:
        shape = check_logical_shape("MXFP8Array", self.shape, MX_BLOCK_SIZE)
        object.__setattr__(self, "shape", shape)
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(
                f"MXFP8Array.scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}"
            )
        lead, k = shape[:-1], shape[-1]
        check_fields("MXFP8Array", shape, {
            "data": (self.data, ml_dtypes.float8_e4m3fn, (*lead, k)),
            "scales": (self.scales, np.uint8, (*lead, k // MX_BLOCK_SIZE)),
        })  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Storage bytes: one per element plus one scale byte per block of 32."""
        return int(np.prod(self.data.shape)) + int(np.prod(self.scales.shape))


register_dataclass(MXFP8Array, ["data", "scales"], ["shape", "scale_rule"])


def quantize_mxfp8(x: Any, scale_rule: str = "ocp") -> MXFP8Array:
    """Quantize `x` [..., K] (K % 32 == 0) to MXFP8 with blocks of 32 along the last axis.

    Args:
      x: floating array (float16, bfloat16, float32, float64), NumPy or JAX (works in `jax.jit`).
      scale_rule: "ocp" (e = floor(log2 amax) - 8; the block max may saturate at 448) or "ceil"
        (the smallest e with 448 * 2^e >= amax; never saturates).

    Returns:
      An `MXFP8Array`.

    Raises:
      TypeError: `x` is not floating.
      ValueError: K not a multiple of 32, an unknown `scale_rule`, or NaN/Inf in NumPy input (JAX
        input marks such blocks with the NaN scale byte 255 instead).

    Example:
      >>> q = quantize_mxfp8(np.full(32, 3.0, np.float32))
      >>> int(q.scales[0]) - 127, dequantize_mxfp8(q)[:2]
      (-7, array([3., 3.], dtype=float32))
    """
    check_float("x", x)
    xp = namespace(x)
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if x.ndim < 1 or x.shape[-1] % MX_BLOCK_SIZE:
        raise ValueError(
            f"x's last dimension K must be a multiple of 32 for MXFP8 blocks, got shape {tuple(x.shape)}"
        )
    check_finite("x", x)
    if x.size == 0:
        *lead, k = x.shape
        data = xp.zeros((*lead, k), ml_dtypes.float8_e4m3fn)
        return MXFP8Array(
            data, xp.zeros((*lead, k // MX_BLOCK_SIZE), xp.uint8), tuple(x.shape), scale_rule
        )
    x32 = xp.asarray(x, dtype=xp.float32)
    blocks = x32.reshape(*x32.shape[:-1], -1, MX_BLOCK_SIZE)
    amax = mx_block_amax(xp, blocks)
    exponent = mx_block_exponent(
        xp,
        amax,
        scale_rule,
        elem_max=E4M3_MAX,
        elem_emax=E4M3_EMAX,
        max_exponent=MXFP8_MAX_EXPONENT,
    )
    scaled = xp.clip(xp.ldexp(blocks, -exponent[..., None]), -E4M3_MAX, E4M3_MAX)
    data = scaled.astype(ml_dtypes.float8_e4m3fn).reshape(x32.shape)
    scales = xp.where(xp.isfinite(amax), exponent + E8M0_BIAS, E8M0_NAN).astype(xp.uint8)
    return MXFP8Array(data, scales, tuple(x.shape), scale_rule)


def dequantize_mxfp8(a: MXFP8Array, dtype: Any = np.float32) -> Any:
    """Decode an `MXFP8Array`: float32(e4m3 element) * 2^(scale byte - 127), then cast.

    Byte 255 (E8M0 NaN) decodes its whole block to NaN; so does an E4M3 NaN element.

    Example:
      >>> x = np.linspace(-1, 1, 64, dtype=np.float32)
      >>> float(np.abs(dequantize_mxfp8(quantize_mxfp8(x)) - x).max()) <= 2.0**-5
      True
    """
    if not isinstance(a, MXFP8Array):
        raise TypeError(f"a must be an MXFP8Array, got {type(a).__name__}")
    xp = namespace(a.data, a.scales)
    if math.prod(a.shape) == 0:
        return xp.zeros(a.shape, dtype)
    values = xp.asarray(a.data).astype(xp.float32)
    blocks = values.reshape(*values.shape[:-1], -1, MX_BLOCK_SIZE)
    is_nan = a.scales == E8M0_NAN
    exponent = xp.where(is_nan, 0, a.scales.astype(xp.int32) - E8M0_BIAS)  # 2^128 would be Inf
    out = xp.ldexp(blocks, exponent[..., None])
    out = xp.where(is_nan[..., None], xp.float32(np.nan), out)
    return out.reshape(a.shape).astype(dtype)
