"""Backends: what this host can run, what one call needs, and which backend runs it.

- "emulated": pure JAX (quantize, dequantize, FP32 dot); runs on every device; the reference.
- "xla": real float4_e2m1fn / float8 operands and E4M3/E8M0 block scales. On CUDA through
  `jax.nn.scaled_matmul` (the `__op$block_scaled_dot` custom call that XLA's block-scaling
  rewriter turns into a cuDNN FP4 GEMM on sm_100+ with cuDNN >= 9.7, and into dequantize + dot
  elsewhere: from XLA's source, not verified on hardware here); elsewhere `jax.lax.scaled_dot`,
  which XLA decomposes into dequantize + dot.
- "te": TransformerEngine's JAX NVFP4 quantizers and cuBLAS GEMM (`nvfp4_ops.te_backend`).

`backend_capability(name)` says whether the host can run a backend at all: for "xla" and "te" it
compiles and runs what that backend really runs (`nvfp4_ops.probe`), and any failure there means
"not available". A call (`Call`: its recipe, batch size, compute and output dtypes, the devices
its operands may span) may still be beyond a backend: TE runs neither batched dot_generals nor
non-BF16 operands nor outputs other than BF16/FP32 nor recipes outside NVFP4BlockScaling.
`select_backend` picks, per call, the first backend of a preference order that can run it; "auto"
is `auto_order()` and falls back call by call, logging each distinct reason once. "auto" gives a
call to "xla" or "te" only once that backend passed `nvfp4_ops.verify_backend` in this process
(`record_verification`), and never gives "te" a call whose operands may span several devices
(`TE_SHARDED_CALLS_VERIFIED`); naming a backend, or an order of them, opts out of both.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.probe import probe_backend
from nvfp4_ops.recipe import Recipe, get_recipe

BACKENDS = ("emulated", "xla", "te")

log = logging.getLogger("nvfp4_ops")


@dataclasses.dataclass(frozen=True)
class Call:
    """What a backend must be able to run: one quantized dot_general, or one grouped call
    (`ragged_dot`).

    Attributes:
      recipe: the recipe.
      batch: the product of the batch dimensions (1 for none).
      compute_dtype: the promoted dtype of lhs and rhs.
      out_dtype: the dtype the result is written in (`preferred_element_type`); None: the
        compute dtype.
      devices: how many devices the operands may be spread over (`operand_devices`).
      grouped: a grouped (ragged, Mixture-of-Experts) call, `nvfp4_ops.ragged_dot`.
    """

    recipe: Recipe
    batch: int = 1
    compute_dtype: np.dtype = np.dtype(jnp.bfloat16)
    out_dtype: np.dtype | None = None
    devices: int = 1
    grouped: bool = False


def operand_devices(*operands) -> int:
    """How many devices `operands` may be spread over.

    Concrete arrays: the devices of their shardings. Inside a trace (`jax.jit`) an operand's
    placement is decided later by the partitioner, so any device of the job may hold a shard:
    `jax.device_count()` (1 on a single-device host, where nothing can be sharded).
    """
    counts = [1]
    for a in operands:
        if isinstance(a, jax.core.Tracer):
            return jax.device_count()
        sharding = getattr(a, "sharding", None)
        if sharding is not None:
            counts.append(len(sharding.device_set))
    return max(counts)


def compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for anything else (ROCm's "gfx90a", CPU, TPU)."""
    cc = getattr(device, "compute_capability", None)
    match = re.fullmatch(r"(\d+)\.(\d+)", str(cc)) if cc is not None else None
    return (int(match[1]), int(match[2])) if match else None


def _cuda_gpus(accept: Callable[[tuple[int, int]], bool]) -> list[str]:
    """Descriptions ("kind (sm_XY)") of the local CUDA GPUs whose compute capability `accept`s."""
    out = []
    for d in jax.local_devices():
        cc = compute_capability(d)
        if d.platform == "gpu" and cc is not None and accept(cc):
            out.append(f"{d.device_kind} (sm_{cc[0]}{cc[1]})")
    return out


def blackwell_devices() -> list[str]:
    """Descriptions of local CUDA GPUs with compute capability >= 10.0 (sm_100+)."""
    return _cuda_gpus(lambda cc: cc >= (10, 0))


