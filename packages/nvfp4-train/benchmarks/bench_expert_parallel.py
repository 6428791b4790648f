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
import collections
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
         "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * BYTES.get(dtype, 0)
    return total


def _group_size(ins: dict, shapes: dict[str, str], devices: int) -> int:
    """Devices in each replica group of a collective: from its operand and result sizes (an
    all-gather or reduce-scatter), else its replica groups (`{{0,1},{2,3}}`, or the mesh form
    `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, without the axis list: the first axis)."""
    operand = re.match(r"\s*%?([\w.\-]+)", ins["rest"])
    source = shapes.get(operand.group(1)) if operand else None
    if source and ins["op"].removesuffix("-start") in ("all-gather", "reduce-scatter"):
        a, b = _shape_bytes(ins["shape"]), _shape_bytes(source)
        return max(a, b) // max(min(a, b), 1)
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", ins["rest"])
    if listed:
        return len(listed.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(\{[^}]*\})?", ins["rest"])
    if mesh:
        sizes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        named = re.findall(r"'(\w+)'", mesh.group(2) or "") or [sizes[0][0]]
        return math.prod(int(dict(sizes)[a]) for a in named)
    return devices


def _dims(shape: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape)]


def parse_hlo(text: str) -> tuple[dict, str]:
    """({computation: [instruction dicts]}, the entry computation's name) of HLO text."""
    computations, entry, current = {}, "", None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = computations.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, opcode, rest = m.groups()
            current.append({"name": name, "shape": shape, "op": opcode, "rest": rest})
    return computations, entry


def _callees(ins: dict) -> tuple[str, list[str], int]:
    """(how the callees run: "loop", "branches" or "call", their names, the trip count)."""
    rest = ins["rest"]
    if ins["op"] == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest)
        trips = re.search(r'known_trip_count[^0-9]*"n":"(\d+)"', rest)
        return "loop", [body.group(1)] if body else [], int(trips.group(1)) if trips else 1
    if ins["op"] == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = listed.group(1).split(",") if listed else []
        names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)
        return "branches", [n.strip().lstrip("%") for n in names if n.strip()], 1
    if ins["op"] in ("call", "async-start"):
        callee = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)
        return "call", [callee.group(1)] if callee else [], 1
    return "", [], 1


EXPERT_GATHER = "all-gather of an expert kernel"
KINDS = (*COLLECTIVES, EXPERT_GATHER)


def executed_collectives(
    text: str, kernel_dims: set[tuple[int, ...]], devices: int
) -> tuple[dict, list[dict]]:
    """({kind: {"ops": executed count, "static": in the text, "bytes": executed buffer bytes,
    "ring_bytes": what each device sends with ring algorithms}}, every collective with its
    shape, group size and how often it runs (each branch of a conditional listed)) of compiled
    HLO text. The buffer of a collective: an all-gather's result, a reduce-scatter's input, an
    all-reduce's operand; ring bytes: (n - 1) / n of it (twice for an all-reduce) over groups of
    n. An all-gather whose result has one of `kernel_dims` also counts as `EXPERT_GATHER`."""
    computations, entry = parse_hlo(text)
    shapes = {i["name"]: i["shape"] for c in computations.values() for i in c}
    listing: list[dict] = []
    static = collections.Counter()

    def cost(name: str, times: int, seen: frozenset) -> tuple[collections.Counter, ...]:
        ops, nbytes = collections.Counter(), collections.Counter()
        for ins in computations.get(name, []):
            kind = ins["op"].removesuffix("-start")
            if kind in COLLECTIVES:
                n = _group_size(ins, shapes, devices)
                size = _shape_bytes(ins["shape"]) * (n if kind == "reduce-scatter" else 1)
                ring = size * (n - 1) / n * (2 if kind == "all-reduce" else 1)
                kinds = [kind]
                if kind == "all-gather" and set(_dims(ins["shape"])) & kernel_dims:
                    kinds.append(EXPERT_GATHER)
                for k in kinds:
                    ops[k] += 1
                    nbytes[k] += size
                    nbytes["ring " + k] += ring
                    static[k] += 1
                listing.append({"op": kind, "shape": ins["shape"], "bytes": size, "runs": times,
                                "group": n})  # fmt: skip
                continue
            how, callees, trips = _callees(ins)
            callees = [c for c in callees if c in computations and c not in seen]
            if not callees:
                continue
            inner = [cost(c, times * trips, seen | {c}) for c in callees]
            if how == "branches":  # the costliest branch
                inner = [max(inner, key=lambda oc: sum(oc[1][k] for k in COLLECTIVES))]
            for o, b in inner:
                ops.update({k: v * trips for k, v in o.items()})
                nbytes.update({k: v * trips for k, v in b.items()})
        return ops, nbytes

    ops, nbytes = cost(entry, 1, frozenset({entry}))
    summary = {k: {"ops": ops[k], "static": static[k], "bytes": nbytes[k],
                   "ring_bytes": round(nbytes["ring " + k])} for k in KINDS}  # fmt: skip
    return summary, listing


def measure(args) -> dict:
    """One variant, in this process: compile the train step, read its HLO, run one step."""
    import unittest.mock

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.mesh.sharding import batch_sharding, make_mesh, tree_shardings
    from nvfp4_train.model.moe import layer as moe
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
    patch = unittest.mock.patch.object(moe, "expert_mesh", lambda: None)
    with patch if args.variant == "gspmd" else contextlib.nullcontext():
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
    _, metrics = compiled(state, batch)
    d, f, e = args.d_model, args.expert_mlp, args.experts
    summary, listing = executed_collectives(
        compiled.as_text(), {(e, d, 2 * f), (e, f, d)}, args.devices
    )
    largest = _distinct(listing)[: args.largest]
    return {
        "variant": args.variant, "mesh": dict(mesh.shape), "compile_s": round(compile_s, 1),
        "loss": float(metrics["loss"]), "collectives": summary,
        "total_bytes": sum(summary[k]["bytes"] for k in COLLECTIVES),
        "total_ring_bytes": sum(summary[k]["ring_bytes"] for k in COLLECTIVES),
        "largest": largest,
    }  # fmt: skip


