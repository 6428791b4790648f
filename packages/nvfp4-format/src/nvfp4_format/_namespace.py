"""Array-namespace dispatch: one implementation for NumPy arrays and JAX arrays.

The namespace is taken from the input. JAX is never imported here: an array can only be a JAX array
if the caller already imported JAX, so `sys.modules` tells.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(ml_dtypes.bfloat16),
)


def is_jax_array(x: Any) -> bool:
    """True for `jax.Array` values, tracers inside `jax.jit` included."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def namespace(*arrays: Any) -> ModuleType:
    """`jax.numpy` if any argument is a JAX array, else `numpy`."""
    if any(is_jax_array(a) for a in arrays):
        from nvfp4_format._pytree import register_jax_pytrees

        register_jax_pytrees()  # results are containers that must cross jit boundaries
        return sys.modules["jax.numpy"]
    return np


def check_float(name: str, x: Any) -> None:
    """Raise TypeError unless `x` is an array with a floating dtype (f16, bf16, f32, f64)."""
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(
            f"{name} must be a NumPy or JAX array with a floating dtype, got "
            f"{type(x).__name__} (wrap it: np.asarray({name}, np.float32))"
        )
    dtype = np.dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype (float16, bfloat16, float32, float64), "
            f"got dtype={dtype}"
        )


def check_finite(name: str, x: Any) -> None:
    """Raise ValueError if a NumPy array holds NaN or Inf (JAX arrays are not checked here).

    JAX values cannot raise inside `jit`; callers mark their results instead (a NaN global scale).
    """
    if is_jax_array(x):
        return
    finite = np.isfinite(np.asarray(x, dtype=np.float32))
    if not finite.all():
        bad = np.argwhere(~finite)
        first = tuple(int(i) for i in bad[0])
        raise ValueError(
            f"{name} contains {len(bad)} non-finite value(s) (NaN or Inf), first at index {first}; "
            "NVFP4 has no encoding for them"
        )


def check_uniform(name: str, uniform: Any, shape: tuple[int, ...]) -> None:
    """Validate the caller-supplied uniform random numbers for stochastic rounding."""
    if uniform is None:
        raise ValueError(
            f"rounding='stochastic' needs {name}: uniform random numbers in [0, 1) of shape {shape} "
            "(e.g. jax.random.uniform(key, shape) or numpy Generator.random(shape))"
        )
    if tuple(uniform.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {shape}, got {tuple(uniform.shape)}")
    if not is_jax_array(uniform):
        u = np.asarray(uniform)
        if u.size and (not np.isfinite(u).all() or u.min() < 0 or u.max() >= 1):
            raise ValueError(f"{name} must lie in [0, 1), got values in [{u.min()}, {u.max()}]")


def check_rounding(rounding: str) -> None:
    if rounding not in ("rne", "stochastic"):
        raise ValueError(f"rounding must be 'rne' or 'stochastic', got {rounding!r}")


def check_fields(
    owner: str, shape: Any, fields: dict[str, tuple[Any, Any, tuple[int, ...]]]
) -> None:
    """Validate a quantized container's array fields against its logical `shape`.

    `fields` maps a field name to (value, expected dtype, expected trailing shape). A value that is
    not an array (JAX passes None or placeholders through pytree maps) is not checked; leading
    dimensions beyond the expected ones are allowed, as `jax.vmap` adds them, but must be the same
    for every field.

    Raises:
      TypeError: a field has the wrong dtype.
      ValueError: a field's trailing shape does not fit `shape`, or batch dimensions disagree.
    """
    batch = None
    for name, (value, dtype, trailing) in fields.items():
        if not (hasattr(value, "shape") and hasattr(value, "dtype")):
            continue
        if np.dtype(value.dtype) != np.dtype(dtype):
            raise TypeError(
                f"{owner}.{name} must have dtype {np.dtype(dtype)}, got {np.dtype(value.dtype)}"
            )
        got = tuple(value.shape)
        n = len(trailing)
        if len(got) < n or got[len(got) - n :] != trailing:
            raise ValueError(
                f"{owner}.{name} must have shape {trailing} for shape={tuple(shape)}, got {got}"
            )
        lead = got[: len(got) - n]
        if batch is not None and lead != batch:
            raise ValueError(
                f"{owner}: leading (batch) dimensions of its fields differ: {batch} and {lead}"
            )
        batch = lead


def check_logical_shape(owner: str, shape: Any, block: int) -> tuple[int, ...]:
    """`shape` as a tuple of ints >= 0 whose last entry is a multiple of `block`."""
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(f"{owner}.shape must be a tuple of ints, got {shape!r}") from None
    if not shape or any(d < 0 for d in shape) or shape[-1] % block:
        raise ValueError(
            f"{owner}.shape must be non-negative sizes whose last is a multiple of {block}, "
            f"got {shape}"
        )
    return shape
