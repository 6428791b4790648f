"""Finds FP4-quantized linears among a safetensors checkpoint's tensors, from the header alone.

Three on-disk layouts are recognised (names and dtypes from ``docs/spec/export-formats.md``; the
names are spelled once, in `layout_names`):

| layout | tensors of module ``<m>`` |
|---|---|
| ``modelopt-nvfp4`` | ``<m>.weight`` U8 [out, in/2], ``<m>.weight_scale`` F8_E4M3 [out, in/16], ``<m>.weight_scale_2`` F32 [] decode scale, optional ``<m>.input_scale`` F32 [] |
| ``compressed-tensors-nvfp4`` | ``<m>.weight_packed`` U8 [out, in/2], ``<m>.weight_scale`` F8_E4M3 [out, in/16], ``<m>.weight_global_scale`` F32 [1] ENCODE scale, optional ``<m>.input_global_scale`` |
| ``compressed-tensors-mxfp4`` | ``<m>.weight_packed`` U8 [out, in/2], ``<m>.weight_scale`` U8 E8M0 [out, in/32], no global scale |

Packed weights tagged ``F4`` (logical shape [out, in]) are accepted in place of U8. Detection
(`detect_quantized_modules`) looks at names, dtypes and shapes only and returns frozen
dataclasses; `inspection` reads the data and measures each module.

Example:
    >>> from nvfp4_format.safetensors_header import read_safetensors_header
    >>> header = read_safetensors_header("model.safetensors")  # doctest: +SKIP
    >>> [m.module for m in detect_quantized_modules(header.tensors)]  # doctest: +SKIP
    ['model.layers.0.mlp.down_proj', ...]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nvfp4_format.layout_names import CT_MXFP4, CT_NVFP4, MODELOPT_NVFP4
from nvfp4_format.safetensors_header import TensorInfo

__all__ = ["QuantizedModule", "detect_quantized_modules"]

_PACKED_DTYPES = ("U8", "F4")
E8M0_DTYPES = ("U8", "F8_E8M0")
"""safetensors dtype tags of E8M0 block scales (MXFP4): raw exponent bytes, or tagged E8M0."""


@dataclass(frozen=True)
class QuantizedModule:
    """Which tensors make up one FP4-quantized linear (found from the header alone).

    Attributes:
        module: module name, e.g. ``model.layers.0.mlp.down_proj``.
        layout: one of the ``LAYOUT_*`` names.
        packed: name of the packed E2M1 codes tensor.
        block_scales: name of the block-scale tensor, None when missing.
        global_scale: name of the weight global scale tensor (ModelOpt: decode scale,
            compressed-tensors: encode scale); None when missing or not part of the layout.
        input_scale: name of the activation scale tensor, None when absent.
    """

    module: str
    layout: str
    packed: str
    block_scales: str | None
    global_scale: str | None
    input_scale: str | None

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """All tensors that belong to this module."""
        names = (self.packed, self.block_scales, self.global_scale, self.input_scale)
        return tuple(n for n in names if n is not None)


def _present(tensors: Mapping[str, TensorInfo], name: str) -> str | None:
    return name if name in tensors else None


def _modelopt_module(m: str, tensors: Mapping[str, TensorInfo]) -> QuantizedModule | None:
    names = MODELOPT_NVFP4
    scale, scale_2 = names.tensor(m, names.block_scales), names.tensor(m, names.global_scale)
    if scale not in tensors and scale_2 not in tensors:
        return None
    return QuantizedModule(
        m,
        names.layout,
        names.tensor(m, names.packed),
        _present(tensors, scale),
        _present(tensors, scale_2),
        _present(tensors, names.tensor(m, names.input_scale)),
    )


def _compressed_tensors_module(m: str, tensors: Mapping[str, TensorInfo]) -> QuantizedModule:
    names = CT_NVFP4
    scale = _present(tensors, names.tensor(m, names.block_scales))
    global_scale = _present(tensors, names.tensor(m, names.global_scale))
    input_scale = _present(tensors, names.tensor(m, names.input_scale))
    is_mx = global_scale is None and scale is not None and tensors[scale].dtype in E8M0_DTYPES
    layout = CT_MXFP4.layout if is_mx else names.layout
    return QuantizedModule(
        m, layout, names.tensor(m, names.packed), scale, global_scale, input_scale
    )


def detect_quantized_modules(
    tensors: Mapping[str, TensorInfo],
) -> tuple[QuantizedModule, ...]:
    """Finds the FP4-quantized linears among a checkpoint's tensors.

    A ``<m>.weight_packed`` tensor of dtype U8 (or F4) starts a compressed-tensors module
    (MXFP4 when it has no global scale and E8M0 block scales, NVFP4 otherwise); a
    ``<m>.weight`` of dtype U8 (or F4) with a ``weight_scale`` or ``weight_scale_2`` sibling
    starts a ModelOpt module. Anything else is not quantized (e.g. compressed-tensors INT4
    ``weight_packed`` is I32 and is left alone).

    Args:
        tensors: tensor name -> `TensorInfo` (one file's header, or all shards merged).

    Returns:
        The modules found, sorted by module name.
    """
    ct_packed, modelopt_packed = "." + CT_NVFP4.packed, "." + MODELOPT_NVFP4.packed
    found = []
    for name, info in tensors.items():
        if info.dtype not in _PACKED_DTYPES:
            continue
        if name.endswith(ct_packed):
            found.append(_compressed_tensors_module(name.removesuffix(ct_packed), tensors))
        elif name.endswith(modelopt_packed):
            module = _modelopt_module(name.removesuffix(modelopt_packed), tensors)
            if module is not None:
                found.append(module)
    return tuple(sorted(found, key=lambda m: m.module))
