"""Before step 1: the backends a run may use, checked against the emulated one on this machine.

`precision.verify_backend` ("warn" by default) runs `nvfp4_ops.verify_backend` for every backend
other than "emulated" that `precision.backend` may use here (with "auto": TE on sm_100/sm_103
GPUs, xla on GPUs), on the run's quantized recipes plus "nvfp4-no-sr" (whose round-to-nearest
GEMMs are compared to a derived bound, not statistically). A backend that disagrees, or that
crashes while it is verified (a compile error, a missing kernel), is not used: the run says so
loudly, names it with the reason in the `ops backend:` line, and continues on the remaining ones
("warn"), or stops ("strict"). The checks are recorded in this process, so `backend="auto"`
inside the model then uses exactly the backends that passed; with "off", "auto" becomes the
explicit order (nvfp4_ops gives an unverified backend nothing under "auto").
On CPU with "auto" there is nothing to check (only "emulated" runs), and it costs nothing.

`te_context(backend, mesh, ..., attention=...)` is what a sharded run wraps its steps in when it may
run TE (GEMMs or fused attention): TE's `MeshResource` built from the run's mesh axes
(`nvfp4_ops.te_sharding`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import nvfp4_ops
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.precision.policy import PrecisionConfig, backend_spec

ALWAYS_CHECKED = "nvfp4-no-sr"


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The `precision.backend` value the run uses, and the backends left out with the reason.

    Attributes:
      backend: the configured value, or the configured order without the dropped backends.
      dropped: {backend: why it is not used} ("disagrees with ...", "crashed while verified: ...").
    """

    backend: str
    dropped: dict[str, str] = dataclasses.field(default_factory=dict)


def _order(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    if spec == "auto":
        return nvfp4_ops.auto_order()
    return (spec,) if isinstance(spec, str) else spec


def _verified(backend: str, recipes: tuple[str, ...], say: Callable[[str], None]) -> str | None:
    """None if `backend` agrees with "emulated" on `recipes`, else why it must not be used."""
    t0 = time.perf_counter()
    report = nvfp4_ops.verify_backend(backend, recipes=recipes)
    if report.error is not None:
        verdict = "CRASHED while checked against"
    else:
        verdict = "agrees with" if report.ok else "DISAGREES with"
    say(
        f"backend {backend!r} {verdict} 'emulated' on {len(report.checks)} checks of "
        f"{', '.join(recipes)} ({time.perf_counter() - t0:.1f}s; precision.verify_backend)"
    )
    if report.ok:
        return None
    say(report.table())
    return report.summary


def trusted_backend(
    precision: PrecisionConfig, recipe_names: Iterable[str], say: Callable[[str], None]
) -> BackendChoice:
    """The `precision.backend` value the run should use: the configured one, or the configured
    order without the backends that disagree with "emulated" or crash while checked.

    Raises:
        ConfigError: an explicitly named single backend is not available on this machine.
        RunError: a backend fails its check and `precision.verify_backend` is "strict".
    """
    spec = backend_spec(precision.backend)
    if isinstance(spec, str) and spec != "auto":
        ok, why = nvfp4_ops.backend_capability(spec)
        if not ok:
            raise ConfigError(f"precision.backend={spec!r} is not available here: {why}")
    order = _order(spec)
    candidates = [b for b in order if b != "emulated" and nvfp4_ops.backend_capability(b)[0]]
    names = {n for n in recipe_names if nvfp4_ops.get_recipe(n).quantized}
    if not candidates or not names:
        return BackendChoice(precision.backend)
    if precision.verify_backend == "off":  # "auto" alone would give unverified backends nothing
        return BackendChoice(precision.backend if spec != "auto" else ",".join(order))
    recipes = tuple(sorted(names | {ALWAYS_CHECKED}))
    dropped = {b: why for b in candidates if (why := _verified(b, recipes, say)) is not None}
    if not dropped:
        return BackendChoice(precision.backend)
    failed = list(dropped)
    if precision.verify_backend == "strict":
        reasons = "; ".join(f"{b}: {why}" for b, why in dropped.items())
        raise RunError(
            f"backend(s) {failed} failed the check against the emulated reference on this "
            f"machine ({reasons}); not training with them (precision.verify_backend=strict). "
            "Set precision.backend to another backend, or report the table above as a bug."
        )
    remaining = [b for b in order if b not in dropped] or ["emulated"]
    chosen = ",".join(remaining)
    say(
        f"WARNING: backend(s) {failed} failed the check against the emulated reference on this "
        f"machine and are NOT used: this run continues with precision.backend={chosen!r} "
        "(precision.verify_backend=strict stops instead)"
    )
    return BackendChoice(chosen, dropped)


def backend_line(backend: str, dropped: dict[str, str] | None = None) -> str:
    """One line saying which ops backends the quantized GEMMs may use here, and why not others.

    `backend` is the configured `precision.backend`; `dropped` the backends its check left out
    (`BackendChoice.dropped`), named with the reason. A backend that is available may still pass
    a call on to the next one it cannot run (a shape, a recipe): nvfp4_ops logs each such reason
    once.
    """
    dropped = dropped or {}
    order = _order(backend_spec(backend))
    caps = {b: nvfp4_ops.backend_capability(b) for b in order}
    usable = ", ".join(b for b in order if caps[b][0] and b not in dropped)
    usable = usable or ("emulated" if dropped else "none")
    absent = "; ".join(f"{b}: {caps[b][1]}" for b in order if not caps[b][0])
    left_out = "; ".join(f"{b}: {why}" for b, why in dropped.items())
    return (
        f"ops backend: precision.backend={backend} -> {usable}"
        + (f" (not here: {absent})" if absent else "")
        + (f" (not used: {left_out})" if left_out else "")
    )


def te_context(
    backend: str, mesh: Any, *, data: str, fsdp: str, attention: str = ""
) -> contextlib.AbstractContextManager:
    """The context a run's steps (and the attention check) are traced and compiled in:
    `nvfp4_ops.te_sharding` over `mesh` (TE's `MeshResource` from the run's mesh axes, and the
    mesh itself) when the run may call TE on several devices, its GEMMs (`backend`) or its fused
    attention (`attention` "te": without it TE partitions attention for a context-parallel axis
    named "" and fails to compile), else nothing.

    Args:
      backend: the `precision.backend` value the run uses (after `trusted_backend`).
      mesh: the run's `jax.sharding.Mesh`.
      data, fsdp: the names of its data-parallel and FSDP axes.
      attention: the attention implementation the run uses (resolved, e.g. "te").
    """
    if mesh.size == 1:
        return contextlib.nullcontext()
    if attention != "te":
        order = _order(backend_spec(backend))
        if "te" not in order or not nvfp4_ops.backend_capability("te")[0]:
            return contextlib.nullcontext()
    if mesh.shape.get("expert", 1) > 1:
        raise ConfigError(
            "TransformerEngine (precision.backend or model.attention 'te') cannot run on a mesh "
            "with mesh.expert > 1 (TE's MeshResource has one data-parallel axis, the batch is "
            f"split over data, fsdp and expert), got {dict(mesh.shape)}"
        )
    return nvfp4_ops.te_sharding(mesh, data=data, fsdp=fsdp)
