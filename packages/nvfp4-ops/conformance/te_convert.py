"""Between TE's PyTorch reference and nvfp4_format: tensors, quantized results, test operands.

Operands are made in NumPy (float32, or bfloat16 through ml_dtypes' round-to-nearest-even) and
handed to torch bit for bit, so both sides quantize the very same values.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import nvfp4_format as nf

FLT_MAX = np.float32(np.finfo(np.float32).max)
DISTRIBUTIONS = (
    "normal", "outliers", "wide_range", "zero_blocks", "flushing_blocks", "ties", "uniform",
)  # fmt: skip
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def operand(kind: str, shape: tuple[int, int], dtype, seed: int) -> np.ndarray:
    """Test data of one distribution (see `DISTRIBUTIONS`), cast to `dtype`.

    - normal: N(0, 1).
    - outliers: N(0, 1) with 0.5% of the values times 10^3 (heavy-tailed, as activations are).
    - wide_range: normal with each block scaled by 2^u, u ~ U(-24, 0): block scales over the
      whole E4M3 range, subnormals included.
    - zero_blocks: normal with every third 16-element block all zero.
    - flushing_blocks: normal with every fifth block scaled by 1e-7 of the tensor amax, so its
      E4M3 scale rounds to zero and the block flushes (spec section 2).
    - ties: values that land exactly on E2M1 rounding midpoints after scaling (blocks whose
      amax maps to 6 exactly: a 6 in every block and the rest from the midpoint grid).
    - uniform: U(-1, 1) with an exact -0.0 and +0.0 in each row.
    """
    rng = np.random.default_rng(seed)
    rows, cols = shape
    if kind == "ties":
        midpoints = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0])
        x = rng.choice(midpoints, shape) * rng.choice([-1.0, 1.0], shape)
        x[:, ::16] = 6.0
        return x.astype(dtype)
    if kind == "uniform":
        x = rng.uniform(-1.0, 1.0, shape)
        x[:, 1], x[:, 2] = -0.0, 0.0
        return x.astype(np.float32).astype(dtype)
    x = rng.standard_normal(shape)
    blocks = x.reshape(rows, cols // 16, 16)
    if kind == "outliers":
        mask = rng.random(shape) < 0.005
        x = np.where(mask, x * 1e3, x)
    elif kind == "wide_range":
        blocks *= np.exp2(rng.uniform(-24.0, 0.0, (rows, cols // 16, 1)))
    elif kind == "zero_blocks":
        blocks[:, ::3] = 0.0
    elif kind == "flushing_blocks":
        blocks[:, ::5] *= 1e-7 * np.abs(x).max() / np.abs(blocks[:, ::5]).max()
    elif kind != "normal":
        raise ValueError(f"unknown distribution {kind!r}, expected one of {DISTRIBUTIONS}")
    return x.astype(np.float32).astype(dtype)


def to_torch(x: np.ndarray) -> torch.Tensor:
    """The same bits as a torch tensor (float32 or bfloat16)."""
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x, np.float32))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's bits as NumPy (bfloat16 through ml_dtypes, float8 E4M3 likewise)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def decode_scale_of_amax(amax: float) -> np.float32:
    """TE's global decode scale for a tensor amax: 1 / min(6*448 / amax, FLT_MAX), 1 if that is 0."""
    amax = np.float32(amax)
    with np.errstate(divide="ignore"):
        s_enc = np.minimum(np.float32(6.0 * 448.0) / amax, FLT_MAX)
    if s_enc == 0:
        s_enc = np.float32(1.0)
    return np.float32(1.0) / s_enc


def as_nvfp4(
    data: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, block_shape
) -> nf.NVFP4Array:
    """One direction of a TE reference result as an `nvfp4_format.NVFP4Array` (NumPy)."""
    packed = to_numpy(data).astype(np.uint8)
    rows, half = packed.shape
    scales = to_numpy(scale)[:rows, : 2 * half // 16]
    return nf.NVFP4Array(
        packed=packed,
        block_scales=scales,
        global_scale=decode_scale_of_amax(float(amax.reshape(-1)[0])),
        shape=(rows, 2 * half),
        block_shape=block_shape,
    )


def differences(ours: nf.NVFP4Array, theirs: nf.NVFP4Array, x: np.ndarray) -> dict[str, int]:
    """Counts of differing scales, global scales and codes, outside the documented choices.

    Codes are compared everywhere except in blocks whose E4M3 scale is 0 (TE leaves saturated
    codes there, we write zeros; both decode to 0) and at exact -0.0 inputs (TE writes +0, we
    write -0). Block scales and the global decode scale are compared everywhere.
    """
    ours_scales = np.asarray(ours.block_scales).view(np.uint8)
    their_scales = np.asarray(theirs.block_scales).view(np.uint8)
    live = np.repeat(their_scales != 0, 16, axis=-1)
    negative_zero = (x.astype(np.float32) == 0) & np.signbit(x.astype(np.float32))
    compared = live & ~negative_zero
    codes_differ = (np.asarray(ours.codes()) != np.asarray(theirs.codes())) & compared
    return {
        "block_scales": int((ours_scales != their_scales).sum()),
        "global_scale": int(np.float32(ours.global_scale) != np.float32(theirs.global_scale)),
        "codes": int(codes_differ.sum()),
        "codes_compared": int(compared.sum()),
    }
