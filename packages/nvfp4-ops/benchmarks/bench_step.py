"""Step time and memory of the quantized dot_general per recipe preset, against plain BF16.

Measures, in one run on the current JAX backend (CPU here):
  * `value_and_grad` of one dot_general (x[n, n] . w[n, n], gradients for both) and of a 2-layer
    MLP (x[T, D] -> D x H -> gelu -> H x D, gradients for the weights), for every preset of
    `nvfp4_ops.RECIPES`, for plain `jax.lax.dot_general` in BF16 (the baseline, ratio 1.0), and
    for qwix's NVFP4 quantized-training dot_general as a peer when qwix is installed;
  * step time as the median (and the minimum) of `--repeats` timed calls after a warm-up, the
    variants interleaved round after round, as ratios to the baseline of the same run;
  * compiled memory (`memory_analysis()`: temporaries + arguments + outputs) and the bytes the
    forward pass saves for the backward pass (the leaves of the `jax.vjp` closure);
  * where an emulated NVFP4 step spends its time: each component (quantize, random bits,
    Hadamard, dequantize, FP32 GEMM) timed alone at the GEMM shape.

Prints tables and writes JSON (default docs/benchmarks/ops_step.json).

  python packages/nvfp4-ops/benchmarks/bench_step.py [--gemm-size 2048] [--tokens 2048] ...
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

import nvfp4_format as nf
import nvfp4_ops
from nvfp4_ops.hadamard import hadamard_transform
from nvfp4_ops.quantizers import sr_uniform

MATMUL = (((1,), (0,)), ((), ()))
BASELINE = "lax-bf16"
PEER = "qwix-nvfp4"


def _lax_dot(x, w, key):
    del key
    return jax.lax.dot_general(x, w, MATMUL)


def _qwix_dot():
    """qwix's quantized-training dot_general with NVFP4 everywhere (1x16 tiles, SR grads)."""
    from qwix._src.core import dot_general_qt, stochastic_rounding

    def dot(x, w, key):
        k1, k2 = jax.random.split(key)
        cfg = dot_general_qt.DotGeneralQtConfig(
            lhs_qtype="nvfp4",
            rhs_qtype="nvfp4",
            tile_size=16,
            dlhs_grad_qtype="nvfp4",
            dlhs_tile_size=16,
            drhs_grad_qtype="nvfp4",
            drhs_tile_size=16,
            dlhs_stochastic_rounding_noise_fn=stochastic_rounding.get_noise_fn(
                "low_bit_uniform", k1
            ),
            drhs_stochastic_rounding_noise_fn=stochastic_rounding.get_noise_fn(
                "low_bit_uniform", k2
            ),
        )
        return dot_general_qt.dot_general_qt(x, w, MATMUL, cfg)

    return dot


def dots(backend: str) -> dict[str, Callable]:
    """name -> dot(x, w, key) for the baseline, every preset and the qwix peer if installed."""
    out = {BASELINE: _lax_dot}
    for name in nvfp4_ops.RECIPES:
        out[name] = functools.partial(_preset_dot, recipe=name, backend=backend)
    with contextlib.suppress(ImportError):
        out[PEER] = _qwix_dot()
    return out


def _preset_dot(x, w, key, *, recipe, backend):
    return nvfp4_ops.dot_general(x, w, MATMUL, recipe=recipe, key=key, backend=backend)


def gemm_step(dot):
    def loss(x, w, key):
        return (dot(x, w, key).astype(jnp.float32) ** 2).mean()

    return jax.value_and_grad(loss, argnums=(0, 1))


def mlp_step(dot):
    def loss(params, x, target, key):
        k1, k2 = jax.random.split(key)
        h = jax.nn.gelu(dot(x, params["w1"], k1))
        y = dot(h, params["w2"], k2)
        return ((y.astype(jnp.float32) - target) ** 2).mean()

    return jax.value_and_grad(loss)


def _time(f, args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return min(times)


def _memory(compiled) -> int:
    m = compiled.memory_analysis()
    if m is None:
        return -1
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def _residual_bytes(fwd, args) -> int:
    _, pullback = jax.vjp(fwd, *args)
    return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(pullback) if hasattr(leaf, "nbytes"))


