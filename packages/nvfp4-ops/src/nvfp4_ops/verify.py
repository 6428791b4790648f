"""Check a backend against the emulated one on this machine before trusting it.

`verify_backend(backend)` runs a fixed battery - aligned, unaligned (padded) and batched shapes,
and a grouped (Mixture-of-Experts) call of `ragged_dot`; the forward y and the gradients dX and
dW; round-to-nearest and stochastic-rounding presets -
through `backend` and through "emulated", and compares them:

- round to nearest: every element within a derived bound. Both backends quantize to the same
  codes and scales (TE's kernels and this project's emulation agree bit for bit, see the
  conformance session); they differ in how the products are summed and where the global scales
  are rounded. The accumulation model (assumed for the GPU backends, untested on hardware):
  every product of two decoded elements is exact; "emulated" sums them in FP32 in some order;
  the backend may sum them in any order and grouping, where a group of at most 64 products (one
  FP4 MMA step) is aligned to its largest product keeping at least 22 fraction bits and
  truncated, and the group sums are accumulated in FP32, round-toward-zero allowed. Then
  |a - b| <= ((2 K + 8) u + 2^-16) * 4 (|x| @ |w|), u = 2^-24, K the contraction: 2 K u for the
  two FP32 summations, 8 u for the global-scale roundings, 2^-16 = 64 * 2^-22 for the aligned
  groups, 4 covering |Q(v)| <= 2 |v| on both operands; plus one rounding of each side
  (2^-8 |value|) for BF16 outputs.
- stochastic rounding: the backends draw different random numbers, so the means over `draws`
  keys are compared in units of their standard error: the average of z^2 over the elements is
  about 1 (below `Z2_LIMIT`) unless one of them is biased.

What this resolves: the forward is compared in FP32 and catches a relative error of a few 1e-4
at these sizes; the gradients come back in the operands' dtype (BF16), whose rounding hides
errors below ~0.4% per element. TransformerEngine's own NVFP4 GEMM tests allow
|a - b| <= 8e-3 + 8e-3 |b| against an FP32 reference (two BF16 steps, for every output dtype):
looser than this bound for FP32 outputs, about the same for BF16 ones. A wrong scale layout, a
wrong RHT sign or a wrong transform is far larger than either (tests/test_verify.py injects
both on CPU, and a GEMM with the assumed tensor-core accumulation, which passes).

A backend that raises while it is verified (a compile error, a missing kernel, a runtime
failure) is reported with that error and fails (`VerifyReport.error`): it is not used, like one
that disagrees. Every comparison is a `Check`; `VerifyReport.ok` is True when all pass and
nothing crashed. Cases a backend cannot run (TE and batched or grouped calls) are reported as not
applicable: `select_backend` never gives them to it. The outcome is recorded for this process
(`backends.record_verification`): "auto" uses a native backend only once it passed. The
throughput of one forward + backward of the aligned case is measured for both backends.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nvfp4_ops.backends import Call, record_verification, unsupported
from nvfp4_ops.dot import dot_general
from nvfp4_ops.grouped import ragged_dot
from nvfp4_ops.recipe import get_recipe

U = 2.0**-24
TENSOR_CORE_GROUPS = 64 * 2.0**-22
"""The aligned-group term of the accumulation model: up to 64 products per group, each truncated
to 22 fraction bits below the group's largest (see the module docstring; an assumption)."""
BF16_ROUNDING = 2.0**-8
Z2_LIMIT = 2.0
RECIPES = ("nvfp4-no-sr", "nvfp4")


