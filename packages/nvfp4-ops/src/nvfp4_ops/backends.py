"""Backends: what this host can run, what one call needs, and which backend runs it.

- "emulated": pure JAX (quantize, dequantize, FP32 dot); runs on every device; the reference.
- "xla": real float4_e2m1fn / float8 operands and E4M3/E8M0 block scales. On CUDA through
  `jax.nn.scaled_matmul` (the `__op$block_scaled_dot` custom call that XLA's block-scaling
  rewriter turns into a cuDNN FP4 GEMM on sm_100+ with cuDNN >= 9.7, and into dequantize + dot
  elsewhere: from XLA's source, not verified on hardware here); elsewhere `jax.lax.scaled_dot`,
  which XLA decomposes into dequantize + dot.
- "te": TransformerEngine's JAX NVFP4 quantizers and cuBLAS GEMM (`nvfp4_ops.te_backend`).

`backend_capabilities()` says what the host can run at all. A call (`Call`: its recipe, batch size
and compute dtype) may still be beyond a backend: TE runs neither batched dot_generals nor
non-BF16 operands nor recipes outside NVFP4BlockScaling. `select_backend` picks, per call, the
first backend of a preference order that can run it; "auto" is `auto_order()` and falls back
call by call, logging each distinct reason once.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.recipe import Recipe

BACKENDS = ("emulated", "xla", "te")

log = logging.getLogger("nvfp4_ops")


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend must be able to run: one quantized dot_general.

    Attributes:
      recipe: the recipe.
      batch: the product of the batch dimensions (1 for none).
      compute_dtype: the promoted dtype of lhs and rhs.
    """

    recipe: Recipe
    batch: int = 1
    compute_dtype: np.dtype = np.dtype(jnp.bfloat16)


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for anything else (ROCm's "gfx90a", CPU, TPU)."""
    cc = getattr(device, "compute_capability", None)
    match = re.fullmatch(r"(\d+)\.(\d+)", str(cc)) if cc is not None else None
    return (int(match[1]), int(match[2])) if match else None


def blackwell_devices() -> list[str]:
    """Descriptions of local CUDA GPUs with compute capability >= 10.0 (sm_100+)."""
    out = []
    for d in jax.local_devices():
        cc = compute_capability(d)
        if d.platform == "gpu" and cc is not None and cc >= (10, 0):
            out.append(f"{d.device_kind} (sm_{cc[0]}{cc[1]})")
    return out


TE_TRAINING_ARCHS = ((10, 0), (10, 3))
"""Compute capabilities on which TE's NVFP4 training kernels run: data-center Blackwell (sm_100:
B200, GB200; sm_103: B300, GB300). Consumer and workstation Blackwell (sm_120/121: RTX 50, RTX PRO
6000, DGX Spark) pass TE's own check (compute capability >= 10.0), but its fused RHT-cast kernel
uses TMEM and UMMA instructions those chips lack and fails there with "CUDA Error: invalid
argument" (NVIDIA/TransformerEngine issues 2372, 2956, 3062; PR 2968 only reroutes the PyTorch
path), and the stochastic-rounding cast needs the sm_100 family's `cvt.rs` instruction."""


def te_unsupported_gpus() -> list[str]:
    """Local CUDA GPUs outside `TE_TRAINING_ARCHS` (described as in `blackwell_devices`)."""
    out = []
    for d in jax.local_devices():
        cc = compute_capability(d)
        if d.platform == "gpu" and cc is not None and cc not in TE_TRAINING_ARCHS:
            out.append(f"{d.device_kind} (sm_{cc[0]}{cc[1]})")
    return out


def _cuda() -> bool:
    return any(compute_capability(d) is not None for d in jax.local_devices())


def _xla_available() -> tuple[bool, str]:
    """Whether the xla backend's block-scaled dot compiles here, and what it lowers to."""
    a = jnp.zeros((1, 128, 64), jnp.float4_e2m1fn)
    s = jnp.ones((1, 128, 4), jnp.float8_e4m3fn)
    try:
        if _cuda():
            f = jax.jit(jax.nn.scaled_matmul)
            where = "jax.nn.scaled_matmul"
        else:
            dims = (((2,), (2,)), ((0,), (0,)))
            f = jax.jit(lambda a, b, sa, sb: jax.lax.scaled_dot(  # noqa: E731
                a, b, lhs_scale=sa, rhs_scale=sb, dimension_numbers=dims,
                preferred_element_type=jnp.float32,
            ))  # fmt: skip
            where = "jax.lax.scaled_dot"
        f.lower(a, a, s, s).compile()
    except Exception as err:  # noqa: BLE001 - any failure means "not available here"
        return False, f"the block-scaled dot does not compile on {jax.default_backend()}: {err}"
    if blackwell_devices():
        lowering = (
            "XLA may send it to a cuDNN FP4 GEMM (sm_100+, cuDNN >= 9.7; read from XLA's "
            "source, unmeasured here), else dequantize + dot"
        )
    else:
        lowering = "dequantize + dot (no FP4 tensor cores here)"
    return True, f"{where} compiles on {jax.default_backend()}: {lowering}"


def _te_available() -> tuple[bool, str]:
    try:
        importlib.import_module("transformer_engine.jax")
    except Exception as err:  # noqa: BLE001 - ImportError or a broken CUDA install
        return False, f"transformer_engine.jax does not import: {type(err).__name__}: {err}"
    from nvfp4_ops.te_backend import te_host_support  # TE imports, so its helpers do

    gpus = blackwell_devices()
    if not gpus:
        kinds = sorted({f"{d.platform}:{d.device_kind}" for d in jax.local_devices()})
        return False, f"TE's NVFP4 GEMMs need an sm_100+ GPU, found {kinds}"
    others = te_unsupported_gpus()
    if others:
        return False, (
            f"TE trains NVFP4 on sm_100/sm_103 only (its fused RHT and stochastic-rounding "
            f"kernels need data-center Blackwell), found {others}"
        )
    ok, why = te_host_support(os.environ)
    return ok, why if not ok else f"{why}; GPUs {gpus}"


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


def auto_order() -> tuple[str, ...]:
    """The backends "auto" tries, best first.

    1. "te": the path known to reach FP4 tensor cores in training (sm_100+).
    2. On a GPU, "xla": FP4/FP8 operands that XLA may hand to cuDNN, and bf16-sized data
       everywhere else (expected faster than emulation's FP32 dots; unmeasured here).
    3. "emulated": on CPU faster than "xla" (measured, docs/ops.md) and the bit-exact reference.
    """
    if jax.default_backend() == "gpu":
        return ("te", "xla", "emulated")
    return ("te", "emulated")


def unsupported(backend: str, call: Call) -> str | None:
    """Why `backend` cannot run `call` here, or None if it can."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    ok, why = backend_capabilities()[backend]
    if not ok:
        return f"not available here: {why}"
    if backend == "te":
        from nvfp4_ops.te_backend import te_unsupported

        return te_unsupported(call.recipe, call.batch, call.compute_dtype)
    return None


@functools.cache
def _note(pick: str, skipped: tuple[tuple[str, str], ...]) -> None:
    """Log once per distinct choice why "auto" passed over better backends: a warning on a GPU
    (where a native backend was expected to run), information elsewhere."""
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    level = logging.WARNING if jax.default_backend() == "gpu" else logging.INFO
    log.log(level, "nvfp4_ops: backend='auto' uses %r for this call (%s)", pick, reasons)


def select_backend(backend: str | tuple[str, ...], call: Call) -> str:
    """The backend that runs `call`: a name (which must be able to), "auto", or an order.

    Raises:
      ValueError: an unknown name, or a named backend that cannot run the call (why is said).
    """
    if isinstance(backend, str) and backend != "auto":
        reason = unsupported(backend, call)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {reason}")
        return backend
    order = auto_order() if backend == "auto" else tuple(backend)
    if not order:
        raise ValueError("backend must name at least one backend, got ()")
    skipped = []
    for name in order:
        reason = unsupported(name, call)
        if reason is None:
            if skipped:
                _note(name, tuple(skipped))
            return name
        skipped.append((name, reason))
    raise ValueError(f"no backend of {order} can run this call: {dict(skipped)}")


@functools.cache
def auto_backend() -> tuple[str, str]:
    """(backend, why) that "auto" uses for a plain BF16 call of the "nvfp4" recipe here."""
    from nvfp4_ops.recipe import get_recipe

    call = Call(get_recipe("nvfp4"))
    reasons = []
    for name in auto_order():
        reason = unsupported(name, call)
        if reason is None:
            why = backend_capabilities()[name][1]
            return name, "; ".join([*reasons, f"{name}: {why}"])
        reasons.append(f"{name} unavailable ({reason})")
    raise AssertionError("the emulated backend runs every call")