def bench_workload(name, make_step, fwd_of, args, dots_by_name, repeats):
    """Compile every variant, then time them interleaved, round after round (load drifts)."""
    steps = {
        label: jax.jit(make_step(dot)).lower(*args).compile() for label, dot in dots_by_name.items()
    }
    rows = {}
    for label, step in steps.items():
        jax.block_until_ready(step(*args))
        rows[label] = {
            "peak_bytes": _memory(step),
            "saved_residual_bytes": _residual_bytes(fwd_of(dots_by_name[label]), args[:-1]),
            "times": [],
        }
    for _ in range(repeats):
        for label, step in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(*args))
            rows[label]["times"].append(time.perf_counter() - t0)
    base = rows[BASELINE]
    for label, r in rows.items():
        r["seconds"] = statistics.median(r["times"])
        r["min_seconds"] = min(r["times"])
        print(f"  {name:5s} {label:13s} {r['seconds'] * 1e3:9.1f} ms", flush=True)
    for r in rows.values():
        r["time_ratio"] = r["seconds"] / base["seconds"]
        r["min_time_ratio"] = r["min_seconds"] / base["min_seconds"]
        r["peak_ratio"] = r["peak_bytes"] / base["peak_bytes"]
        r["residual_ratio"] = r["saved_residual_bytes"] / base["saved_residual_bytes"]
    return rows


