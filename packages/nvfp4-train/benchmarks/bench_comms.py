"""What a train step communicates under FSDP, by recipe and `precision.gather` mode.

The train step of a small dense model (`--layers` blocks, d_model `--d-model`, vocab `--vocab`,
batch `--batch` x `--seq` tokens) is compiled on 8 fake CPU devices (`mesh.fsdp=8`, one child
process) for each recipe (`bf16`; `nvfp4` with the default policy, its first and last blocks in
BF16; `nvfp4` on every block) and each gather mode, and the compiled HLO text
(`jitted.lower(...).compile().as_text()`) is read for every all-gather, reduce-scatter and
all-reduce: bytes of the buffer each moves per device (an all-gather's result, a reduce-scatter's
input, an all-reduce's operand), by dtype, counted as executed (a collective inside a while loop
times the loop's known trip count). An all-gather whose result is a block linear's kernel
[K, N], or its packed codes [1, N, K/2] or tile scales [1, N, K/16], counts as a GEMM weight
gather; everything else (activations, embedding, norms, scalars) as the rest. Each variant also
runs one step: its loss (the same bits in every mode where every block is quantized; the
BF16-policy linears' explicit gathers change the partitioning of their GEMMs, see the notes).

XLA:CPU runs BF16 collectives in float32 and FP8 ones in float16: the dtypes are those of the
compiled CPU program (a BF16 gather counts 4 bytes per element here, 2 on GPUs; E4M3 scales 2
here, 1 on GPUs); the table's "GPU bytes" column takes those collectives at their own width.

    python packages/nvfp4-train/benchmarks/bench_comms.py \\
        --md docs/benchmarks/comms.md --out docs/benchmarks/comms.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_expert_parallel import _callees, parse_hlo  # noqa: E402

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
         "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}  # fmt: skip
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
VARIANTS = (
    ("bf16", "bf16", -1),
    ("nvfp4", "nvfp4", -1),
    ("nvfp4 (every block)", "nvfp4", 0),
)
"""(label, precision.recipe, bf16_first_layers = bf16_last_layers; -1: the default rule)."""
MODES = ("master", "compute", "quantized")
GPU_WIDTH = {"f32": 2, "f16": 1, "bf16": 2, "u8": 1, "f8e4m3fn": 1}
"""Bytes per element of the explicit gathers (`model.weight_gather`'s shard_map) as they leave a
GPU: XLA:CPU widens a BF16 gather to float32 and an E4M3 one to float16."""


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def _count(n: tuple[int, ...]) -> int:
    total = 1
    for d in n:
        total *= d
    return total


WEIGHT_SCOPES = ("shard_map", "nvfp4/fprop", "nvfp4/dgrad", "convert_element_type", "dot_general")
"""What the op_name of a GEMM weight gather's operand holds: the explicit gathers' shard_map, the
GEMMs' own scopes (XLA gathering a weight, or its dequantized values, for Fprop or Dgrad) or the
cast to the compute dtype. Gradients gathered for the norm ("transpose(jvp(...))/reshape", outside
the GEMM scopes) and the optimizer's selects do not count."""


def _op_name(ins: dict) -> str:
    name = re.search(r'op_name="([^"]*)"', ins.get("rest", ""))
    return name.group(1) if name else ""


def _is_weight_gather(ins: dict, defs: dict, weight_shapes: set) -> bool:
    dims = [d for _, d in _arrays(ins["shape"])][-1:]
    if not dims or dims[0] not in weight_shapes:
        return False
    operand = re.match(r"\s*%?([\w.\-]+)", ins["rest"])
    source = defs.get(operand.group(1), {}) if operand else {}
    if "shard_map" in _op_name(ins):
        return True  # the explicit gathers of `model.weight_gather`
    name = _op_name(source)
    if name.endswith("/reshape") and "transpose(" in name:
        return False  # a gradient (the global norm reads it whole)
    return any(scope in name for scope in WEIGHT_SCOPES)


def collective_bytes(text: str, weight_shapes: set[tuple[int, ...]]) -> dict:
    """{kind: {dtype: executed buffer bytes}} of compiled HLO text, the all-gathers split into
    "weight all-gather" (`_is_weight_gather`: a block kernel's shape, or its codes' or scales',
    gathered for a GEMM) and "other all-gather"."""
    computations, entry = parse_hlo(text)
    defs = {i["name"]: i for c in computations.values() for i in c}
    totals: dict = collections.defaultdict(collections.Counter)

    def visit(name: str, times: int, seen: frozenset) -> None:
        for ins in computations.get(name, []):
            kind = ins["op"].removesuffix("-start")
            if kind in KINDS:
                arrays = _arrays(ins["shape"])
                if kind == "reduce-scatter":  # the input: the result times the group
                    operand = re.match(r"\s*%?([\w.\-]+)", ins["rest"]).group(1)
                    arrays = _arrays(defs.get(operand, ins)["shape"])
                if kind == "all-gather":
                    arrays = arrays[-1:]  # an async start's tuple: (operand, result)
                    weight = _is_weight_gather(ins, defs, weight_shapes)
                    kind = "weight all-gather" if weight else "other all-gather"
                    if weight:
                        explicit = "shard_map" in _op_name(ins)
                        for dtype, dims in arrays:
                            width = GPU_WIDTH.get(dtype, 0) if explicit else BYTES.get(dtype, 0)
                            totals["weight all-gather, GPU widths"]["all"] += (
                                _count(dims) * width * times
                            )
                for dtype, dims in arrays:
                    totals[kind][dtype] += _count(dims) * BYTES.get(dtype, 0) * times
                continue
            how, callees, trips = _callees(ins)
            for c in callees:
                if c in computations and c not in seen:
                    visit(c, times * trips, seen | {c})

    visit(entry, 1, frozenset({entry}))
    return {k: dict(v) for k, v in totals.items()}


def weight_shapes(d: int, heads: int, kv: int, mlp: int) -> set[tuple[int, ...]]:
    """The block kernels [K, N] (either way round, with or without the canonical leading 1: XLA
    may gather a weight's dequantized values for a GEMM), codes [1, N, K/2], scales [1, N, K/16].
    (The default batch x seq, 768 tokens, is no kernel dimension, so no activation matches.)"""
    hd = d // heads
    kernels = [(d, (heads + 2 * kv) * hd), (heads * hd, d), (d, 2 * mlp), (mlp, d)]
    out = set()
    for k, n in kernels:
        out |= {(k, n), (n, k), (1, k, n), (1, n, k), (1, n, k // 2), (1, n, k // 16)}
    return out


def _config(args, recipe: str, bf16_blocks: int, gather: str) -> dict:
    return {
        "output_dir": "/tmp/unused",
        "model": {"vocab_size": args.vocab, "d_model": args.d_model, "num_layers": args.layers,
                  "num_heads": args.heads, "num_kv_heads": args.kv_heads,
                  "mlp_dim": 4 * args.d_model, "max_seq_len": args.seq, "scan_layers": False},
        "precision": {"recipe": recipe, "backend": "emulated", "verify_backend": "off",
                      "gather": gather, "bf16_first_layers": bf16_blocks,
                      "bf16_last_layers": bf16_blocks},
        "train": {"steps": 10, "batch_size": args.batch, "seq_len": args.seq},
        "mesh": {"data": 1, "fsdp": args.devices},
    }  # fmt: skip


def measure(args) -> list[dict]:
    """Every variant, in this process (8 fake devices): compile, read the HLO, run one step."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.mesh.sharding import batch_sharding, make_mesh, tree_shardings
    from nvfp4_train.training.resume import initial_state, run_train_step

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    shapes = weight_shapes(args.d_model, args.heads, args.kv_heads, 4 * args.d_model)
    results = []
    for label, recipe, bf16_blocks in VARIANTS:
        for gather in MODES:
            cfg = config_from_dict(_config(args, recipe, bf16_blocks, gather))
            graphdef, state = initial_state(cfg)
            mesh = make_mesh(cfg.mesh, jax.devices())
            state_sh = tree_shardings(state, state.params, mesh)
            batch_sh = batch_sharding(mesh, args.batch)
            batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
            state, batch = jax.device_put(state, state_sh), jax.device_put(batch, batch_sh)
            step = jax.jit(run_train_step(cfg, graphdef, mesh=mesh),
                           in_shardings=(state_sh, batch_sh),
                           out_shardings=(state_sh, NamedSharding(mesh, P())))  # fmt: skip
            compiled = step.lower(state, batch).compile()
            _, metrics = compiled(state, batch)
            results.append({"variant": label, "recipe": recipe, "gather": gather,
                            "loss": float(metrics["loss"]),
                            "bytes": collective_bytes(compiled.as_text(), shapes)})  # fmt: skip
            print(label, gather, file=sys.stderr, flush=True)
    return results


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _dtypes(by_dtype: dict) -> str:
    parts = [f"{_mib(b)} {t}" for t, b in sorted(by_dtype.items(), key=lambda kv: -kv[1]) if b]
    return ", ".join(parts) or "0"


def table(results: list[dict]) -> str:
    head = ("| recipe | precision.gather | GEMM weight all-gathers, XLA:CPU (MiB by dtype) | "
            "at GPU widths (MiB) | vs master | other all-gathers | reduce-scatter | all-reduce "
            "| step-1 loss |")  # fmt: skip
    rows = [head, "|---" * 9 + "|"]
    master = {}
    for r in results:
        gpu = r["bytes"].get("weight all-gather, GPU widths", {}).get("all", 0)
        if r["gather"] == "master":
            master[r["variant"]] = gpu
        ratio = gpu / master[r["variant"]] if master.get(r["variant"]) else float("nan")
        cells = [r["variant"], r["gather"], _dtypes(r["bytes"].get("weight all-gather", {})),
                 _mib(gpu), f"{ratio:.3f}x"] + [
                     _dtypes(r["bytes"].get(k, {}))
                     for k in ("other all-gather", "reduce-scatter", "all-reduce")]  # fmt: skip
        rows.append("| " + " | ".join(cells) + f" | {r['loss']:.7f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=384)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=48)
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--md", type=Path, help="write the page as Markdown")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]],
                          capture_output=True, text=True, env=env, timeout=7200)  # fmt: skip
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    results = json.loads(done.stdout.splitlines()[-1])
    print(table(results))
    setup = {k: getattr(args, k) for k in ("devices", "layers", "d_model", "heads", "kv_heads",
                                           "vocab", "batch", "seq")}  # fmt: skip
    import jax

    payload = {"setup": setup, "jax": jax.__version__, "results": results}
    if args.out:
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    if args.md:
        args.md.write_text(markdown(payload))


def markdown(payload: dict) -> str:
    """The page: setup, the table (the hand-written notes live in docs/distributed.md)."""
    s = payload["setup"]
    return "\n".join([
        "# FSDP communication per train step, by recipe and `precision.gather`", "",
        f"Train step of a dense model ({s['layers']} blocks, d_model {s['d_model']}, "
        f"{s['heads']} heads / {s['kv_heads']} KV heads, MLP {4 * s['d_model']}, vocab "
        f"{s['vocab']}, batch {s['batch']} x {s['seq']} tokens) compiled on {s['devices']} fake "
        f"CPU devices with `mesh.fsdp={s['devices']}`; jax {payload['jax']}. Bytes: the buffers "
        "of the compiled HLO's collectives as executed (an all-gather's result, a "
        "reduce-scatter's input, an all-reduce's operand), per device. Regenerate with `python "
        "packages/nvfp4-train/benchmarks/bench_comms.py --md docs/benchmarks/comms.md --out "
        "docs/benchmarks/comms.json`.", "",
        table(payload["results"]), "",
        *NOTES,
    ])  # fmt: skip


NOTES = (
    "Reading the table. GEMM weight all-gathers: all-gathers whose result is a block linear's "
    "kernel (either way round, or its dequantized values) gathered for a GEMM or its cast, or "
    "the codes [1, N, K/2] and scales [1, N, K/16] gathered by `model.weight_gather`'s "
    "`shard_map`; gradients gathered for the global norm and the optimizer's selects count as "
    "other. XLA:CPU widens BF16 collectives to float32 and E4M3 ones to float16: the "
    '"GPU widths" column counts the explicit gathers at their own width (BF16 2 bytes, E4M3 '
    '1 byte) and XLA\'s own gathers as compiled. "vs master": that column against the same '
    "recipe's `master` row. The BF16-policy linears (the first and last block under the "
    "default rule) gather their BF16 slices under `compute` and `quantized` (nothing to "
    'quantize); "every block" quantizes all four blocks.',
    "",
    "What XLA may already do on GPUs: its GPU pipeline runs `CollectiveQuantizer` after SPMD "
    "partitioning, which exchanges an all-gather with a following conversion to a narrower "
    "type (unary ops in between are shifted), so `master`'s float32 gather followed by the BF16 "
    "cast may become a BF16 gather there (2 bytes per element, as `compute`). It needs the "
    "convert to follow the gather and nothing else to read the float32 result, it does not "
    "run on XLA:CPU, and no pass produces NVFP4 codes (a block computation, not a convert). "
    "What the explicit path guarantees: the gathered buffers are the BF16 slices (`compute`) "
    "or the uint8 codes and E4M3 scales (`quantized`) whatever the partitioner or later passes "
    "do; the quantized linears' products are the same bits as under `master`. The BF16-policy "
    "linears' are not always: under `master` XLA may split a BF16 GEMM's contraction over "
    "`fsdp` and sum the partial products by an all-reduce (the bf16 rows: 36.18 MiB of "
    "all-reduces against 6.18 with the explicit gathers), another summation order, so the "
    "step-1 losses of the bf16 and default-policy rows differ between `master` and the other "
    "modes in the 6th digit (docs/distributed.md); "
    "the other collectives of the step (activations for the Wgrad GEMMs, gradients, the "
    "optimizer) stay XLA's.",
    "",
)


if __name__ == "__main__":
    main()
