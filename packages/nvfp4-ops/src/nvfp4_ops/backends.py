"""Backend capabilities and the `auto` choice.

- "emulated": pure JAX (quantize, dequantize, FP32 dot); runs on every device; the reference.
- "xla": real float4_e2m1fn / float8 operands through `jax.lax.scaled_dot` (block-scaled dot);
  XLA decomposes it to dequantize + dot where no block-scaled GEMM exists (CPU, pre-Blackwell).
- "te": TransformerEngine's JAX NVFP4 recipe, only on sm_100+ GPUs with `transformer_engine.jax`.
"""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp

BACKENDS = ("emulated", "xla", "te")

log = logging.getLogger("nvfp4_ops")


def _xla_available() -> tuple[bool, str]:
    if not hasattr(jax.lax, "scaled_dot"):
        return False, f"jax {jax.__version__} has no jax.lax.scaled_dot"
    try:
        a = jnp.zeros((1, 1, 32), jnp.float4_e2m1fn)
        s = jnp.ones((1, 1, 2), jnp.float8_e4m3fn)
        dims = (((2,), (2,)), ((0,), (0,)))
        f = jax.jit(
            lambda a, s: jax.lax.scaled_dot(
                a,
                a,
                lhs_scale=s,
                rhs_scale=s,
                dimension_numbers=dims,
                preferred_element_type=jnp.float32,
            )
        )
        f.lower(a, s).compile()
    except Exception as err:  # noqa: BLE001 - any failure means "not available here"
        return False, f"jax.lax.scaled_dot does not compile on {jax.default_backend()}: {err}"
    native = blackwell_devices()
    where = "cuDNN block-scaled GEMM may apply (Blackwell)" if native else "dequantize + dot"
    return True, f"jax.lax.scaled_dot compiles on {jax.default_backend()} ({where})"


def blackwell_devices() -> list[str]:
    """Descriptions of local GPUs with compute capability >= 10.0 (sm_100+)."""
    out = []
    for d in jax.local_devices():
        cc = getattr(d, "compute_capability", None)
        if d.platform == "gpu" and cc is not None and float(cc) >= 10.0:
            out.append(f"{d.device_kind} (sm_{cc.replace('.', '')})")
    return out


def _te_available() -> tuple[bool, str]:
    try:
        te = importlib.import_module("transformer_engine.jax")
    except Exception as err:  # noqa: BLE001 - ImportError or a broken CUDA install
        return False, f"transformer_engine.jax does not import: {type(err).__name__}: {err}"
    if not hasattr(getattr(te, "quantize", None), "ScalingMode") and not hasattr(te, "dense"):
        return False, "transformer_engine.jax has no dense/quantize API (need TE >= 2.9)"
    gpus = blackwell_devices()
    if not gpus:
        kinds = sorted({f"{d.platform}:{d.device_kind}" for d in jax.local_devices()})
        return False, f"TE NVFP4 needs an sm_100+ GPU, found {kinds}"
    return True, f"transformer_engine.jax imports and GPUs {gpus} are sm_100+"


@functools.cache
def backend_capabilities() -> dict[str, tuple[bool, str]]:
    """{backend name: (available, reason)} for "emulated", "xla" and "te" on this host.

    Example:
      >>> backend_capabilities()["emulated"][0]
      True
    """
    return {
        "emulated": (True, "pure JAX; runs on every device"),
        "xla": _xla_available(),
        "te": _te_available(),
    }


@functools.cache
def auto_backend() -> tuple[str, str]:
    """(backend, why) that `backend="auto"` uses; logged once per process.

    1. "te" when available: the path known to reach FP4 tensor cores in training (sm_100+).
    2. On a GPU without it, "xla" when `scaled_dot` compiles: exact BF16 operands on tensor cores
       with FP32 accumulation, where "emulated" runs FP32 (HIGHEST) dots (expected faster; not
       measured in this project, no GPU was available).
    3. Otherwise "emulated": on CPU it is faster than "xla" (measured, docs/ops.md) and it is the
       bit-exact reference.
    """
    caps = backend_capabilities()
    if caps["te"][0]:
        pick, why = "te", caps["te"][1]
    elif jax.default_backend() == "gpu" and caps["xla"][0]:
        pick = "xla"
        why = f"TE unavailable ({caps['te'][1]}); on GPU xla's BF16-operand dot beats FP32 (unmeasured)"
    else:
        pick = "emulated"
        why = f"TE unavailable ({caps['te'][1]}); emulated is the fastest here and the reference"
    log.warning("nvfp4_ops: backend='auto' uses %r: %s", pick, why)
    return pick, why


def resolve_backend(backend: str) -> str:
    """Map "auto" to a concrete backend; raise if a named backend is unknown or unavailable."""
    if backend == "auto":
        return auto_backend()[0]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    ok, why = backend_capabilities()[backend]
    if not ok:
        raise ValueError(f"backend={backend!r} is not available here: {why}")
    return backend