def components(n: int, repeats: int) -> dict[str, float]:
    """Seconds (minimum of `repeats`) per emulated-NVFP4 building block at an n x n operand."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (1, n, n), jnp.bfloat16)
    u = jax.random.uniform(key, (1, n, n))
    q = nf.quantize(x, (1, 16))
    a = nf.dequantize(q, jnp.float32)
    dims = (((2,), (2,)), ((0,), (0,)))
    parts = {
        "quantize_1x16_rne": (lambda x: nf.quantize(x, (1, 16)), (x,)),
        "quantize_16x16_rne": (lambda x: nf.quantize(x, (16, 16)), (x,)),
        "quantize_1x16_sr": (
            lambda x, u: nf.quantize(x, (1, 16), rounding="stochastic", uniform=u),
            (x, u),
        ),
        "random_bits_8bit": (lambda k: sr_uniform(k, (1, n, n)), (key,)),
        "random_uniform_f32": (lambda k: jax.random.uniform(k, (1, n, n)), (key,)),
        "hadamard_16": (lambda x: hadamard_transform(x), (x,)),
        "dequantize": (lambda q: nf.dequantize(q, jnp.float32), (q,)),
        "gemm_fp32": (
            lambda a: jax.lax.dot_general(
                a, a, dims, precision="highest", preferred_element_type=jnp.float32
            ),
            (a,),
        ),
        "gemm_bf16": (
            lambda a: jax.lax.dot_general(a, a, dims, preferred_element_type=jnp.float32),
            (a.astype(jnp.bfloat16),),
        ),
    }
    return {name: _time(jax.jit(f), args, repeats) for name, (f, args) in parts.items()}


def gemm_errors(n: int = 512) -> dict[str, dict[str, float]]:
    """Relative Frobenius error of Fprop, Dgrad and Wgrad against FP32, per preset (Gaussian data)."""
    kx, kw, kd = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (n, n))
    w = jax.random.normal(kw, (n, n)) / n**0.5
    dy = jax.random.normal(kd, (n, n))
    hi = jax.lax.Precision.HIGHEST
    exact = {
        "fprop": jnp.dot(x, w, precision=hi),
        "dgrad": jnp.dot(dy, w.T, precision=hi),
        "wgrad": jnp.dot(x.T, dy, precision=hi),
    }
    out = {}
    for name in nvfp4_ops.RECIPES:

        @jax.jit
        def run(x, w, dy, name=name):
            f = functools.partial(
                _preset_dot, recipe=name, backend="emulated", key=jax.random.key(2)
            )
            y, pullback = jax.vjp(f, x, w)
            return (y, *pullback(dy))

        got = dict(zip(("fprop", "dgrad", "wgrad"), run(x, w, dy), strict=True))
        out[name] = {
            g: float(jnp.linalg.norm(got[g] - exact[g]) / jnp.linalg.norm(exact[g])) for g in exact
        }
    return out


def _table(title, rows):
    print(f"\n{title}")
    print(
        f"{'recipe':14s} {'median ms':>9s} {'x bf16':>7s} {'min ms':>8s} {'x bf16':>7s} "
        f"{'peak MiB':>9s} {'x bf16':>7s} {'saved MiB':>9s} {'x bf16':>7s}"
    )
    for label, r in rows.items():
        print(
            f"{label:14s} {r['seconds'] * 1e3:9.1f} {r['time_ratio']:7.2f} "
            f"{r['min_seconds'] * 1e3:8.1f} {r['min_time_ratio']:7.2f} "
            f"{r['peak_bytes'] / 2**20:9.1f} {r['peak_ratio']:7.2f} "
            f"{r['saved_residual_bytes'] / 2**20:9.2f} {r['residual_ratio']:7.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="emulated")
    p.add_argument("--only", nargs="*", help="labels to run (the baseline always runs)")
    p.add_argument("--json", default="docs/benchmarks/ops_step.json")
    args = p.parse_args()
    dots_by_name = dots(args.backend)
    if args.only:
        dots_by_name = {k: v for k, v in dots_by_name.items() if k == BASELINE or k in args.only}
    key = jax.random.key(0)
    kx, kw, k1, k2, kt = jax.random.split(key, 5)
    n = args.gemm_size
    x = jax.random.normal(kx, (n, n), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, n)) / n**0.5).astype(jnp.bfloat16)
    gemm_fwd = lambda dot: lambda x, w: dot(x, w, key)  # noqa: E731
    print(f"jax {jax.__version__} on {jax.default_backend()}, {jax.device_count()} device(s)")
    gemm = bench_workload("gemm", gemm_step, gemm_fwd, (x, w, key), dots_by_name, args.repeats)
    t, d, h = args.tokens, args.d_model, args.d_hidden
    params = {
        "w1": (jax.random.normal(k1, (d, h)) / d**0.5).astype(jnp.bfloat16),
        "w2": (jax.random.normal(k2, (h, d)) / h**0.5).astype(jnp.bfloat16),
    }
    xm = jax.random.normal(kt, (t, d), jnp.bfloat16)
    target = jnp.zeros((t, d), jnp.float32)

    def mlp_fwd(dot):
        def fwd(params, x, target):
            del target
            return dot(jax.nn.gelu(dot(x, params["w1"], k1)), params["w2"], k2)

        return fwd

    mlp = bench_workload(
        "mlp", mlp_step, mlp_fwd, (params, xm, target, key), dots_by_name, args.repeats
    )
    comp = components(n, args.repeats)
    errors = gemm_errors()
    _table(f"value_and_grad of one dot_general {n}x{n}x{n}", gemm)
    _table(f"value_and_grad of a 2-layer MLP, tokens={t}, d={d}, hidden={h}", mlp)
    print(f"\nemulated NVFP4 building blocks at {n}x{n} (ms):")
    for name, s in comp.items():
        print(f"  {name:20s} {s * 1e3:8.1f}")
    print("\nrelative error vs FP32 (Frobenius, Gaussian 512^3):")
    for name, e in errors.items():
        print(
            f"  {name:13s} fprop {e['fprop']:.4f}  dgrad {e['dgrad']:.4f}  wgrad {e['wgrad']:.4f}"
        )
    result = {
        "jax": jax.__version__,
        "platform": jax.default_backend(),
        "machine": platform.processor() or platform.machine(),
        "backend": args.backend,
        "repeats": args.repeats,
        "gemm_size": n,
        "mlp": {"tokens": t, "d_model": d, "d_hidden": h},
        "gemm_step": gemm,
        "mlp_step": mlp,
        "components_seconds": comp,
        "relative_gemm_error": errors,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
