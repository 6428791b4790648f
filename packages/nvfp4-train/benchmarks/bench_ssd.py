"""Mamba-2 SSD scan (JAX) against transformers' PyTorch `mamba2_chunk_scan` and chunked attention.

Forward + backward of, per length L (batch 1, float32, random inputs):
- `ssd`: `nvfp4_train.model.blocks.ssd.ssd_scan` (H heads of P, state N, G groups, chunk Q),
  `jax.grad` of sum(y * w) w.r.t. x, dt, A, B, C, jitted;
- `attention`: `nvfp4_train.model.blocks.chunked_attention.chunked_attention` with H query and
  H key/value heads of P (tile `--block`), grad w.r.t. q, k, v, jitted: what a causal attention
  layer of the same width costs;
- `torch`: `transformers.models.nemotron_h.modeling_nemotron_h.mamba2_chunk_scan` (its PyTorch
  path), same shapes and chunk, `loss.backward()` with `torch.set_num_threads(--threads)` and
  `OMP_WAIT_POLICY=--omp-wait-policy` (PASSIVE: on a machine shared with other jobs, OpenMP's
  default spin-waiting made 2-thread steps 3-20x slower than 1-thread ones here, which would
  flatter JAX).

Each (variant, L) runs in its own child process: after the compile (JAX) the process's peak
resident set is reset (`/proc/self/clear_refs`), one warm-up step runs, and the growth of the peak
RSS over the RSS before it is reported ("peak RSS MiB": what the step allocated at its high point,
inputs excluded, the same measure for all three). For JAX also XLA's compiled
`memory_analysis()` temp + argument bytes. Time: median (and min) of `--repeats` steps after the
warm-up, in interleaved rounds (each variant of a length once per round, so machine load hits all
alike; `block_until_ready` for JAX, torch is synchronous on a CPU), in wall-clock time and in the
process's CPU time over the step (all threads: less sensitive to other jobs, but it counts
spinning threads too). Prints a table, writes JSON and Markdown.

    python packages/nvfp4-train/benchmarks/bench_ssd.py \\
        --out docs/benchmarks/ssd.json --md docs/benchmarks/ssd.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
VARIANTS = ("ssd", "attention", "torch")
SHAPE_FLAGS = ("heads", "head_dim", "state", "groups", "chunk", "block", "threads")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_rss_growth_mib(step) -> float:
    """Growth of the peak resident set during `step()` over the resident set before it, MiB."""
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) / 1024


def _numpy_inputs(args, length: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)
    h, p, n, g = args.heads, args.head_dim, args.state, args.groups
    f32 = np.float32
    return {
        "x": rng.standard_normal((1, length, h, p)).astype(f32),
        "dt": np.exp(rng.uniform(np.log(1e-3), np.log(0.1), (1, length, h))).astype(f32),
        "A": -np.exp(rng.uniform(0.0, np.log(16.0), h)).astype(f32),
        "B": rng.standard_normal((1, length, g, n)).astype(f32),
        "C": rng.standard_normal((1, length, g, n)).astype(f32),
        "w": rng.standard_normal((1, length, h, p)).astype(f32),
    }


def _jax_step(args, variant: str, length: int):
    """(step, compiled-memory info) of the jitted forward + backward of one JAX variant."""
    import jax
    import jax.numpy as jnp

    from nvfp4_train.model.blocks.chunked_attention import chunked_attention
    from nvfp4_train.model.blocks.ssd import ssd_scan

    arrays = {k: jnp.asarray(v) for k, v in _numpy_inputs(args, length).items()}
    if variant == "ssd":
        inputs = tuple(arrays[k] for k in ("w", "x", "dt", "A", "B", "C"))

        def loss(w, *xs):
            return jnp.sum(ssd_scan(*xs, chunk_size=args.chunk) * w)
    else:
        x = arrays["x"]
        inputs = (arrays["w"], x, jnp.roll(x, 1, axis=-1), jnp.roll(x, 2, axis=-1))

        def loss(w, *qkv):
            return jnp.sum(chunked_attention(*qkv, None, args.block) * w)

    t0 = time.perf_counter()
    grad = jax.grad(loss, argnums=tuple(range(1, len(inputs))))  # w: an argument, not a constant
    compiled = jax.jit(grad).lower(*inputs).compile()
    memory = compiled.memory_analysis()
    info = {"compile_s": time.perf_counter() - t0,
            "temp_mib": memory.temp_size_in_bytes / MIB,
            "argument_mib": memory.argument_size_in_bytes / MIB}  # fmt: skip
    return (lambda: jax.block_until_ready(compiled(*inputs))), info


def _torch_step(args, length: int):
    import torch
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    torch.set_num_threads(args.threads)
    arrays = {k: torch.from_numpy(v) for k, v in _numpy_inputs(args, length).items()}
    w = arrays.pop("w")
    inputs = [arrays[k].requires_grad_() for k in ("x", "dt", "A", "B", "C")]

    def step():
        for t in inputs:
            t.grad = None
        y = mamba2_chunk_scan(*inputs, chunk_size=args.chunk)
        (y * w).sum().backward()

    return step, {}


def worker(args) -> None:
    """One (variant, length) in this process: prints its set-up row (compile, memory of a warm-up
    step) as a JSON line, then answers each "step" line on stdin with one step's wall and CPU
    seconds."""
    variant, length = args.worker, args.length
    step, info = (
        _torch_step(args, length) if variant == "torch" else _jax_step(args, variant, length)
    )
    info = {
        "variant": variant,
        "seq_len": length,
        **info,
        "peak_rss_mib": _peak_rss_growth_mib(step),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        cpu, wall = time.process_time(), time.perf_counter()
        step()
        print(time.perf_counter() - wall, time.process_time() - cpu, flush=True)


def _start_child(args, variant: str, length: int) -> tuple[subprocess.Popen, dict]:
    command = [sys.executable, __file__, "--worker", variant, "--length", str(length),
               *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SHAPE_FLAGS)]  # fmt: skip
    env = {**os.environ, "OMP_WAIT_POLICY": args.omp_wait_policy} if variant == "torch" else None
    child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, bufsize=1, env=env)  # fmt: skip
    line = child.stdout.readline()
    if not line:
        tail = child.stderr.read().strip().splitlines()[-1:] or [f"exit {child.wait()}"]
        return child, {"variant": variant, "seq_len": length, "error": tail[0][:200]}
    return child, json.loads(line)


def _step_s(child: subprocess.Popen) -> tuple[float, float]:
    """(wall, CPU) seconds of one step of `child`."""
    child.stdin.write("step\n")
    wall, cpu = child.stdout.readline().split()
    return float(wall), float(cpu)


def measure_length(args, length: int) -> list[dict]:
    """The variants at one length: set up one child each, then `--repeats` interleaved rounds
    (every variant once per round, so machine load hits all alike)."""
    children, rows = [], []
    for variant in args.variants:
        child, row = _start_child(args, variant, length)
        children.append(child)
        rows.append(row)
    times = [[] for _ in rows]
    for _ in range(args.repeats):
        for child, row, ts in zip(children, rows, times, strict=True):
            if "error" not in row:
                ts.append(_step_s(child))
    for child, row, ts in zip(children, rows, times, strict=True):
        if ts:
            walls, cpus = zip(*ts, strict=True)
            row.update(ms=statistics.median(walls) * 1e3, min_ms=min(walls) * 1e3,
                       cpu_ms=statistics.median(cpus) * 1e3)  # fmt: skip
        child.stdin.close()
        child.wait()
    return rows


def _ok(row: dict | None) -> bool:
    return row is not None and "error" not in row


def _cell(row: dict | None, text) -> str:
    """`text(row)`, or why there is no number."""
    if row is None:
        return "not run"
    return f"failed: {row['error']}" if "error" in row else text(row)


def _ratio(num: dict | None, den: dict | None, key: str) -> str:
    return f"{num[key] / den[key]:.1f}x" if _ok(num) and _ok(den) else "n/a"


def _table(rows: list[dict]) -> str:
    by = {(r["variant"], r["seq_len"]): r for r in rows}
    lines = [
        "| L | ssd ms (CPU ms) | torch ms (CPU ms) | torch / ssd wall | torch / ssd CPU "
        "| attention ms (CPU ms) | peak RSS MiB ssd / torch / attention "
        "| XLA temp+arg MiB ssd / attention |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length in sorted({r["seq_len"] for r in rows}):
        ssd, att, torch = (by.get((v, length)) for v in VARIANTS)
        times = [
            _cell(r, lambda r: f"{r['ms']:.1f} ({r['cpu_ms']:.0f})") for r in (ssd, torch, att)
        ]
        rss = " / ".join(_cell(r, lambda r: f"{r['peak_rss_mib']:.0f}") for r in (ssd, torch, att))
        xla = " / ".join(
            _cell(r, lambda r: f"{(r['temp_mib'] + r['argument_mib']):.1f}") for r in (ssd, att)
        )
        lines.append(
            f"| {length} | {times[0]} | {times[1]} | {_ratio(torch, ssd, 'ms')} | "
            f"{_ratio(torch, ssd, 'cpu_ms')} | {times[2]} | {rss} | {xla} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=128, help="SSD chunk (both scans)")
    parser.add_argument("--block", type=int, default=512, help="chunked attention tile")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY for torch")
    parser.add_argument("--out", default="docs/benchmarks/ssd.json")
    parser.add_argument("--md", default=None, help="also write the table as Markdown here")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    return parser


def _machine() -> dict:
    import jax

    try:
        import torch
        import transformers

        versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    except ImportError:
        versions = {}
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend(), "load_average": os.getloadavg(), **versions}  # fmt: skip


def _markdown(args, info: dict, table: str) -> str:
    m = info["machine"]
    return (
        "# Mamba-2 SSD scan: JAX `ssd_scan` against transformers' PyTorch path and chunked "
        "attention\n\n"
        f"Forward + backward (gradients of sum(y * w) w.r.t. every input), batch 1, float32, "
        f"H={args.heads} heads of P={args.head_dim}, state N={args.state}, G={args.groups} "
        f"group, chunk {args.chunk}; attention: `chunked_attention` with {args.heads} query and "
        f"key/value heads of {args.head_dim}, tile {args.block}, no documents. Machine: "
        f"{m['platform']}, {m['cpus']} CPUs (shared with other jobs; load average at the end "
        f"{m['load_average'][0]:.1f}), jax {m['jax']} on {m['backend']}, torch "
        f"{m.get('torch', '?')} ({args.threads} threads), transformers "
        f"{m.get('transformers', '?')}.\n\n"
        f"- ms: median wall time of {args.repeats} steps after a warm-up step, each variant and "
        "length in its own process, interleaved round by round (jitted and `block_until_ready` "
        "for JAX); CPU ms: the median of the process's CPU time over the step, all threads "
        "(steadier on a shared machine; counts spinning threads too). torch runs with "
        f"OMP_WAIT_POLICY={args.omp_wait_policy}.\n"
        "- peak RSS MiB: growth of the process's peak resident memory during the warm-up step "
        "over the resident memory before it (`/proc/self/clear_refs` resets the peak after "
        "inputs and compilation): the same measure for JAX and PyTorch, allocator effects "
        "included.\n"
        "- XLA temp+arg MiB: the compiled program's `memory_analysis()` temporary plus argument "
        "bytes.\n\n"
        "Regenerate with `python packages/nvfp4-train/benchmarks/bench_ssd.py --out "
        "docs/benchmarks/ssd.json --md docs/benchmarks/ssd.md` (`--lengths`, `--repeats` "
        f"to shorten).\n\n{table}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    rows = []
    for length in args.lengths:
        rows += measure_length(args, length)
        for row in rows[-len(args.variants) :]:
            print(json.dumps(row), flush=True)
    table = _table(rows)
    print(table)
    info = {"shapes": {k: getattr(args, k) for k in SHAPE_FLAGS}, "repeats": args.repeats,
            "machine": _machine(), "rows": rows}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(_markdown(args, info, table))
    print(f"wrote {args.out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
