"""Everything nvfp4-ops does that depends on the element format, as one table: `FORMAT_OPS`.

One `FormatOps` per `TensorQuant.fmt` says which block shapes and roundings the format takes and
how nvfp4-ops quantizes an operand to it, decodes it, hands it to the block-scaled GEMM and counts
its statistics. `recipe`, `quantizers`, `gemm` and `telemetry` look the format up here (a dict
lookup on a static Python string, at trace time): a new format is one entry in this table.

The NVFP4 and MXFP4 numerics live in `nvfp4_format`; FP8 in `nvfp4_ops.fp8`. A quantized operand
is the format's own pytree (`NVFP4Array`, `MXFP4Array`, `FP8Tensor`), for "bf16" the array itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp

import nvfp4_format
from nvfp4_ops.fp8 import FP8_MAX, abs_max, dequantize_fp8, fp8_amax, quantize_fp8

E4M3_MAX = FP8_MAX["fp8_e4m3"]

MXFP4_SCALE_RULE = "ocp"
"""MXFP4 scale rule used by the recipes: the OCP rule X = 2^(floor(log2(amax_block)) - 2)."""

MXFP8_SCALE_RULE = "ceil"
"""MXFP8 scale rule used by the recipes: the smallest 2^e with 448 * 2^e >= amax_block, as
TransformerEngine's MXFP8 kernels round amax / 448 up to a power of two (nothing saturates)."""

E2M1_MAX = 6.0
SATURATION_SLACK = 2.0**-20
"""Relative excess over the format max below which a value counts as float32 rounding, not clip."""

_FLT_MAX = float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class FormatOps:
    """How nvfp4-ops handles one element format (static: looked up at trace time).

    Attributes:
      block_shapes: the `TensorQuant.block_shape` values the format takes (None: per-tensor
        scaling, or no quantization).
      stochastic: whether rounding="stochastic" is implemented.
      block_scale_rules: the `TensorQuant.block_scale_rule` values it takes.
      outer_scales: the `TensorQuant.outer_scale` values it takes.
      quantized: False for a format that passes the operand through unchanged ("bf16").
      quantize: (x, tq, uniform, amax=None) -> the quantized operand, blocks along the last
        axis; `uniform` is None for round to nearest, else float32 uniforms in (0, 1) of x's
        shape; `amax` None, or the amax that sets the outer scale(s) in place of x's own
        (`outer_amax`'s shape): a tensor quantized in parts passes the whole tensor's.
      outer_amax: (x, tq) -> the amax that sets the outer (FP32 tensor or row) scale of x as
        `quantize` takes it (a scalar, or [..., 1] per row), or None for a format without one
        (MX formats, "bf16"); the maximum is exact, so it can be combined over parts.
      dequantize: (q, dtype) -> the decoded operand as `dtype`.
      gemm_operand: (q, transposed) -> (element values [B, P, C], block scales [B, P, C/block]
        or None, global decode scale): the operand as `gemm.xla_gemm` contracts it;
        `transposed`: q is stored [B, C, P] (a weight reused in Dgrad).
      counts: (x32, q, xq, tq) -> int32 scalars (underflowed, saturated, underflow denominator,
        saturation denominator) for `telemetry.operand_stats`; None when not quantized.
    """

    block_shapes: tuple[tuple[int, int] | None, ...]
    stochastic: bool
    quantized: bool
    quantize: Callable[..., Any]
    dequantize: Callable[[Any, Any], jax.Array]
    gemm_operand: Callable[[Any, bool], tuple[jax.Array, jax.Array | None, jax.Array]]
    counts: Callable[..., tuple[jax.Array, ...]] | None
    outer_amax: Callable[[jax.Array, Any], jax.Array | None] = lambda x, tq: None
    block_scale_rules: tuple[str, ...] = ("max",)
    outer_scales: tuple[str, ...] = ("tensor",)


