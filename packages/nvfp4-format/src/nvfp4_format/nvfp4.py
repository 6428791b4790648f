"""NVFP4: E2M1 elements in 16-element blocks, an E4M3 scale per block, an FP32 scale per tensor.

The arithmetic follows the spec (and TransformerEngine's kernels) in float32, in this order:

    amax  = max|x|                                  (or the caller's shared `global_amax`)
    s_enc = min(6 * 448 / amax, FLT_MAX)            1.0 when amax == 0
    s_dec = 1 / s_enc                               stored as `global_scale`
    sb    = e4m3(clip(amax_block * (s_enc * (1/6)), 0, 448))      per-block decode scale
    enc_b = min(1 / (float32(sb) * s_dec), FLT_MAX)
    q     = e2m1(clip(x * enc_b, -6, 6))            RNE or stochastic
    x'    = e2m1_value(q) * float32(sb) * s_dec

`quantize(..., block_scale_rule="4over6")` replaces 448 by 256 in s_enc and picks, per block, sb
from two candidates (block amax -> 6 or -> 4); see `nvfp4_format.four_over_six`.

`quantize(..., outer_scale="row")` (1x16 blocks only) keeps one outer scale per ROW (per index of
the leading axes; "per token" for activations, as TransformerEngine's row-scaled NVFP4): amax,
s_enc and s_dec above are then taken per row, over the last axis, and `global_scale` is [..., 1].
Everything else is unchanged, so each row is exactly the quantization of that row on its own
(`nvfp4_format.outer_scale`).

One deliberate choice beyond the formulas: in a block whose scale `sb` is zero (an all-zero block, or
one whose amax is below ~2.2e-6 of the tensor amax and flushes) every code is 0. The formulas alone
would leave saturated codes there that decode to 0 anyway; zero codes say what the block holds.

Cost: two passes over x. The first computes the block amaxes (amax is their maximum, which is
exact); the second scales, encodes and packs (one fused loop under `jax.jit`; cache-sized
chunks on NumPy). See docs/benchmarks/format_quantize.md for throughput.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_dtypes
import numpy as np

from nvfp4_format._block_encoding import encode_blocks, per_block_amax
from nvfp4_format._block_scaling import BLOCK_SIZE, e4m3_block_scales
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
from nvfp4_format.e2m1 import E2M1_MAX
from nvfp4_format.four_over_six import check_block_scale_rule, select_block_scales
from nvfp4_format.outer_scale import check_outer_scale, global_encode_scale, outer_amax
from nvfp4_format.packing import decode_packed, unpack_fp4

BLOCK_SHAPES = ((1, 16), (16, 16))


@dataclasses.dataclass(frozen=True, eq=False)
class NVFP4Array:
    """An NVFP4-quantized tensor. Blocks run along the last axis.

    Attributes:
      packed: uint8 [..., K/2], two E2M1 codes per byte (even index in the low nibble).
      block_scales: float8_e4m3fn [..., K/16], per-block decode scales. For 16x16 tiles each tile's
        scale is repeated over its 16 rows, which is the 1x16 layout servers load.
      global_scale: float32 DECODE scale(s) 1 / s_enc (~ amax / (6 * 448)): a scalar, one per
        tensor, or [..., 1] (the leading axes of `shape`, then 1), one per row (1x16 blocks
        only; `quantize(outer_scale="row")`). NaN marks a tensor (row) quantized from
        non-finite input (JAX path).
      shape: the logical shape [..., K].
      block_shape: (1, 16) or (16, 16).
    """

    packed: Any
    block_scales: Any
    global_scale: Any
    shape: tuple[int, ...]
    block_shape: tuple[int, int] = (1, 16)

    def __post_init__(self) -> None:
        shape = check_logical_shape("NVFP4Array", self.shape, BLOCK_SIZE)
        object.__setattr__(self, "shape", shape)
        block_shape = tuple(self.block_shape)
        if block_shape not in BLOCK_SHAPES:
            raise ValueError(
                f"NVFP4Array.block_shape must be one of {BLOCK_SHAPES}, got {self.block_shape}"
            )
        object.__setattr__(self, "block_shape", block_shape)
        if block_shape == (16, 16) and (len(shape) < 2 or shape[-2] % BLOCK_SIZE):
            raise ValueError(f"NVFP4Array with 16x16 tiles needs rows % 16 == 0, got {shape}")
        lead, k = shape[:-1], shape[-1]
        row = self.outer_scale == "row"
        if row and block_shape != (1, 16):
            raise ValueError(
                f"NVFP4Array with per-row global scales needs 1x16 blocks, got block_shape="
                f"{block_shape} and global_scale shape {tuple(self.global_scale.shape)}"
            )
        check_fields("NVFP4Array", shape, {
            "packed": (self.packed, np.uint8, (*lead, k // 2)),
            "block_scales": (self.block_scales, ml_dtypes.float8_e4m3fn, (*lead, k // BLOCK_SIZE)),
            "global_scale": (self.global_scale, np.float32, (*lead, 1) if row else ()),
        })  # fmt: skip

    def codes(self) -> Any:
        """The unpacked uint8 E2M1 codes [..., K]."""
        return unpack_fp4(self.packed)

    @property
    def outer_scale(self) -> str:
        """Which outer scale it has: "tensor" (one) or "row" (one per row, [..., 1]).

        Told apart by rank: a row scale has the rank of `packed` ([..., K/2]), a tensor scale
        that rank minus len(shape) (0 unless `jax.vmap` added batch axes to both).
        """
        scale_ndim = getattr(self.global_scale, "ndim", 0)
        if scale_ndim == 0:
            return "tensor"
        packed_ndim = getattr(self.packed, "ndim", None)
        if packed_ndim is not None:
            return "row" if scale_ndim == packed_ndim else "tensor"
        row_shape = (*self.shape[:-1], 1)  # no packed array to compare with (pytree placeholders)
        return "row" if tuple(self.global_scale.shape)[-len(row_shape) :] == row_shape else "tensor"

    @property
    def nbytes(self) -> int:
        """Storage bytes: packed codes + block scales + 4 bytes per global (outer) scale."""
        scales = math.prod(self.global_scale.shape) if self.outer_scale == "row" else 1
        return int(np.prod(self.packed.shape)) + int(np.prod(self.block_scales.shape)) + 4 * scales


register_dataclass(NVFP4Array, ["packed", "block_scales", "global_scale"], ["shape", "block_shape"])


def quantize(
    x: Any,
    block_shape: tuple[int, int] = (1, 16),
    *,
    global_amax: Any = None,
    rounding: str = "rne",
    uniform: Any = None,
    block_scale_rule: str = "max",
    error_metric: str = "mse",
    outer_scale: str = "tensor",
) -> NVFP4Array:
    """Quantize `x` to NVFP4 with blocks along the last axis (formulas: the module docstring).

    Args:
      x: floating array [..., K] (K % 16 == 0); for (16, 16) at least 2-D with rows % 16 == 0.
        NumPy or JAX (works inside `jax.jit`).
      block_shape: (1, 16) blocks, or (16, 16) tiles over the last two axes (weights).
      global_amax: the amax that sets the tensor scale; defaults to max|x|. Pass the max over a
        group of tensors (fused q/k/v, gate/up) so they share one global scale. With
        outer_scale="row": one amax per row, shape [..., 1] or [...] (x.shape[:-1]).
      rounding: "rne" or "stochastic" (gradients); `uniform`: then [0, 1) randoms shaped as `x`.
      block_scale_rule: "max" (each block's amax maps to 6) or "4over6" (per block the better of
        amax -> 6 and amax -> 4, tensor scale amax / (6 * 256); `nvfp4_format.four_over_six`;
        standard NVFP4 either way; under stochastic rounding chosen on the RNE errors).
      error_metric: for "4over6", "better" per block: "mse" (sum of squared errors), "l1" (sum
        of absolute errors) or "max_abs" (largest absolute error). Ties keep amax -> 6.
      outer_scale: "tensor" (one FP32 decode scale, shape ()) or "row" (1x16 blocks only: one
        per index of x's leading axes from that row's amax, [..., 1]). Each row then quantizes
        exactly as alone with "tensor": same codes, block scales, zero handling (an all-zero
        row gets scale 1) and non-finite marking (only that row's scale is NaN).

    Raises:
      TypeError: `x` is not floating.
      ValueError: shapes that do not tile, NaN/Inf in NumPy input, bad `global_amax`, unknown
        rule / metric / outer scale, "row" with 16x16 tiles, or stochastic without `uniform`.
        Non-finite JAX input gives a NaN `global_scale` instead (jit cannot raise), so
        `dequantize` returns NaN, never a finite lie.

    Example:
      >>> q = quantize(np.linspace(-3, 3, 32, dtype=np.float32))
      >>> q.packed.shape, q.block_scales.dtype
      ((16,), dtype(float8_e4m3fn))
      >>> x = np.array([4.0, 3.0] + [0.0] * 14, np.float32)  # 3 is exact on the grid 0..4
      >>> dequantize(quantize(x, block_scale_rule="4over6"))[:2]
      array([4., 3.], dtype=float32)
      >>> rows = np.array([[1.0] * 16, [1e-3] * 16], np.float32)  # one scale per row
      >>> quantize(rows, outer_scale="row").global_scale.shape
      (2, 1)
    """
    xp, block_shape = _check_arguments(
        x, block_shape, global_amax, uniform, rounding, block_scale_rule, error_metric, outer_scale
    )
    if x.size == 0:
        return _empty(xp, tuple(x.shape), block_shape, outer_scale)
    block_amax = _checked_block_amax(xp, x, block_shape, rounding, uniform)
    s_dec, scales, global_scale = _decode_scales(
        xp, x, block_amax, global_amax, block_shape, block_scale_rule, error_metric, outer_scale
    )
    packed, scales = _encode(xp, x, scales, s_dec, block_shape, rounding, uniform)
    return NVFP4Array(packed, scales, global_scale, shape=tuple(x.shape), block_shape=block_shape)


def _check_arguments(
    x: Any,
    block_shape: Any,
    global_amax: Any,
    uniform: Any,
    rounding: str,
    block_scale_rule: str,
    error_metric: str,
    outer_scale: str,
) -> tuple[Any, tuple[int, int]]:
    """`quantize`'s checks that need no pass over `x`; returns (array namespace, block_shape)."""
    check_float("x", x)
    xp = namespace(x, global_amax, uniform)
    check_rounding(rounding)
    check_block_scale_rule(block_scale_rule, error_metric)
    block_shape = _check_block_shape(block_shape, tuple(x.shape))
    check_outer_scale(outer_scale, block_shape)
    return xp, block_shape


def _checked_block_amax(
    xp: Any, x: Any, block_shape: tuple[int, int], rounding: str, uniform: Any
) -> Any:
    """The first pass over `x`: its per-block amaxes, then the checks on values.

    NumPy input with NaN/Inf (seen in the block amaxes) raises; stochastic rounding needs
    `uniform` shaped as `x`.
    """
    block_amax = per_block_amax(xp, x, block_shape)
    if not is_jax_array(block_amax) and block_amax.size and not np.isfinite(block_amax.max()):
        check_finite("x", x)  # NaN and Inf reach the block amaxes; this names the first one
    if rounding == "stochastic":
        check_uniform("uniform", uniform, tuple(x.shape))
    return block_amax


def _decode_scales(
    xp: Any,
    x: Any,
    block_amax: Any,
    global_amax: Any,
    block_shape: tuple[int, int],
    block_scale_rule: str,
    error_metric: str,
    outer_scale: str,
) -> tuple[Any, Any, Any]:
    """The scales from the block amaxes: (s_dec, E4M3 block decode scales, stored global_scale).

    s_dec is the tensor's (per row: each row's) float32 decode scale 1 / s_enc; the block scales
    follow `block_scale_rule`, one per block (16x16 tile); `global_scale` is s_dec marked NaN
    where the input was not finite.
    """
    amax = outer_amax(xp, block_amax, global_amax, outer_scale)
    s_enc = global_encode_scale(amax, block_scale_rule=block_scale_rule)
    s_dec = (xp.float32(1.0) / s_enc).astype(xp.float32)
    if block_scale_rule == "4over6":
        scales = select_block_scales(xp, x, block_amax, s_enc, s_dec, block_shape, error_metric)
    else:
        scales = e4m3_block_scales(xp, block_amax, s_enc, E2M1_MAX)
    return s_dec, scales, _marked_decode_scale(xp, s_dec, amax, block_amax, outer_scale)


def _encode(
    xp: Any,
    x: Any,
    block_scales: Any,
    s_dec: Any,
    block_shape: tuple[int, int],
    rounding: str,
    uniform: Any,
) -> tuple[Any, Any]:
    """The second pass over `x`: (packed E2M1 codes, block scales as stored).

    16x16 tiles store their scale repeated over the tile's 16 rows (the 1x16 layout).
    """
    packed = encode_blocks(xp, x, block_scales, s_dec, block_shape, rounding, uniform)
    if block_shape == (16, 16):
        block_scales = xp.repeat(block_scales, BLOCK_SIZE, axis=-2)
    return packed, block_scales


def _marked_decode_scale(xp: Any, s_dec: Any, amax: Any, block_amax: Any, outer_scale: str) -> Any:
    """The stored float32 `global_scale`: `s_dec`, NaN where the tensor (row) saw non-finite input.

    Only JAX input gets here non-finite (NumPy raised before); the marking holds also under
    `global_amax`, whose finiteness alone would hide a NaN in `x`.
    """
    if outer_scale == "row":
        finite = xp.isfinite(amax) & xp.isfinite(xp.max(block_amax, axis=-1, keepdims=True))
    else:
        finite = xp.isfinite(amax) & (xp.isfinite(xp.max(block_amax)) if block_amax.size else True)
    return xp.where(finite, s_dec, xp.float32(np.nan)).astype(xp.float32)


def dequantize(a: NVFP4Array, dtype: Any = np.float32) -> Any:
    """Decode an `NVFP4Array`: (e2m1_value * float32(block scale)) * global scale, then cast.

    A per-row global scale [..., 1] multiplies every block of its row.
    """
    if not isinstance(a, NVFP4Array):
        raise TypeError(f"a must be an NVFP4Array, got {type(a).__name__}")
    xp = namespace(a.packed, a.block_scales, a.global_scale)
    if math.prod(a.shape) == 0:
        return xp.zeros(a.shape, dtype)
    values = decode_packed(a.packed)
    blocks = values.reshape(*values.shape[:-1], -1, BLOCK_SIZE)
    scales = xp.asarray(a.block_scales).astype(xp.float32)[..., None]
    global_scale = xp.asarray(a.global_scale, dtype=xp.float32)
    if a.outer_scale == "row":
        global_scale = global_scale[..., None]  # [..., 1, 1] against blocks [..., K/16, 16]
    out = (blocks * scales) * global_scale
    return out.reshape(a.shape).astype(dtype)


def _empty(
    xp: Any, shape: tuple[int, ...], block_shape: tuple[int, int], outer_scale: str = "tensor"
) -> NVFP4Array:
    """The quantization of a zero-size `x`: empty codes and scales, the zero tensor's scale 1
    (per row: [..., 1] ones, empty unless only K is 0)."""
    *lead, k = shape
    scale_shape = (*lead, 1) if outer_scale == "row" else ()
    return NVFP4Array(
        packed=xp.zeros((*lead, k // 2), xp.uint8),
        block_scales=xp.zeros((*lead, k // BLOCK_SIZE), ml_dtypes.float8_e4m3fn),
        global_scale=xp.ones(scale_shape, dtype=xp.float32),
        shape=shape,
        block_shape=block_shape,
    )


def has_nonfinite(a: NVFP4Array) -> Any:
    """True where the tensor was quantized from non-finite input (a global scale is NaN).

    With per-row scales: True if any row's scale is NaN (batch axes added by `jax.vmap` kept).
    """
    xp = namespace(a.global_scale)
    nan = xp.isnan(xp.asarray(a.global_scale))
    if a.outer_scale == "row":
        return xp.any(nan, axis=tuple(range(nan.ndim - len(a.shape), nan.ndim)))
    return nan


def _check_block_shape(block_shape: Any, shape: tuple[int, ...]) -> tuple[int, int]:
    block_shape = tuple(block_shape)
    if block_shape not in BLOCK_SHAPES:
        raise ValueError(f"block_shape must be (1, 16) or (16, 16), got {block_shape}")
    if len(shape) < 1 or shape[-1] % BLOCK_SIZE:
        raise ValueError(
            f"x's last dimension K must be a multiple of 16 for {block_shape[0]}x16 blocks, "
            f"got shape {shape}"
        )
    if block_shape == (16, 16) and (len(shape) < 2 or shape[-2] % BLOCK_SIZE):
        raise ValueError(
            f"16x16 tiles need x with at least 2 dimensions and rows (x.shape[-2]) a multiple "
            f"of 16, got shape {shape}"
        )
    return block_shape  # type: ignore[return-value]
