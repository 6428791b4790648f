"""What "available" means for a native backend: its real path compiles and runs here.

`probe_backend(name)` runs one linear's forward and both gradients through `name`, exactly as
`dot_general` runs them (no backend selection in between), on a tiny call chosen to reach every
step a training call reaches: the full "nvfp4" recipe (16x16 weight tiles reused transposed in
Dgrad, the RHT on the Wgrad operands, stochastic rounding), BF16 operands whose M, K and N are
not multiples of 16 (so each is zero-padded, to the backend's own alignment), packed uint8 codes
bit-cast to float4_e2m1fn for the block-scaled dot (xla), TE's quantizers and GEMM with its
padding (te). A block-scaled dot that compiles on zeros proves none of that.

`backend_capability` calls it once per process, often from inside a trace (it runs eagerly all
the same); any exception means "not available", with the error as the reason. It costs one compile of that small step (seconds on a CPU, where "auto"
never asks about "xla", so only a caller naming "xla" pays it).

Example:
  >>> probe_backend("xla")  # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.canonical import make_layout
from nvfp4_ops.dispatch import run_backend
from nvfp4_ops.recipe import get_recipe

PROBE_SHAPE = (24, 40, 8)
"""(M, K, N) of the probe: none a multiple of 16, so every axis is padded."""

_MATMUL = (((1,), (0,)), ((), ()))


def _linear(backend: str):
    """(x, w, key) -> y through `backend`'s quantized path, as `dot_general` dispatches it."""
    recipe = get_recipe("nvfp4")
    m, k, n = PROBE_SHAPE
    layout = make_layout((m, k), (k, n), _MATMUL)

    def linear(x, w, key):
        return run_backend(backend, x, w, layout, recipe, key, np.dtype(jnp.float32))

    return linear


def probe_backend(backend: str) -> None:
    """Compile and run `backend`'s forward and gradients on the tiny padded call; raises what
    the backend raises (a failed compile, a missing kernel, a non-finite result).

    Runs eagerly even when called while a function is being traced (the first `dot_general`
    naming a backend is often inside `jax.jit`): `jax.ensure_compile_time_eval`.
    """
    with jax.ensure_compile_time_eval():
        _run_probe(backend)


def _run_probe(backend: str) -> None:
    linear = _linear(backend)
    m, k, n = PROBE_SHAPE
    kx, kw, ky = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.1).astype(jnp.bfloat16)

    @jax.jit
    def step(x, w, key):
        y, pullback = jax.vjp(lambda a, b: linear(a, b, key), x, w)
        return (y, *pullback(jnp.ones_like(y)))

    outputs = jax.block_until_ready(step(x, w, ky))
    bad = [name for name, v in zip(("y", "dx", "dw"), outputs, strict=True)
           if not np.isfinite(np.asarray(v, np.float32)).all()]  # fmt: skip
    if bad:
        raise FloatingPointError(f"the probe's {', '.join(bad)} came back non-finite")