def materialised(x: jax.Array) -> jax.Array:
    """`x` itself (bit for bit), written to memory once and read back by every consumer.

    XLA:CPU drops `optimization_barrier`s before fusion and duplicates cheap elementwise
    producers into each consumer. A reduction is never fused into its consumer, so the max of
    x's bits (as unsigned integers) and 0 over a size-2 axis - x exactly, NaN payloads and -0
    included - makes XLA compute x once where the consumer reads each element several times
    (XLA does fuse it into a one-to-one consumer such as a transpose). Used for block scales: a
    decode fused after the quantization re-ran clamp + float32 -> E4M3 for each of a block's 16
    elements.
    """
    uint = jnp.dtype(f"uint{jnp.dtype(x.dtype).itemsize * 8}")
    u = jax.lax.bitcast_convert_type(x, uint)
    u = jnp.max(jnp.stack([u, jnp.zeros_like(u)], axis=-1), axis=-1)
    return jax.lax.bitcast_convert_type(u, x.dtype)


def _blocked(x: jax.Array, block: int) -> jax.Array:
    """[..., K] -> [..., K/block, block]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _saturated(scaled: jax.Array, fmax: float) -> jax.Array:
    return jnp.abs(scaled) > jnp.float32(fmax * (1.0 + SATURATION_SLACK))


def _fp4_values(packed: jax.Array) -> jax.Array:
    """Packed E2M1 bytes [..., C/2] -> float4_e2m1fn [..., C] (a bitcast, low nibble first)."""
    f4 = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
    return f4.reshape(*packed.shape[:-1], -1)


def _transpose_tiles(scales: jax.Array, tile: int) -> jax.Array:
    """Tile scales [B, Q, C/t] repeated over rows -> [B, C, Q/t] for the transposed operand."""
    per_tile = scales[:, ::tile, :]  # [B, Q/t, C/t]
    return jnp.repeat(jnp.swapaxes(per_tile, -1, -2), tile, axis=1)


def _element_count(x32: jax.Array) -> jax.Array:
    return jnp.sum(x32 != 0, dtype=jnp.int32)


# --- NVFP4 ----------------------------------------------------------------------------------


def _quantize_nvfp4(x: jax.Array, tq, uniform: jax.Array | None, amax=None) -> Any:
    return nvfp4_format.quantize(
        x,
        tq.block_shape,
        global_amax=amax,
        rounding=tq.rounding,
        uniform=uniform,
        block_scale_rule=tq.block_scale_rule,
        outer_scale=tq.outer_scale,
    )


def _nvfp4_outer_amax(x: jax.Array, tq) -> jax.Array:
    """max|x| (float32, NaN kept: `fp8.abs_max`): of the tensor, or per row [..., 1] with
    outer_scale="row"."""
    if tq.outer_scale == "row":
        return abs_max(x, axis=-1, keepdims=True)
    return abs_max(x)


def _dequantize_nvfp4(q: Any, dtype) -> jax.Array:
    """`nvfp4_format.dequantize` reading block scales materialised in memory.

    The per-element E4M3 -> float32 widening left in the decode is cheap, and it also keeps
    XLA:CPU from pulling the decode into the GEMM (which made the GEMM ~3x slower). Measured at
    1024^2 inside a full-recipe step: 0.8-1.7 ms per decode instead of 4-7 ms (docs/ops.md).
    """
    q = dataclasses.replace(q, block_scales=materialised(q.block_scales))
    return nvfp4_format.dequantize(q, dtype)


def _nvfp4_gemm_operand(q: Any, transposed: bool):
    """(E2M1 values [B, P, C], E4M3 block scales [B, P, C/16], global decode scale: a scalar,
    or [B, P, 1] with one per row (outer_scale="row"); `gemm.xla_gemm` orients it)."""
    vals, scales, g = _fp4_values(q.packed), q.block_scales, q.global_scale
    if transposed:
        if q.outer_scale == "row":
            raise ValueError(
                "a row-scaled NVFP4 operand (outer_scale='row', global_scale shape "
                f"{tuple(g.shape)}) cannot be reused transposed: its rows would become columns"
            )
        vals, scales = jnp.swapaxes(vals, -1, -2), _transpose_tiles(scales, 16)
    return vals, scales, g


def _nvfp4_counts(x32: jax.Array, q, xq: jax.Array, tq) -> tuple[jax.Array, ...]:
    """(underflowed blocks, saturated elements, nonzero blocks, nonzero elements) of an
    `NVFP4Array` `q` of `x32`.

    The encode scale is the quantizer's (nvfp4_format's `_encode_blocks`), rebuilt from the stored
    fields: enc = min(1 / (fp32(sb) * s_dec), FLT_MAX), 0 where sb == 0. s_dec is the tensor's
    scalar or, with outer_scale="row", one per row [..., 1], which broadcasts over its blocks.
    """
    sb = q.block_scales.astype(jnp.float32)  # [..., K/16]; 16x16 tiles: repeated over 16 rows
    decoded = sb * q.global_scale  # s_dec: () or [..., 1] (per row, 1x16 blocks only)
    enc = jnp.minimum(1.0 / jnp.where(sb == 0, jnp.inf, decoded), _FLT_MAX)
    scaled = _blocked(x32, 16) * enc[..., None]
    saturated = jnp.sum(_saturated(scaled, E2M1_MAX), dtype=jnp.int32)
    nonzero = jnp.any(_blocked(x32, 16) != 0, axis=-1)  # [..., K/16] per row
    if tq.is_2d:  # one flag per tile: rows of a tile share the scale
        tiles = nonzero.reshape(*nonzero.shape[:-2], -1, 16, nonzero.shape[-1])
        nonzero = jnp.any(tiles, axis=-2)
        decoded = decoded[..., ::16, :]
    underflow = jnp.sum(nonzero & (decoded == 0), dtype=jnp.int32)
    return underflow, saturated, jnp.sum(nonzero, dtype=jnp.int32), _element_count(x32)


# --- MXFP4 ----------------------------------------------------------------------------------


def _quantize_mxfp4(x: jax.Array, tq, uniform: jax.Array | None, amax=None) -> Any:
    return nvfp4_format.quantize_mxfp4(x, MXFP4_SCALE_RULE, rounding=tq.rounding, uniform=uniform)


def _mx_dequantize(decode: Callable[[Any, Any], jax.Array]) -> Callable[[Any, Any], jax.Array]:
    """An MX format's decode (`nvfp4_format.dequantize_mxfp4` / `_mxfp8`) behind an
    optimization barrier (as for NVFP4)."""
    return lambda q, dtype: decode(jax.lax.optimization_barrier(q), dtype)


def _mx_gemm_operand(name: str, values: Callable[[Any], jax.Array]) -> Callable[..., Any]:
    """An MX format's GEMM operand: `values(q)` [B, P, C], its E8M0 scales, global scale 1."""

    def operand(q: Any, transposed: bool):
        if transposed:
            raise ValueError(f"{name} operands are 1D-blocked and cannot be reused transposed")
        scales = jax.lax.bitcast_convert_type(q.scales, jnp.float8_e8m0fnu)
        return values(q), scales, jnp.float32(1.0)

    return operand


