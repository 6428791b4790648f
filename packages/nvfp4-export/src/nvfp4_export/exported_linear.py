"""`ExportedLinear`: one Hugging Face linear module as an export writes it (codes, scales, amax).

The data every format entry (`formats.FORMATS`), the layouts and the reload share; how a trained
linear becomes these modules is `linears`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import nvfp4_format


@dataclasses.dataclass(frozen=True)
class ExportedLinear:
    """One Hugging Face linear module as the export writes it.

    Attributes:
        name: HF module name, e.g. `model.layers.0.self_attn.q_proj`.
        source: the training linear it comes from, e.g. `layers.0.attn.qkv`.
        fmt: a `formats.FORMATS` name ("nvfp4", "mxfp4") or "bf16".
        weight: bfloat16 [out, in] (fmt "bf16" only).
        packed: uint8 [out, in/2] E2M1 codes, even `in` index in the low nibble (FP4 formats);
            float8_e4m3fn [out, in] elements (the 8-bit formats MXFP8 and FP8).
        scales: NVFP4: float8_e4m3fn [out, in/16] block decode scales; MXFP4 / MXFP8: uint8
            [out, in/32] E8M0 exponents (127 = 2^0); FP8 per tensor: None.
        weight_amax: NVFP4 only: float32 max |W| over the whole fused group (sets the global scale).
        input_amax: max |x| at the linear's input (W4A4 activation scale), or None.
        stored_decode_scale: NVFP4 read back from a ModelOpt file: the stored `weight_scale_2`
            (used as is instead of recomputing it from `weight_amax`); FP8 per tensor: always
            its decode scale amax / 448.
        block_scale_rule: NVFP4: "max", or "4over6" when the recipe trained with Four Over Six
            (its global scale is amax / (6 * 256); codes and scales are standard NVFP4).
        standin_error: a stand-in for the trained format (FP8 per tensor for MXFP8 in ModelOpt):
            max |stored - trained| / max |trained| of its training linear; None otherwise.
    """

    name: str
    source: str
    fmt: str
    weight: np.ndarray | None = None
    packed: np.ndarray | None = None
    scales: np.ndarray | None = None
    weight_amax: np.float32 | None = None
    input_amax: float | None = None
    stored_decode_scale: np.float32 | None = None
    block_scale_rule: str = "max"
    standin_error: float | None = None

    @property
    def global_decode_scale(self) -> np.float32:
        """NVFP4: the shared DECODE scale, float32 1 / s_enc (~ amax / (6 * 448))."""
        if self.stored_decode_scale is not None:
            return np.float32(self.stored_decode_scale)
        amax, rule = np.float32(self.weight_amax), self.block_scale_rule
        return np.float32(nvfp4_format.global_decode_scale(amax, block_scale_rule=rule))

    @property
    def global_encode_scale(self) -> np.float32:
        """NVFP4: the shared ENCODE scale s_enc = min(6 * 448 / amax, FLT_MAX), float32
        (6 * 256 with Four Over Six)."""
        amax, rule = np.float32(self.weight_amax), self.block_scale_rule
        return np.float32(nvfp4_format.global_encode_scale(amax, block_scale_rule=rule))

    @property
    def shape(self) -> tuple[int, int]:
        """Logical [out, in]."""
        if self.weight is not None:
            return tuple(self.weight.shape)
        per_byte = 2 if self.packed.dtype == np.uint8 else 1  # packed FP4, or 8-bit elements
        return (self.packed.shape[0], self.packed.shape[1] * per_byte)
