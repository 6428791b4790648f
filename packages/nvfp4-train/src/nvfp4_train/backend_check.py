"""Before step 1: the backends a run may use, checked against the emulated one on this machine.

`precision.verify_backend` ("warn" by default) runs `nvfp4_ops.verify_backend` for every backend
other than "emulated" that `precision.backend` may use here (with "auto": TE on sm_100+ GPUs, xla
on GPUs), on the run's quantized recipes plus "nvfp4-no-sr" (whose round-to-nearest GEMMs are
compared to a derived bound, not statistically). A backend that disagrees is not used: the run
says so loudly and continues on the remaining ones ("warn"), or stops ("strict").
On CPU with "auto" there is nothing to check (only "emulated" runs), and it costs nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import nvfp4_ops
from nvfp4_train.errors import ConfigError, RunError
from nvfp4_train.policy import PrecisionConfig, backend_spec

ALWAYS_CHECKED = "nvfp4-no-sr"


def _order(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    if spec == "auto":
        return nvfp4_ops.auto_order()
    return (spec,) if isinstance(spec, str) else spec


def trusted_backend(
    precision: PrecisionConfig, recipe_names: Iterable[str], say: Callable[[str], None]
) -> str:
    """The `precision.backend` value the run should use: the configured one, or the configured
    order without the backends that disagree with "emulated".

    Raises:
        ConfigError: an explicitly named single backend is not available on this machine.
        RunError: a backend disagrees and `precision.verify_backend` is "strict".
    """
    spec = backend_spec(precision.backend)
    caps = nvfp4_ops.backend_capabilities()
    if isinstance(spec, str) and spec != "auto" and not caps[spec][0]:
        raise ConfigError(f"precision.backend={spec!r} is not available here: {caps[spec][1]}")
    order = _order(spec)
    candidates = [b for b in order if b != "emulated" and caps[b][0]]
    names = {n for n in recipe_names if nvfp4_ops.get_recipe(n).quantized}
    if precision.verify_backend == "off" or not candidates or not names:
        return precision.backend
    recipes = tuple(sorted(names | {ALWAYS_CHECKED}))
    failed = []
    for backend in candidates:
        t0 = time.perf_counter()
        report = nvfp4_ops.verify_backend(backend, recipes=recipes)
        verdict = "agrees with" if report.ok else "DISAGREES with"
        say(
            f"backend {backend!r} {verdict} 'emulated' on {len(report.checks)} checks of "
            f"{', '.join(recipes)} ({time.perf_counter() - t0:.1f}s; precision.verify_backend)"
        )
        if not report.ok:
            say(report.table())
            failed.append(backend)
    if not failed:
        return precision.backend
    if precision.verify_backend == "strict":
        raise RunError(
            f"backend(s) {failed} disagree with the emulated reference on this machine "
            "(table above); not training with them (precision.verify_backend=strict). Set "
            "precision.backend to another backend, or report the table as a bug."
        )
    remaining = [b for b in order if b not in failed] or ["emulated"]
    chosen = ",".join(remaining)
    say(
        f"WARNING: backend(s) {failed} disagree with the emulated reference on this machine and "
        f"are NOT used: this run continues with precision.backend={chosen!r} "
        "(precision.verify_backend=strict stops instead)"
    )
    return chosen


def backend_line(backend: str) -> str:
    """One line saying which ops backends the quantized GEMMs may use here, and why not others.

    A backend that is available may still pass a call on to the next one it cannot run (a shape,
    a recipe): nvfp4_ops logs each such reason once.
    """
    order = _order(backend_spec(backend))
    caps = nvfp4_ops.backend_capabilities()
    usable = ", ".join(b for b in order if caps[b][0]) or "none"
    absent = "; ".join(f"{b}: {caps[b][1]}" for b in order if not caps[b][0])
    return f"ops backend: precision.backend={backend} -> {usable}" + (
        f" (not here: {absent})" if absent else ""
    )