@dataclasses.dataclass(frozen=True)
class Case:
    """One call of the battery: a dot_general lhs [*batch, M, K] . rhs [*batch, K, N], or with
    `group_sizes` a grouped `ragged_dot` x [M, K] . w [E, K, N] (E = len(group_sizes); rows
    past their sum are padding)."""

    name: str
    m: int
    k: int
    n: int
    batch: int = 0  # 0: no batch dimension
    group_sizes: tuple[int, ...] = ()  # (): a dot_general

    def dimension_numbers(self):
        if self.batch:
            return (((2,), (1,)), ((0,), (0,)))
        return (((1,), (0,)), ((), ()))

    def shapes(self) -> tuple[tuple[int, ...], ...]:
        if self.group_sizes:
            return (self.m, self.k), (len(self.group_sizes), self.k, self.n), (self.m, self.n)
        lead = (self.batch,) if self.batch else ()
        return (*lead, self.m, self.k), (*lead, self.k, self.n), (*lead, self.m, self.n)

    def groups(self) -> list[slice]:
        """The rows of each group (grouped cases)."""
        ends = np.cumsum(self.group_sizes)
        return [slice(int(e - g), int(e)) for e, g in zip(ends, self.group_sizes, strict=True)]

    def contractions(self) -> dict[str, int]:
        """The contraction of each output's GEMM (Wgrad: the largest group, padded to 16)."""
        tokens = max((-(-g // 16) * 16 for g in self.group_sizes), default=self.m)
        return {"y": self.k, "dx": self.n, "dw": tokens}


GROUPED_SIZES = (*((0, 1, 40, 0, 37, 5, 16, 3) * 16)[:127], 200)
"""Rows of the 128 experts of the grouped case: empty experts (one in four), one-row ones, uneven
sizes from 1 to 200 rows, 1829 rows in all; the last expert spans 13 tiles (and as many of the
xla backend's GEMM blocks, whose partial Wgrad products are then summed)."""

BATTERY = (
    Case("aligned", 256, 256, 256),
    Case("unaligned", 100, 40, 72),
    Case("batched", 48, 16, 64, batch=2),
    Case("grouped", 1851, 48, 80, group_sizes=GROUPED_SIZES),
)
"""The shapes. Zero-padded to the recipe's 16, the contractions of the three GEMMs (K for Fprop,
N for Dgrad, M for Wgrad) include 16, 48, 80 and 112: the sizes that are 16 mod 32, which GPU
block-scaled GEMMs reading 32 FP4 codes per aligned row cannot take unpadded (the xla backend
pads them to 32 on a GPU, TE to `te_alignment`). The grouped case is a Mixture-of-Experts layer
of 128 experts (`GROUPED_SIZES`) with 22 padding rows; its Wgrad contracts 16 to 208 padded
tokens per expert."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One comparison: `statistic` (max |diff| / bound, or mean z^2) against `limit`."""

    backend: str
    case: str
    recipe: str
    quantity: str
    statistic: float
    limit: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.statistic) and self.statistic <= self.limit)


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """The checks of one backend, the cases it cannot run, steps per second, and the error it
    raised if it crashed while verified (then the checks stop there)."""

    backend: str
    checks: tuple[Check, ...]
    not_applicable: tuple[str, ...]
    steps_per_second: dict[str, float]
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(c.ok for c in self.checks)

    @property
    def summary(self) -> str:
        """One line: agrees, disagrees (how many checks), or crashed (the error)."""
        if self.error is not None:
            return f"crashed while verified: {self.error}"
        failed = [c for c in self.checks if not c.ok]
        if not failed:
            return f"agrees with 'emulated' on {len(self.checks)} checks"
        where = ", ".join(f"{c.case} {c.recipe} {c.quantity}" for c in failed[:4])
        more = f" and {len(failed) - 4} more" if len(failed) > 4 else ""
        return (
            f"disagrees with 'emulated' on {len(failed)} of {len(self.checks)} checks "
            f"({where}{more})"
        )

    def table(self) -> str:
        """The checks as an aligned text table."""
        rows = [f"{'case':10s} {'recipe':12s} {'out':4s} {'statistic':>10s} {'limit':>6s}  result"]
        for c in self.checks:
            verdict = "ok" if c.ok else "DISAGREES"
            rows.append(
                f"{c.case:10s} {c.recipe:12s} {c.quantity:4s} {c.statistic:10.3g} "
                f"{c.limit:6.3g}  {verdict} {c.note}".rstrip()
            )
        rows += [f"{name}: not applicable" for name in self.not_applicable]
        if self.error is not None:
            rows.append(f"CRASHED: {self.error}")
        if self.steps_per_second:
            speed = ", ".join(f"{k} {v:.1f}/s" for k, v in self.steps_per_second.items())
            rows.append(f"forward+backward of the aligned case: {speed}")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "ok": self.ok,
            "error": self.error,
            "checks": [{**dataclasses.asdict(c), "ok": c.ok} for c in self.checks],
            "not_applicable": list(self.not_applicable),
            "steps_per_second": self.steps_per_second,
        }