TE_TRAINING_ARCHS = ((10, 0), (10, 3))
"""Compute capabilities on which TE's NVFP4 training kernels run: data-center Blackwell (sm_100:
B200, GB200; sm_103: B300, GB300). Consumer and workstation Blackwell (sm_120/121: RTX 50, RTX PRO
6000, DGX Spark) pass TE's own check (compute capability >= 10.0), but its fused RHT-cast kernel
uses TMEM and UMMA instructions those chips lack and fails there with "CUDA Error: invalid
argument" (NVIDIA/TransformerEngine issues 2372, 2956, 3062; PR 2968 only reroutes the PyTorch
path), and the stochastic-rounding cast needs the sm_100 family's `cvt.rs` instruction."""


def te_unsupported_gpus() -> list[str]:
    """Local CUDA GPUs outside `TE_TRAINING_ARCHS` (described as in `blackwell_devices`)."""
    return _cuda_gpus(lambda cc: cc not in TE_TRAINING_ARCHS)


def _cuda() -> bool:
    return any(compute_capability(d) is not None for d in jax.local_devices())


def _probe(backend: str) -> str | None:
    """None if `backend` compiles and runs its real path here (`nvfp4_ops.probe`), else why not."""
    try:
        probe_backend(backend)
    except Exception as err:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(err).__name__}: {err}".strip()
    return None


def _xla_available() -> tuple[bool, str]:
    """Whether the xla backend's real path (`nvfp4_ops.probe`) compiles and runs here, and what
    its block-scaled dot lowers to."""
    where = "jax.nn.scaled_matmul" if _cuda() else "jax.lax.scaled_dot"
    error = _probe("xla")
    if error is not None:
        return False, (
            f"the xla backend's forward and gradients (via {where}) fail on "
            f"{jax.default_backend()}: {error}"
        )
    if blackwell_devices():
        lowering = (
            "XLA may send it to a cuDNN FP4 GEMM (sm_100+, cuDNN >= 9.7; read from XLA's "
            "source, unmeasured here), else dequantize + dot"
        )
    else:
        lowering = "dequantize + dot (no FP4 tensor cores here)"
    return True, f"{where} compiles and runs on {jax.default_backend()}: {lowering}"


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
    if not ok:
        return False, why
    error = _probe("te")
    if error is not None:
        return False, f"{why}, but TE's forward and gradients fail here: {error}"
    return True, f"{why}; GPUs {gpus}"


_AVAILABILITY = {
    "emulated": lambda: (True, "pure JAX; runs on every device"),
    "xla": _xla_available,
    "te": _te_available,
}


@functools.cache
def backend_capability(backend: str) -> tuple[bool, str]:
    """(available, reason) of one backend on this host, computed once per process.

    Only the backends a caller asks about are probed: "auto" on a CPU asks about "te" and
    "emulated" only, so the compile of the xla probe is never paid there.

    Raises:
      ValueError: an unknown backend name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return _AVAILABILITY[backend]()


def backend_capabilities() -> dict[str, tuple[bool, str]]:
    """{backend name: (available, reason)} for "emulated", "xla" and "te" on this host.

    Example:
      >>> backend_capabilities()["emulated"][0]
      True
    """
    return {name: backend_capability(name) for name in BACKENDS}


_VERIFIED: dict[str, tuple[bool, str]] = {}
"""The process's record of `verify_backend` outcomes, {backend: (passed, summary)}: the one piece
of state "auto" reads besides the cached capabilities (see `record_verification`)."""


def record_verification(backend: str, passed: bool, summary: str) -> None:
    """Note that `backend` passed (or failed) `nvfp4_ops.verify_backend` in this process.

    `verify_backend` calls this; from then on "auto" gives `backend` the calls it can run
    (passed) or keeps saying why not (failed).
    """
    _VERIFIED[backend] = (bool(passed), summary)


def verification(backend: str) -> tuple[bool, str] | None:
    """(passed, summary) of `backend`'s latest verification in this process, None if none."""
    return _VERIFIED.get(backend)


