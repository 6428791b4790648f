"""nvfp4_format: the NVFP4, MXFP4 and MXFP8 bit formats, for NumPy and (when installed) JAX arrays.

Example:
  >>> import numpy as np, nvfp4_format as nf
  >>> x = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
  >>> q = nf.quantize(x)
  >>> q.packed.shape, q.block_scales.shape
  ((4, 32), (4, 4))
  >>> float(np.abs(nf.dequantize(q) - x).max()) < 0.5
  True
"""

from nvfp4_format._block_scaling import E4M3_MAX
from nvfp4_format._pytree import register_jax_pytrees
from nvfp4_format.checkpoint_report import CheckpointReport, inspect_checkpoint
from nvfp4_format.e2m1 import E2M1_MAX, E2M1_VALUES, decode_e2m1, encode_e2m1
from nvfp4_format.four_over_six import FOUR_OVER_SIX_E4M3_MAX
from nvfp4_format.mxfp4 import MXFP4Array, dequantize_mxfp4, quantize_mxfp4
from nvfp4_format.mxfp8 import MXFP8Array, dequantize_mxfp8, quantize_mxfp8
from nvfp4_format.nvfp4 import NVFP4Array, dequantize, has_nonfinite, quantize
from nvfp4_format.outer_scale import global_decode_scale, global_encode_scale
from nvfp4_format.packing import pack_fp4, unpack_fp4
from nvfp4_format.safetensors_file import load_safetensors, read_tensor
from nvfp4_format.safetensors_header import read_safetensors_header
from nvfp4_format.swizzle import swizzle_scales, unswizzle_scales

__version__ = "0.1.0"

__all__ = [
    "CheckpointReport",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "FOUR_OVER_SIX_E4M3_MAX",
    "MXFP4Array",
    "MXFP8Array",
    "NVFP4Array",
    "decode_e2m1",
    "dequantize",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "encode_e2m1",
    "global_decode_scale",
    "global_encode_scale",
    "has_nonfinite",
    "inspect_checkpoint",
    "load_safetensors",
    "pack_fp4",
    "quantize",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "read_safetensors_header",
    "read_tensor",
    "register_jax_pytrees",
    "swizzle_scales",
    "unpack_fp4",
    "unswizzle_scales",
]
