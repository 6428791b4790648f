"""The 128x4 tiled block-scale layout that Blackwell block-scaled GEMMs (cuBLAS, cuDNN) read.

Scales [rows, cols] are zero-padded to rows % 128 == 0 and cols % 4 == 0, then stored tile by tile:
for tile (rt, ct) = (r // 128, c // 4), tiles row-major over (rt, ct), 512 bytes each,

    offset(r, c) = (rt * (Cpad / 4) + ct) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
"""

from __future__ import annotations

from typing import Any

from nvfp4_format._namespace import namespace


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def swizzle_scales(scales: Any) -> Any:
    """Block scales [..., rows, cols] -> [..., Rpad, Cpad] whose row-major bytes are the 128x4 layout.

    Works for any element dtype (float8_e4m3fn NVFP4 scales, uint8 E8M0 MXFP4 scales). Leading
    dimensions are batch dimensions, swizzled independently.

    Example:
      >>> import numpy as np
      >>> swizzle_scales(np.arange(8, dtype=np.uint8).reshape(2, 4)).shape
      (128, 4)
    """
    xp = namespace(scales)
    if scales.ndim < 2:
        raise ValueError(
            f"scales must be at least 2-D [rows, cols], got shape {tuple(scales.shape)}"
        )
    *lead, rows, cols = scales.shape
    rpad, cpad = _padded(rows, 128), _padded(cols, 4)
    pad = [(0, 0)] * len(lead) + [(0, rpad - rows), (0, cpad - cols)]
    s = xp.pad(scales, pad)
    n = len(lead)
    # r = rt*128 + a*32 + b, c = ct*4 + d  ->  order (rt, ct, b, a, d)
    s = s.reshape(*lead, rpad // 128, 4, 32, cpad // 4, 4)
    s = s.transpose(*range(n), n + 0, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*lead, rpad, cpad)


def unswizzle_scales(swizzled: Any, rows: int, cols: int) -> Any:
    """Invert `swizzle_scales` and crop the padding: [..., Rpad, Cpad] -> [..., rows, cols]."""
    xp = namespace(swizzled)
    *lead, rpad, cpad = swizzled.shape
    if (rpad, cpad) != (_padded(rows, 128), _padded(cols, 4)):
        raise ValueError(
            f"swizzled must have shape [..., {_padded(rows, 128)}, {_padded(cols, 4)}] for "
            f"rows={rows}, cols={cols}, got {tuple(swizzled.shape)}"
        )
    n = len(lead)
    s = xp.asarray(swizzled).reshape(*lead, rpad // 128, cpad // 4, 32, 4, 4)
    s = s.transpose(*range(n), n + 0, n + 3, n + 2, n + 1, n + 4)
    return s.reshape(*lead, rpad, cpad)[..., :rows, :cols]