def _mx_counts(elem_max: float) -> Callable[..., tuple[jax.Array, ...]]:
    """The telemetry counts of an MX format whose elements saturate at `elem_max`: (underflowed
    blocks, saturated elements, nonzero blocks, nonzero elements) of an `MXFP4Array` or
    `MXFP8Array` `q` of `x32`.

    Scale 2^e with e = byte - 127; the quantizer's pre-clip value is ldexp(x, -e).
    """

    def counts(x32: jax.Array, q, xq: jax.Array, tq) -> tuple[jax.Array, ...]:
        exponent = q.scales.astype(jnp.int32) - 127
        blocks = _blocked(x32, 32)
        scaled = jnp.ldexp(blocks, -exponent[..., None])
        saturated = jnp.sum(_saturated(scaled, elem_max), dtype=jnp.int32)
        nonzero = jnp.any(blocks != 0, axis=-1)
        decoded = jnp.ldexp(jnp.float32(1.0), exponent)
        underflow = jnp.sum(nonzero & (decoded == 0), dtype=jnp.int32)
        return underflow, saturated, jnp.sum(nonzero, dtype=jnp.int32), _element_count(x32)

    return counts


# --- MXFP8 ----------------------------------------------------------------------------------


def _quantize_mxfp8(x: jax.Array, tq, uniform: jax.Array | None, amax=None) -> Any:
    return nvfp4_format.quantize_mxfp8(x, MXFP8_SCALE_RULE)


