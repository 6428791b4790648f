"""Step time of the grouped call (`nvfp4_ops.ragged_dot`) against a per-expert loop of dot_general.

For each shape (T rows, K, N, E experts, top-2-style uneven group sizes drawn once with a fixed
seed) and recipe ("nvfp4", "bf16"), the forward and both gradients (`jax.vjp`, jitted) of:
  * grouped: one `ragged_dot(x, w, group_sizes)` (group sizes a traced argument);
  * loop: `dot_general(x_g, w[e], key=fold_in(key, e))` per expert on static slices, which the
    grouped call equals bit for bit;
  * dense: one `dot_general` over all T rows with one expert's weight (what one GEMM of T rows
    costs: the target for the grouped call, which adds the per-group padding).
Times are the median (and minimum) of `--repeats` calls, the variants interleaved round by
round after a warm-up. Prints a table and writes JSON (default
docs/benchmarks/grouped_gemm.json). No timing is asserted anywhere.

  python packages/nvfp4-ops/benchmarks/bench_grouped.py [--repeats 7] [--backend emulated]
      [--shapes T,K,N,E ...] [--recipes nvfp4 bf16] [--variants grouped loop dense]
      [--label TEXT] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_ops

MATMUL = (((1,), (0,)), ((), ()))
SHAPES = ((2048, 256, 256, 8), (8192, 256, 256, 8), (4096, 256, 256, 32))
"""(T, K, N, E). T counts routed rows (top-2 of T/2 tokens)."""
RECIPES = ("nvfp4", "bf16")
VARIANTS = ("grouped", "loop", "dense")


def top2_group_sizes(tokens: int, experts: int, seed: int = 0) -> tuple[int, ...]:
    """Rows per expert of T/2 tokens routed to 2 distinct experts each, with skewed router
    probabilities (Dirichlet(1)): uneven, and a few experts nearly idle."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(experts))
    sizes = np.zeros(experts, np.int64)
    for _ in range(tokens // 2):
        sizes[rng.choice(experts, size=2, replace=False, p=p)] += 1
    return tuple(int(s) for s in sizes)


def _vjp(f, x, w, dy):
    y, pullback = jax.vjp(f, x, w)
    return (y, *pullback(dy))


def steps(recipe: str, sizes: tuple[int, ...], backend: str) -> dict:
    """{variant: (jitted step, extra args)} for one recipe and group sizes."""
    needs_key = nvfp4_ops.get_recipe(recipe).needs_key

    def key_or_none(key):
        return key if needs_key else None

    @jax.jit
    def grouped(x, w, group_sizes, key, dy):
        def f(a, b):
            return nvfp4_ops.ragged_dot(
                a, b, group_sizes, recipe=recipe, key=key_or_none(key), backend=backend
            )

        return _vjp(f, x, w, dy)

    @jax.jit
    def loop(x, w, key, dy):
        def f(a, b):
            outs, start = [], 0
            for e, g in enumerate(sizes):
                k = key_or_none(jax.random.fold_in(key, e))
                outs.append(nvfp4_ops.dot_general(
                    a[start : start + g], b[e], MATMUL, recipe=recipe, key=k, backend=backend
                ))  # fmt: skip
                start += g
            return jnp.concatenate([*outs, jnp.zeros((a.shape[0] - start, b.shape[2]), a.dtype)])

        return _vjp(f, x, w, dy)

    @jax.jit
    def dense(x, w, key, dy):
        def f(a, b):
            return nvfp4_ops.dot_general(
                a, b[0], MATMUL, recipe=recipe, key=key_or_none(key), backend=backend
            )

        return _vjp(f, x, w, dy)

    return {"grouped": grouped, "loop": loop, "dense": dense}


def bench(shape, recipe: str, repeats: int, backend: str, variants=VARIANTS) -> dict:
    tokens, k, n, experts = shape
    sizes = top2_group_sizes(tokens, experts)
    kx, kw, kd, key = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (tokens, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (experts, k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = (jax.random.normal(kd, (tokens, n), jnp.float32) * 0.01).astype(jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    fns = {v: f for v, f in steps(recipe, sizes, backend).items() if v in variants}
    args = {
        "grouped": (x, w, group_sizes, key, dy),
        "loop": (x, w, key, dy),
        "dense": (x, w, key, dy),
    }
    compile_s = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args[name]))  # compile + warm-up
        compile_s[name] = time.perf_counter() - t0
    times = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*args[name]))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    padded = sum(-(-g // 16) * 16 for g in sizes)
    return {
        "tokens": tokens, "k": k, "n": n, "experts": experts, "group_sizes": list(sizes),
        "padded_rows": padded, "recipe": recipe, "backend": backend, "repeats": repeats,
        "median_ms": {v: 1e3 * statistics.median(t) for v, t in times.items()},
        "min_ms": {v: 1e3 * min(t) for v, t in times.items()},
        "median_cpu_ms": {v: 1e3 * statistics.median(t) for v, t in cpu.items()},
        "first_call_s": compile_s,
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    """Wall-clock medians (ms) per variant, the process CPU time of the grouped call (all
    threads; steadier than wall time on a shared machine) and the ratios ("-": not run)."""
    head = (
        f"{'T':>5} {'K':>4} {'N':>4} {'E':>3} {'recipe':7} {'grouped ms':>11} {'cpu ms':>8} "
        f"{'loop ms':>9} {'dense ms':>9} {'loop/grouped':>13} {'grouped/dense':>14}"
    )
    lines = [head]
    nan = float("nan")
    for r in rows:
        m = {v: r["median_ms"].get(v, nan) for v in VARIANTS}
        lines.append(
            f"{r['tokens']:>5} {r['k']:>4} {r['n']:>4} {r['experts']:>3} {r['recipe']:7} "
            f"{m['grouped']:>11.1f} {r['median_cpu_ms'].get('grouped', nan):>8.1f} "
            f"{m['loop']:>9.1f} {m['dense']:>9.1f} "
            f"{m['loop'] / m['grouped']:>13.2f} {m['grouped'] / m['dense']:>14.2f}"
        )
    return "\n".join(lines).replace("nan", "  -")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--backend", default="emulated")
    p.add_argument("--shapes", nargs="*", help="T,K,N,E (default: the module's SHAPES)")
    p.add_argument("--recipes", nargs="*", default=list(RECIPES))
    p.add_argument("--label", default="", help="what code was measured (kept in the JSON)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--json", default="docs/benchmarks/grouped_gemm.json")
    args = p.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    rows, load_before = [], os.getloadavg()
    for shape in shapes:
        for recipe in args.recipes:
            rows.append(bench(shape, recipe, args.repeats, args.backend, tuple(args.variants)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print("\n" + table(rows))
    out = {
        "what": "forward + both gradients (jax.vjp, jitted), median of interleaved repeats",
        "label": args.label,
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1_5_15_before_after": [list(load_before), list(os.getloadavg())],
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