def _operands(case: Case, seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x_shape, w_shape, dy_shape = case.shapes()
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, w_shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = (jax.random.normal(kd, dy_shape, jnp.float32) * 0.01).astype(jnp.float32)
    return x, w, dy


@functools.cache
def _runner(case: Case, recipe: str, backend: str):
    """The jitted forward + backward of one case through one backend, compiled once per process
    (the emulated reference is shared by every backend verified here)."""
    dims = case.dimension_numbers()
    sizes = np.asarray(case.group_sizes, np.int32)

    @jax.jit
    def run(x, w, dy, key):
        def f(a, b):
            if case.group_sizes:
                return ragged_dot(
                    a, b, jnp.asarray(sizes), recipe=recipe, key=key, backend=backend,
                    preferred_element_type=jnp.float32,
                )  # fmt: skip
            return dot_general(
                a, b, dims, preferred_element_type=jnp.float32, recipe=recipe, key=key,
                backend=backend,
            )  # fmt: skip

        y, pullback = jax.vjp(f, x, w)
        return (y, *pullback(dy))

    return run


def _magnitudes(case: Case, x, w, dy) -> dict[str, np.ndarray]:
    """|x| @ |w| and its two backward counterparts, float64 (the scale of each result), per
    group for a grouped case."""
    ax, aw, ady = (np.abs(np.asarray(v, np.float64)) for v in (x, w, dy))
    swap = lambda a: np.swapaxes(a, -1, -2)  # noqa: E731
    if not case.group_sizes:
        return {"y": ax @ aw, "dx": ady @ swap(aw), "dw": swap(ax) @ ady}
    out = {"y": np.zeros_like(ady), "dx": np.zeros_like(ax), "dw": np.zeros_like(aw)}
    for e, rows in enumerate(case.groups()):
        out["y"][rows] = ax[rows] @ aw[e]
        out["dx"][rows] = ady[rows] @ aw[e].T
        out["dw"][e] = ax[rows].T @ ady[rows]
    return out


def _bound_ratio(got, want, scale, k: int, bf16: bool) -> float:
    """max |got - want| / bound (see the module docstring); <= 1 passes."""
    bound = ((2 * k + 8) * U + TENSOR_CORE_GROUPS) * 4 * scale + 1e-30
    if bf16:
        bound = bound + BF16_ROUNDING * (np.abs(got) + np.abs(want))
    return float(np.max(np.abs(got - want) / bound))


def _z2(draws_a: np.ndarray, draws_b: np.ndarray) -> float:
    n = draws_a.shape[0]
    noise = draws_a.var(axis=0, ddof=1) / n + draws_b.var(axis=0, ddof=1) / n
    z2 = (draws_a.mean(axis=0) - draws_b.mean(axis=0)) ** 2 / np.maximum(noise, 1e-300)
    live = noise > 0
    return float(np.mean(z2[live])) if live.any() else float(np.max(z2))


def _compare(backend: str, case: Case, recipe: str, draws: int, seed: int) -> list[Check]:
    x, w, dy = _operands(case, seed)
    keys = jax.random.split(jax.random.key(seed + 1), draws)
    ours, ref = _runner(case, recipe, backend), _runner(case, recipe, "emulated")
    got = [[np.asarray(v, np.float64) for v in ours(x, w, dy, k)] for k in keys]
    want = [[np.asarray(v, np.float64) for v in ref(x, w, dy, k)] for k in keys]
    scale = _magnitudes(case, x, w, dy)
    contraction = case.contractions()
    stochastic = get_recipe(recipe).needs_key
    checks = []
    for i, quantity in enumerate(("y", "dx", "dw")):
        if stochastic and quantity != "y":
            a = np.stack([g[i] for g in got])
            b = np.stack([r[i] for r in want])
            stat, limit, note = _z2(a, b), Z2_LIMIT, f"mean z^2 over {draws} draws"
        else:
            stat = _bound_ratio(
                got[0][i], want[0][i], scale[quantity], contraction[quantity], quantity != "y"
            )
            limit, note = 1.0, "max |diff| / bound"
        checks.append(Check(backend, case.name, recipe, quantity, stat, limit, note))
    return checks


def _speed(backend: str, case: Case, repeats: int = 5) -> float:
    x, w, dy = _operands(case, 0)
    run = _runner(case, "nvfp4", backend)
    key = jax.random.key(0)
    jax.block_until_ready(run(x, w, dy, key))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(x, w, dy, key))
        times.append(time.perf_counter() - t0)
    return 1.0 / float(np.median(times))