def _config(args) -> dict:
    return {
        "output_dir": "/tmp/unused",
        "model": {"vocab_size": args.vocab, "d_model": args.d_model, "num_layers": args.layers,
                  "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 4 * args.d_model,
                  "max_seq_len": args.seq, "scan_layers": False,
                  "moe": {"num_experts": args.experts, "experts_per_token": args.top_k,
                          "expert_mlp_dim": args.expert_mlp}},
        "precision": {"recipe": "nvfp4"},
        "train": {"steps": 10, "batch_size": args.batch, "seq_len": args.seq},
        "mesh": {"data": args.data, "fsdp": args.fsdp, "expert": args.expert},
    }  # fmt: skip


def _child(args, variant: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
           "JAX_ENABLE_COMPILATION_CACHE": "false"}  # compile times as measured  # fmt: skip
    command = [sys.executable, __file__, "--child", "--variant", variant, *sys.argv[1:]]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _distinct(listing: list[dict]) -> list[dict]:
    """The collectives by (op, shape, group, runs), each with how many times the HLO text holds
    it ("in_text"; the branches of a conditional each hold one), largest first."""
    counts = collections.Counter()
    for c in listing:
        shape = re.sub(r"\{[^}]*\}", "", c["shape"])  # without layouts
        counts[c["op"], shape, c["group"], c["runs"], c["bytes"]] += c.get("in_text", 1)
    rows = [{"op": op, "shape": shape, "group": group, "runs": runs, "bytes": size, "in_text": n}
            for (op, shape, group, runs, size), n in counts.items()]  # fmt: skip
    return sorted(rows, key=lambda c: -c["bytes"] * c["runs"])


def _jax_version() -> str:
    import jax

    return jax.__version__


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: list[dict]) -> str:
    """The Markdown table: per design, ops / buffer MiB of each collective kind (as executed),
    the totals, the ring traffic per device, the step-1 loss and the compile time."""
    rows = ["| design | " + " | ".join(f"{k} (ops / MiB)" for k in KINDS)
            + " | total MiB | sent per device, ring (MiB) | step-1 loss | compile s |",
            "|---" * (len(KINDS) + 5) + "|"]  # fmt: skip
    for r in results:
        cells = [f"{r['collectives'][k]['ops']} / {_mib(r['collectives'][k]['bytes'])}"
                 for k in KINDS]  # fmt: skip
        rows.append(f"| {r['variant']} | " + " | ".join(cells) + f" | {_mib(r['total_bytes'])} | "
                    f"{_mib(r['total_ring_bytes'])} | {r['loss']:.7f} | {r['compile_s']} |")  # fmt: skip
    return "\n".join(rows)


def markdown(payload: dict) -> str:
    """The benchmark page: setup, the table, the largest collectives of each design."""
    setup, results = payload["setup"], payload["results"]
    mesh = " x ".join(f"{a}={setup[a]}" for a in ("data", "fsdp", "expert") if setup[a] > 1)
    lines = [
        "# Expert parallelism: what a train step communicates, by dispatch design", "",
        f"Train step of an NVFP4 MoE model ({setup['layers']} blocks, d_model "
        f"{setup['d_model']}, {setup['experts']} experts of {setup['expert_mlp']} units, top-"
        f"{setup['top_k']}, batch {setup['batch']} x {setup['seq']} tokens) on {setup['devices']} "
        f"fake CPU devices, {mesh}; jax {payload.get('jax', '?')}. Collectives of the compiled "
        "HLO as executed (loops times their trip counts, a conditional by its costliest branch); "
        "MiB: the buffers (an all-gather's result, a reduce-scatter's input, an all-reduce's "
        "operand); sent per device: what ring algorithms send, (n - 1) / n of each buffer over "
        "groups of n (twice for an all-reduce). XLA:CPU runs BF16 collectives in float32 (4 "
        "bytes per element here, 2 on GPUs). Regenerate with `python packages/nvfp4-train/"
        "benchmarks/bench_expert_parallel.py --md docs/benchmarks/moe_expert_parallel.md --out "
        "docs/benchmarks/moe_expert_parallel.json`. Why the run uses `shard_map`: "
        "[docs/distributed.md](../distributed.md#expert-parallelism-meshexpert).", "",
        table(results), "",
    ]  # fmt: skip
    for r in results:
        lines += [f"Largest collectives of `{r['variant']}` (buffer MiB x runs per step; in the "
                  "HLO text that many times, each branch of a conditional holding one):", ""]  # fmt: skip
        lines += [f"- {c['op']} `{c['shape']}` over {c['group']} devices: {_mib(c['bytes'])} "
                  f"MiB x {c['runs']}; {c.get('in_text', 1)} in the text"
                  for c in _distinct(r["largest"])]  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="shard_map", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--data", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--expert", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
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
    results = [_child(args, v) for v in ("gspmd", "shard_map")]
    text = table(results)
    print(text)
    setup = {k: getattr(args, k) for k in ("devices", "data", "fsdp", "expert", "layers",
             "experts", "top_k", "d_model", "expert_mlp", "vocab", "batch", "seq")}  # fmt: skip
    payload = {"setup": setup, "jax": _jax_version(), "results": results}
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(payload))


if __name__ == "__main__":
    main()