# --- FP8 (per-tensor current scaling) -------------------------------------------------------


def _quantize_fp8(x: jax.Array, tq, uniform: jax.Array | None, amax=None) -> Any:
    return quantize_fp8(x, tq.fmt, amax)


def _fp8_gemm_operand(q: Any, transposed: bool):
    vals = jnp.swapaxes(q.data, -1, -2) if transposed else q.data
    return vals, None, q.decode_scale


def _fp8_counts(x32: jax.Array, q, xq: jax.Array, tq) -> tuple[jax.Array, ...]:
    """(nonzero elements decoding to 0, saturated elements, nonzero elements twice) for FP8."""
    nonzero = x32 != 0
    underflow = jnp.sum(nonzero & (xq == 0), dtype=jnp.int32)
    scaled = x32 / q.decode_scale
    saturated = jnp.sum(_saturated(scaled, FP8_MAX[tq.fmt]), dtype=jnp.int32)
    elements = jnp.sum(nonzero, dtype=jnp.int32)
    return underflow, saturated, elements, elements


# --- BF16 (no quantization) -----------------------------------------------------------------


def _unquantized_gemm_operand(q: jax.Array, transposed: bool):
    vals = jnp.swapaxes(q, -1, -2) if transposed else q
    return vals, None, jnp.float32(1.0)


def _mx_format(
    name: str,
    quantize: Callable[..., Any],
    decode: Callable[[Any, Any], jax.Array],
    values: Callable[[Any], jax.Array],
    elem_max: float,
    *,
    stochastic: bool,
) -> FormatOps:
    """The table entry of an MX format: 1x32 blocks with E8M0 scales (`_mx_dequantize`,
    `_mx_gemm_operand`, `_mx_counts`), elements `values(q)` saturating at `elem_max`."""
    return FormatOps(
        block_shapes=((1, 32),), stochastic=stochastic, quantized=True, quantize=quantize,
        dequantize=_mx_dequantize(decode), gemm_operand=_mx_gemm_operand(name, values),
        counts=_mx_counts(elem_max),
    )  # fmt: skip


_FP8 = {
    "block_shapes": (None,),
    "stochastic": False,
    "quantized": True,
    "quantize": _quantize_fp8,
    "dequantize": dequantize_fp8,
    "gemm_operand": _fp8_gemm_operand,
    "counts": _fp8_counts,
    "outer_amax": lambda x, tq: fp8_amax(x),
}

FORMAT_OPS: MappingProxyType[str, FormatOps] = MappingProxyType(
    {
        "nvfp4": FormatOps(
            block_shapes=((1, 16), (16, 16)),
            stochastic=True,
            quantized=True,
            quantize=_quantize_nvfp4,
            dequantize=_dequantize_nvfp4,
            gemm_operand=_nvfp4_gemm_operand,
            counts=_nvfp4_counts,
            outer_amax=_nvfp4_outer_amax,
            block_scale_rules=("max", "4over6"),
            outer_scales=("tensor", "row"),
        ),
        "mxfp4": _mx_format(
            "MXFP4",
            _quantize_mxfp4,
            nvfp4_format.dequantize_mxfp4,
            lambda q: _fp4_values(q.packed),
            E2M1_MAX,
            stochastic=True,
        ),  # fmt: skip
        "mxfp8": _mx_format(
            "MXFP8",
            _quantize_mxfp8,
            nvfp4_format.dequantize_mxfp8,
            lambda q: q.data,
            E4M3_MAX,
            stochastic=False,
        ),  # fmt: skip
        "fp8_e4m3": FormatOps(**_FP8),
        "fp8_e5m2": FormatOps(**_FP8),
        "bf16": FormatOps(
            block_shapes=(None,),
            stochastic=False,
            quantized=False,
            quantize=lambda x, tq, uniform, amax=None: x,
            dequantize=lambda q, dtype: q.astype(dtype),
            gemm_operand=_unquantized_gemm_operand,
            counts=None,
        ),
    }
)
"""{fmt: FormatOps}, in the order of `recipe.FORMATS` (which is this table's keys)."""
