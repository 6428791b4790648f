"""NVFP4 per-block scale arithmetic (spec section 2), shared by the standard and Four Over Six rules.

sb    = e4m3(clip(amax_block * (s_enc * (1/m)), 0, 448))    m = 6 (standard) or 4 (Four Over Six)
enc_b = min(1 / (float32(sb) * s_dec), FLT_MAX)             0 for a block with sb == 0
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from nvfp4_format.e2m1 import CHUNK_ELEMENTS

E4M3_MAX = 448.0
BLOCK_SIZE = 16
FLT_MAX = float(np.finfo(np.float32).max)


def e4m3_block_scales(xp: Any, block_amax: Any, s_enc: Any, block_max_value: float) -> Any:
    """float8_e4m3fn decode scales e4m3(clip(amax_block * (s_enc * (1/m)), 0, 448)), RNE.

    `block_max_value` m is the E2M1 value the block amax maps to: 6 for standard NVFP4, 4 for the
    Four Over Six candidate. `1/m` is the float32 constant (1/6 rounded; 1/4 exact).
    """
    per_block = block_amax * (s_enc * xp.float32(1.0 / block_max_value))
    return xp.clip(per_block, 0.0, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)


def block_encode_scales(xp: Any, scales: Any, s_dec: Any) -> Any:
    """float32 enc_b = min(1 / (float32(sb) * s_dec), FLT_MAX) per block; 0 where sb == 0.

    1 / inf = 0 for zero blocks. Everything per-block sits before the division: XLA keeps a
    division's result as one small per-block array, but fuses cheap ops (such as the E4M3
    rounding) into the per-element loop, recomputing them for every element (~2x slower).
    """
    sb = scales.astype(xp.float32)
    denominator = xp.where(sb == 0, xp.float32(np.inf), sb * s_dec)
    return xp.minimum(xp.float32(1.0) / denominator, xp.float32(FLT_MAX))


def row_chunks(n_rows: int, k: int, multiple: int = 1) -> list[slice]:
    """Slices of ~CHUNK_ELEMENTS elements over [n_rows, k] rows, each a multiple of `multiple` rows.

    NumPy runs the per-element work chunk by chunk: its temporaries then stay in cache instead of
    being fresh 64 MB arrays (page faults, memory traffic per operation), ~5-10x faster.
    """
    step = max(1, CHUNK_ELEMENTS // (k * multiple)) * multiple
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]