TE_SHARDED_CALLS_VERIFIED = False
"""Whether "auto" (and a fallback order) may give "te" a call whose operands may span several
devices. TE's quantize and GEMM are custom-partitioned: each shard computes its own amax unless
the call passes an amax scope and a `MeshResource` is set (`te_backend.te_sharding`), and only
TE's CUDA kernels take that path. The CPU check (conformance: 8 fake devices, TE's pure-JAX
fallbacks, equal to the 1-device result) cannot reach it, so this stays False until a
multi-GPU Blackwell run agrees (docs/ops.md, GPU-only risks); `backend="te"` still runs them."""


def _not_for_auto(backend: str, call: Call, order_is_auto: bool) -> str | None:
    """Why a fallback order passes over `backend` for `call` though it could run it, or None."""
    if backend == "te" and call.devices > 1 and not TE_SHARDED_CALLS_VERIFIED:
        return (
            f"the operands may span {call.devices} devices and TE under sharding (amax scopes, "
            "MeshResource) is untested on hardware; pass backend='te' to use it anyway"
        )
    if not order_is_auto or backend == "emulated":
        return None
    record = verification(backend)
    if record is None:
        return (
            f"not verified in this process: nvfp4_ops.verify_backend({backend!r}) checks it "
            f"against 'emulated' (then 'auto' uses it), or pass backend={backend!r} to use it "
            "unverified"
        )
    passed, summary = record
    return None if passed else f"failed verification in this process: {summary}"


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
    ok, why = backend_capability(backend)
    if not ok:
        return f"not available here: {why}"
    if backend == "te":
        from nvfp4_ops.te_requirements import TE_GROUPED_UNSUPPORTED, te_unsupported

        if call.grouped:
            return TE_GROUPED_UNSUPPORTED
        return te_unsupported(call.recipe, call.batch, call.compute_dtype, call.out_dtype)
    return None


@functools.cache
def _note(pick: str, skipped: tuple[tuple[str, str], ...]) -> None:
    """Log once per distinct choice why "auto" passed over better backends: a warning on a GPU
    (where a native backend was expected to run), information elsewhere."""
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    level = logging.WARNING if jax.default_backend() == "gpu" else logging.INFO
    log.log(level, "nvfp4_ops: backend='auto' uses %r for this call (%s)", pick, reasons)


def select_backend(
    backend: str | tuple[str, ...], call: Call, *, exclude: tuple[str, ...] = ()
) -> str:
    """The backend that runs `call`: a name (which must be able to), "auto", or an order.

    A name runs the call if it can at all. An order (and "auto") skips what cannot run it and
    "te" for calls that may span several devices (`TE_SHARDED_CALLS_VERIFIED`); "auto" also
    skips "xla" and "te" until they passed `verify_backend` in this process. `exclude`: names
    "auto" or an order never picks (a prequantized weight has no "te" path), the rules above
    kept for the rest.

    Raises:
      ValueError: an unknown name, or a named backend that cannot run the call (why is said).
    """
    if isinstance(backend, str) and backend != "auto":
        reason = unsupported(backend, call)
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot run this call: {reason}")
        return backend
    order = auto_order() if backend == "auto" else tuple(backend)
    order = tuple(name for name in order if name not in exclude)
    if not order:
        raise ValueError("backend must name at least one backend, got ()")
    skipped = []
    for name in order:
        reason = unsupported(name, call) or _not_for_auto(name, call, backend == "auto")
        if reason is None:
            if skipped:
                _note(name, tuple(skipped))
            return name
        skipped.append((name, reason))
    raise ValueError(f"no backend of {order} can run this call: {dict(skipped)}")


def auto_backend() -> tuple[str, str]:
    """(backend, why) that "auto" uses for a plain BF16 call of the "nvfp4" recipe on one device
    here, given the verifications recorded so far in this process."""
    call = Call(get_recipe("nvfp4"))
    reasons = []
    for name in auto_order():
        reason = unsupported(name, call) or _not_for_auto(name, call, True)
        if reason is None:
            why = backend_capability(name)[1]
            return name, "; ".join([*reasons, f"{name}: {why}"])
        reasons.append(f"{name} not used ({reason})")
    raise AssertionError("the emulated backend runs every call")
