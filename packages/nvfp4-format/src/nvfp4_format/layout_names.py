"""Tensor names of the FP4 checkpoint layouts inference servers load (``docs/spec/export-formats.md``).

The one place that spells them: `inspection` detects modules with these names and the export
package writes and re-reads them. Module ``<m>`` of each layout stores:

| layout | packed codes | block scales | weight global scale | input scale |
|---|---|---|---|---|
| ``modelopt-nvfp4`` | ``<m>.weight`` | ``<m>.weight_scale`` | ``<m>.weight_scale_2`` F32 [] DECODE | ``<m>.input_scale`` F32 [] DECODE |
| ``compressed-tensors-nvfp4`` | ``<m>.weight_packed`` | ``<m>.weight_scale`` | ``<m>.weight_global_scale`` F32 [1] ENCODE | ``<m>.input_global_scale`` F32 [1] ENCODE |
| ``compressed-tensors-mxfp4`` | ``<m>.weight_packed`` | ``<m>.weight_scale`` (E8M0) | none | none |

Example:
    >>> CT_NVFP4.tensor("model.layers.0.mlp.down_proj", CT_NVFP4.global_scale)
    'model.layers.0.mlp.down_proj.weight_global_scale'
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CT_MXFP4",
    "CT_NVFP4",
    "INPUT_GLOBAL_SCALE",
    "INPUT_SCALE",
    "LAYOUT_CT_MXFP4",
    "LAYOUT_CT_NVFP4",
    "LAYOUT_MODELOPT_NVFP4",
    "LAYOUT_NAMES",
    "MODELOPT_NVFP4",
    "WEIGHT",
    "WEIGHT_GLOBAL_SCALE",
    "WEIGHT_PACKED",
    "WEIGHT_SCALE",
    "WEIGHT_SCALE_2",
    "LayoutNames",
]

WEIGHT = "weight"
"""A dense weight; in ModelOpt also the packed codes."""
WEIGHT_PACKED = "weight_packed"
"""compressed-tensors: the packed E2M1 codes, uint8 [out, in/2]."""
WEIGHT_SCALE = "weight_scale"
"""The block scales (E4M3 for NVFP4, E8M0 bytes for MXFP4), both layouts."""
WEIGHT_SCALE_2 = "weight_scale_2"
"""ModelOpt: the weight's global DECODE scale, float32 []."""
WEIGHT_GLOBAL_SCALE = "weight_global_scale"
"""compressed-tensors: the weight's global ENCODE scale, float32 [1]."""
INPUT_SCALE = "input_scale"
"""ModelOpt: the activation DECODE scale, float32 [] (W4A4)."""
INPUT_GLOBAL_SCALE = "input_global_scale"
"""compressed-tensors: the activation ENCODE scale, float32 [1] (W4A4)."""

LAYOUT_MODELOPT_NVFP4 = "modelopt-nvfp4"
LAYOUT_CT_NVFP4 = "compressed-tensors-nvfp4"
LAYOUT_CT_MXFP4 = "compressed-tensors-mxfp4"


@dataclass(frozen=True)
class LayoutNames:
    """The tensor-name suffixes of one layout and what its scalar scales hold.

    Attributes:
        layout: one of the ``LAYOUT_*`` names.
        packed: suffix of the packed E2M1 codes.
        block_scales: suffix of the block scales.
        global_scale: suffix of the weight global scale, None when the layout has none.
        input_scale: suffix of the activation scale (W4A4), None when the layout has none.
        scales_encode: the global and input scales are ENCODE scales (6 * 448 / amax); else
            DECODE scales (amax / (6 * 448)).
        scalar_shape: shape of the global and input scale tensors.
    """

    layout: str
    packed: str
    block_scales: str
    global_scale: str | None
    input_scale: str | None
    scales_encode: bool
    scalar_shape: tuple[int, ...]

    @staticmethod
    def tensor(module: str, suffix: str) -> str:
        """The tensor name ``<module>.<suffix>``."""
        return f"{module}.{suffix}"


MODELOPT_NVFP4 = LayoutNames(
    LAYOUT_MODELOPT_NVFP4, WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2, INPUT_SCALE, False, ()
)
CT_NVFP4 = LayoutNames(
    LAYOUT_CT_NVFP4,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_GLOBAL_SCALE,
    INPUT_GLOBAL_SCALE,
    True,
    (1,),
)
CT_MXFP4 = LayoutNames(LAYOUT_CT_MXFP4, WEIGHT_PACKED, WEIGHT_SCALE, None, None, True, (1,))

LAYOUT_NAMES = {names.layout: names for names in (MODELOPT_NVFP4, CT_NVFP4, CT_MXFP4)}
"""``LAYOUT_*`` name -> its `LayoutNames`."""
