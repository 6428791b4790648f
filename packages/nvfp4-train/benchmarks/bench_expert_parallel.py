"""What a train step of an MoE model communicates under expert parallelism, by dispatch design.

The train step of a small NVFP4 MoE model (`--layers` blocks, `--experts` experts of
`--expert-mlp` units, top-`--top-k`, d_model `--d-model`, `--batch` x `--seq` tokens) is compiled
on 8 fake CPU devices (one child process per variant, `mesh.data=2 mesh.expert=4` by default)
and its compiled HLO is read for every collective (all-gather, all-reduce, reduce-scatter,
all-to-all, collective-permute): how many, and the bytes of the buffer each moves per device
(the gathered result of an all-gather, the input of a reduce-scatter, the operand of an
all-reduce), counted as executed: a collective inside a while loop times the loop's known trip
count, a conditional by its costliest branch (an upper bound). Two dispatch designs:

- `gspmd`: the global dispatch of one device (sort all assignments by expert, one grouped GEMM
  over all experts), partitioned by XLA's SPMD partitioner under the same parameter and batch
  shardings (the expert-parallel path switched off: `model.moe.expert_mesh` patched to None);
- `shard_map`: `nvfp4_train.model.moe.expert_parallel`, the run's path: all-gather the tokens,
  each device runs its experts, reduce-scatter the outputs.

Also reported: whether a full expert kernel ([E, d, 2F] or [E, F, d]) is all-gathered (then
every device holds every expert: no expert parallelism), the step-1 loss and whether the
updated parameters of the two designs are equal bit for bit, and the compile time. XLA:CPU runs
BF16 collectives in float32, so a BF16 buffer counts 4 bytes per element here (2 on GPUs).

    python packages/nvfp4-train/benchmarks/bench_expert_parallel.py \\
        --md docs/benchmarks/moe_expert_parallel.md --out docs/benchmarks/moe_expert_parallel.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hlo_collectives import (  # noqa: E402
    COLLECTIVES,
    KINDS,
    _callees,
    distinct,
    executed_collectives,
    parse_hlo,
)

__all__ = ["_callees", "parse_hlo"]  # bench_comms.py reads HLO with them


def measure(args) -> dict:
    """One variant, in this process: compile the train step, read its HLO, run one step (the
    `native` variant: its HLO from XLA's dump, compiling fails on CPU, no step)."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.mesh.sharding import batch_sharding, make_mesh, tree_shardings
    from nvfp4_train.training.resume import initial_state, run_train_step

    cfg = config_from_dict(_config(args))
    graphdef, state = initial_state(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh = make_mesh(cfg.mesh, jax.devices())
    state_sh = tree_shardings(state, state.params, mesh)
    batch_sh = batch_sharding(mesh, args.batch)
    state, batch = jax.device_put(state, state_sh), jax.device_put(batch, batch_sh)
    step = jax.jit(run_train_step(cfg, graphdef, mesh=mesh), in_shardings=(state_sh, batch_sh),
                   out_shardings=(state_sh, NamedSharding(mesh, P())))  # fmt: skip
    t0 = time.perf_counter()
    with _patched(args.variant):
        try:
            compiled, text = step.lower(state, batch).compile(), None
        except jax.errors.JaxRuntimeError as e:  # XLA:CPU has no ragged all-to-all
            if args.variant != NATIVE or "ragged-all-to-all" not in str(e):
                raise
            compiled, text = None, _dumped_hlo(args.dump)
    compile_s = time.perf_counter() - t0
    loss = params = None
    if compiled is not None:
        text = compiled.as_text()
        new_state, metrics = compiled(state, batch)
        loss, params = float(metrics["loss"]), _digest(new_state.params)
    d, f, e = args.d_model, args.expert_mlp, args.experts
    summary, listing = executed_collectives(text, {(e, d, 2 * f), (e, f, d)}, args.devices)
    return {
        "variant": args.variant, "experts": e, "top_k": args.top_k, "mesh": dict(mesh.shape),
        "compile_s": round(compile_s, 1), "loss": loss, "params_sha256": params,
        "collectives": summary, "total_bytes": sum(summary[k]["bytes"] for k in COLLECTIVES),
        "total_ring_bytes": sum(summary[k]["ring_bytes"] for k in COLLECTIVES),
        "largest": distinct(listing)[: args.largest],
    }  # fmt: skip


NATIVE = "all_to_all_native"
"""The all-to-all design with `jax.lax.ragged_all_to_all` itself in place of its CPU emulation:
the program a GPU compiles, read from XLA:CPU's optimized-HLO dump (its thunks fail)."""
VARIANTS = ("gspmd", "all_gather", "all_to_all", NATIVE)


def _patched(variant: str):
    """`gspmd`: the expert-parallel path off (`expert_mesh` None); `NATIVE`: the exchange's
    `ragged_all_to_all` the primitive on every platform; else nothing."""
    import unittest.mock

    import jax

    from nvfp4_train.model.moe import all_to_all_exchange, layer

    def native(*args, axis_name, chunk_rows):
        del chunk_rows
        return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)

    if variant == "gspmd":
        return unittest.mock.patch.object(layer, "expert_mesh", lambda: None)
    if variant == NATIVE:
        return unittest.mock.patch.object(all_to_all_exchange, "ragged_all_to_all", native)
    return contextlib.nullcontext()


def _dumped_hlo(folder: str) -> str:
    """The largest optimized module of XLA's dump in `folder` (the train step)."""
    dumps = sorted(
        Path(folder).glob("*cpu_after_optimizations.txt"), key=lambda p: p.stat().st_size
    )
    return dumps[-1].read_text()


def _digest(tree) -> str:
    import hashlib

    import jax
    import numpy as np

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        digest.update(np.asarray(leaf).tobytes())
    return digest.hexdigest()


def _config(args) -> dict:
    dispatch = "all_gather" if args.variant in ("gspmd", "all_gather") else "all_to_all"
    return {
        "output_dir": "/tmp/unused",
        "model": {"vocab_size": args.vocab, "d_model": args.d_model, "num_layers": args.layers,
                  "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 4 * args.d_model,
                  "max_seq_len": args.seq, "scan_layers": False,
                  "moe": {"num_experts": args.experts, "experts_per_token": args.top_k,
                          "expert_mlp_dim": args.expert_mlp, "dispatch": dispatch}},
        "precision": {"recipe": "nvfp4"},
        "train": {"steps": 10, "batch_size": args.batch, "seq_len": args.seq},
        "mesh": {"data": args.data, "fsdp": args.fsdp, "expert": args.expert},
    }  # fmt: skip


def _child(args, variant: str, experts: int, top_k: int) -> dict:
    """One variant of `experts` experts, top-`top_k`, measured in a child process."""
    flags = f"--xla_force_host_platform_device_count={args.devices}"
    with tempfile.TemporaryDirectory() as dump:
        if variant == NATIVE:
            flags += f" --xla_dump_to={dump} --xla_dump_hlo_as_text"
        env = {**os.environ, "XLA_FLAGS": flags,
               "JAX_ENABLE_COMPILATION_CACHE": "false"}  # compile times as measured  # fmt: skip
        options = {k: v for k, v in vars(args).items() if k not in ("child", "out", "md")}
        options |= {"variant": variant, "experts": experts, "top_k": top_k, "dump": dump}
        command = [sys.executable, __file__, "--child"]
        command += [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    print(f"measured {variant}, {experts} experts, top-{top_k}", file=sys.stderr)
    return json.loads(done.stdout.splitlines()[-1])


def _all_to_all(emulated: dict, native: dict, gather: dict) -> dict:
    """The all-to-all design's row: the collectives of the native program, the loss and the
    parameters of the emulated one (whose own collectives stay as `cpu_emulation`)."""
    row = {**native, "variant": "all_to_all", "loss": emulated["loss"],
           "params_sha256": emulated["params_sha256"]}  # fmt: skip
    row["params_equal_all_gather"] = emulated["params_sha256"] == gather["params_sha256"]
    row["cpu_emulation"] = {k: emulated[k] for k in ("collectives", "total_bytes", "compile_s")}
    return row


def _jax_version() -> str:
    import jax

    return jax.__version__


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: list[dict], label=lambda r: r["variant"]) -> str:
    """The Markdown table: per design, ops / buffer MiB of each collective kind (as executed),
    the totals, the ring traffic per device, the step-1 loss, whether the updated parameters
    equal the all-gather design's bit for bit, and the compile time."""
    rows = ["| design | " + " | ".join(f"{k} (ops / MiB)" for k in KINDS)
            + " | total MiB | sent per device, ring (MiB) | step-1 loss | params == all_gather"
            " | compile s |", "|---" * (len(KINDS) + 6) + "|"]  # fmt: skip
    for r in results:
        cells = [f"{r['collectives'][k]['ops']} / {_mib(r['collectives'][k]['bytes'])}"
                 for k in KINDS]  # fmt: skip
        same = {True: "yes", False: "no"}.get(r.get("params_equal_all_gather"), "")
        rows.append(f"| {label(r)} | " + " | ".join(cells) + f" | {_mib(r['total_bytes'])} | "
                    f"{_mib(r['total_ring_bytes'])} | {r['loss']:.7f} | {same} | "
                    f"{r['compile_s']} |")  # fmt: skip
    return "\n".join(rows)


INTRO = (
    "Collectives of the compiled HLO as executed (loops times their trip counts, a conditional "
    "by its costliest branch); MiB: the buffers (an all-gather's result, a reduce-scatter's "
    "input, an all-reduce's operand; a ragged all-to-all's rows each device sends on average: "
    "dropless, each of the T k assignment rows crosses once per exchange, T_l k rows per device, "
    "its static receive buffer being larger); sent per device: what ring algorithms send, (n - "
    "1) / n of each buffer over groups of n (twice for an all-reduce; for an all-to-all what "
    "goes to the other devices when the rows spread evenly). XLA:CPU runs BF16 collectives in "
    "float32 (4 bytes per element here, 2 on GPUs). XLA:CPU has no ragged all-to-all: "
    "`all_to_all`'s collectives are those of the program with `jax.lax.ragged_all_to_all` (what "
    "a GPU compiles), read from XLA's dump of the optimized HLO before XLA:CPU fails to emit "
    "it; its loss, parameters and compile time are those of the same step with the CPU "
    "emulation (`nvfp4_train.model.moe.ragged_all_to_all`), run. Regenerate with `python "
    "packages/nvfp4-train/benchmarks/bench_expert_parallel.py --md docs/benchmarks/"
    "moe_expert_parallel.md --out docs/benchmarks/moe_expert_parallel.json`. Why the run uses a "
    "`shard_map`, and which exchange: [docs/distributed.md](../distributed.md#expert-parallelism-"
    "meshexpert)."
)


def markdown(payload: dict) -> str:
    """The benchmark page: setup, the table, the sweep, the largest collectives of each design."""
    setup, results = payload["setup"], payload["results"]
    mesh = " x ".join(f"{a}={setup[a]}" for a in ("data", "fsdp", "expert") if setup[a] > 1)
    lines = [
        "# Expert parallelism: what a train step communicates, by dispatch design", "",
        f"Train step of an NVFP4 MoE model ({setup['layers']} blocks, d_model "
        f"{setup['d_model']}, {setup['experts']} experts of {setup['expert_mlp']} units, top-"
        f"{setup['top_k']}, batch {setup['batch']} x {setup['seq']} tokens) on {setup['devices']} "
        f"fake CPU devices, {mesh}; jax {payload.get('jax', '?')}. " + INTRO, "",
        table(results), "",
        "The two `shard_map` exchanges by experts and top-k (the same model and mesh):", "",
        table(payload["sweep"], lambda r: f"{r['experts']} experts, top-{r['top_k']}: "
              f"{r['variant']}"), "",
    ]  # fmt: skip
    for r in results:
        lines += [f"Largest collectives of `{r['variant']}` (buffer MiB x runs per step; in the "
                  "HLO text that many times, each branch of a conditional holding one):", ""]  # fmt: skip
        lines += [f"- {c['op']} `{c['shape']}` over {c['group']} devices: {_mib(c['bytes'])} "
                  f"MiB x {c['runs']}; {c.get('in_text', 1)} in the text"
                  for c in distinct(r["largest"])]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def _designs(args, experts: int, top_k: int, gspmd: bool) -> list[dict]:
    """The rows of the designs for `experts` experts, top-`top_k`."""
    gather = _child(args, "all_gather", experts, top_k)
    emulated = _child(args, "all_to_all", experts, top_k)
    native = _child(args, NATIVE, experts, top_k)
    native["compile_s"] = emulated["compile_s"]
    rows = [gather, _all_to_all(emulated, native, gather)]
    return ([_child(args, "gspmd", experts, top_k)] if gspmd else []) + rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="all_to_all", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--dump", default="", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--expert", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--sweep", default="8:2,8:8,32:2,32:8",
                        help="experts:top-k pairs of the sweep table")  # fmt: skip
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--expert-mlp", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--largest", type=int, default=12, help="collectives listed per design")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--md", type=Path, help="write the table as Markdown")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    results = _designs(args, args.experts, args.top_k, gspmd=True)
    sweep = []
    for pair in args.sweep.split(","):
        experts, top_k = (int(v) for v in pair.split(":"))
        same = (experts, top_k) == (args.experts, args.top_k)
        sweep += results[1:] if same else _designs(args, experts, top_k, gspmd=False)
    print(table(results))
    print(table(sweep, lambda r: f"{r['experts']} experts, top-{r['top_k']}: {r['variant']}"))
    setup = {k: getattr(args, k) for k in ("devices", "data", "fsdp", "expert", "layers",
             "experts", "top_k", "d_model", "expert_mlp", "vocab", "batch", "seq")}  # fmt: skip
    payload = {"setup": setup, "jax": _jax_version(), "results": results, "sweep": sweep}
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(payload))


if __name__ == "__main__":
    main()