def _short(err: BaseException, limit: int = 400) -> str:
    """`Type: first line of the message`, at most `limit` characters (XLA errors run to pages)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = f"{type(err).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def verify_backend(
    backend: str,
    *,
    recipes: tuple[str, ...] = RECIPES,
    battery: tuple[Case, ...] = BATTERY,
    draws: int = 8,
    seed: int = 0,
    measure_speed: bool = True,
) -> VerifyReport:
    """`backend` against "emulated" on the battery (see the module docstring).

    An exception raised by the backend while it runs the battery (a compile error, a missing
    kernel, a failure at run time) does not propagate: the report carries it as `error` and is
    not ok. Either way the outcome is recorded for "auto" (`backends.record_verification`).

    Args:
      backend: "xla" or "te" (or "emulated", which then agrees with itself).
      recipes: preset names to check; stochastic ones are compared statistically.
      battery: the cases.
      draws: stochastic-rounding keys per stochastic recipe.
      seed: seeds the operands and keys.
      measure_speed: also time forward + backward of the first case on both backends.

    Raises:
      ValueError: `backend` is unknown or not available here.

    Example:
      >>> verify_backend("xla", recipes=("nvfp4-no-sr",)).ok  # doctest: +SKIP
      True
    """
    reason = unsupported(backend, Call(get_recipe(recipes[0])))
    if reason is not None and reason.startswith("not available"):
        raise ValueError(f"backend={backend!r} is {reason}")
    checks, skipped, speed, error, where = [], [], {}, None, ""
    try:
        for case in battery:
            for recipe in recipes:
                call = Call(get_recipe(recipe), max(case.batch, 1), np.dtype(jnp.bfloat16),
                            np.dtype(jnp.float32), grouped=bool(case.group_sizes))  # fmt: skip
                why = unsupported(backend, call)
                if why is not None:
                    skipped.append(f"{case.name} {recipe} ({why})")
                    continue
                where = f"{case.name} {recipe}"
                n = draws if get_recipe(recipe).needs_key else 1
                checks += _compare(backend, case, recipe, n, seed)
        if measure_speed:
            where = "timing"
            speed = {
                name: _speed(name, battery[0]) for name in dict.fromkeys((backend, "emulated"))
            }
    except Exception as err:  # noqa: BLE001 - a crash means "not used", reported with its error
        error = f"{_short(err)} (in {where})" if where else _short(err)
    report = VerifyReport(backend, tuple(checks), tuple(skipped), speed, error)
    record_verification(backend, report.ok, report.summary)
    return report
