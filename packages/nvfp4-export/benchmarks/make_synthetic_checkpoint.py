"""Writes a synthetic Llama-3-8B-shaped training checkpoint (random float32 masters), tensor by tensor.

The run directory has the layout `nvfp4-export` reads (docs/export.md, "What export reads"):
`config.yaml` and `checkpoints/<step>/{params,config,integrity}`, the `params` item an orbax
PyTree (OCDBT, StandardSave) like the trainer's, `integrity` its checksums as the trainer writes
them. Orbax's own save of a 32 GB tree of NumPy leaves copies them
all into memory at once (killed at 23.6 GiB on a 24 GiB machine, with or without its
`save_concurrent_gb`), so orbax saves the tree's STRUCTURE (every leaf a 1-element stand-in)
and the `config` item, and then the params item's arrays are replaced, one at a time, by
TensorStore writes in orbax's own on-disk layout for NumPy leaves (an OCDBT database holding one
zarr v2 array per leaf, keyed by the leaf's dotted path, one zstd-1 chunk per array: what
StandardSave writes; the `_METADATA` of NumPy leaves records no shapes). Each tensor is generated
in memory, written and dropped: the script holds about two copies of the largest tensor (the
2.1 GB embedding), never the model. Peak disk: the checkpoint (~30 GB at full size).

Full size (about 32 GB of float32; NOT for CI):
    python packages/nvfp4-export/benchmarks/make_synthetic_checkpoint.py /data/llama3-8b-synth
A Qwen3-30B-A3B-shaped Mixture-of-Experts checkpoint (128 experts of 768, top-8, d_model 2048,
GQA 32/4 of 128, vocab 151936; 48 blocks are 122 GB of float32 masters, `--layers 12` writes a
quarter of the depth at full width, 32 GB), with a `quant_stats` item holding an input amax per
linear and per expert (a few experts of some blocks idle, amax 0, as a real run has them):
    python packages/nvfp4-export/benchmarks/make_synthetic_checkpoint.py /data/q30b \
        --preset qwen3-30b-a3b --layers 12
Small shape (a test of the script itself):
    python packages/nvfp4-export/benchmarks/make_synthetic_checkpoint.py /tmp/s --layers 2 \
        --d-model 256 --mlp-dim 512 --vocab 1024 --heads 4 --kv-heads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

LLAMA3_8B = {"vocab_size": 128256, "d_model": 4096, "num_layers": 32, "num_heads": 32,
             "num_kv_heads": 8, "head_dim": 128, "mlp_dim": 14336, "max_seq_len": 8192,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_embeddings": False,
             "dtype": "bfloat16"}  # fmt: skip


QWEN3_30B_A3B = {"vocab_size": 151936, "d_model": 2048, "num_layers": 48, "num_heads": 32,
                 "num_kv_heads": 4, "head_dim": 128, "mlp_dim": 6144, "max_seq_len": 4096,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_embeddings": False,
                 "dtype": "bfloat16", "architecture": "qwen3_moe", "qk_norm": True,
                 "moe": {"num_experts": 128, "experts_per_token": 8, "expert_mlp_dim": 768,
                         "norm_topk_prob": True}}  # fmt: skip
PRESETS = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def leaf_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every float32 master weight, in the order they are written."""
    d, f, v, hd = model["d_model"], model["mlp_dim"], model["vocab_size"], model["head_dim"]
    nh, nkv = model["num_heads"], model["num_kv_heads"]
    shapes = {"embed.embedding": (v, d), "final_norm.scale": (d,), "lm_head.kernel": (d, v)}
    for i in range(model["num_layers"]):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.scale": (d,), p + "mlp_norm.scale": (d,),
                   p + "attn.qkv.kernel": (d, (nh + 2 * nkv) * hd), p + "attn.o.kernel": (nh * hd, d)}  # fmt: skip
        if model.get("qk_norm"):
            shapes |= {p + "attn.q_norm.scale": (hd,), p + "attn.k_norm.scale": (hd,)}
        moe = model.get("moe")
        if moe:  # every block an MoE block (Qwen3-30B-A3B)
            e, fe = moe["num_experts"], moe["expert_mlp_dim"]
            shapes |= {p + "mlp.router.kernel": (d, e), p + "mlp.router.score_bias": (e,),
                       p + "mlp.experts.gate_up.kernel": (e, d, 2 * fe),
                       p + "mlp.experts.down.kernel": (e, fe, d)}  # fmt: skip
        else:
            shapes |= {p + "mlp.gate_up.kernel": (d, 2 * f), p + "mlp.down.kernel": (f, d)}
    return shapes


def quant_stats(model: dict, seed: int = 0) -> dict:
    """A `quant_stats` item: an input amax for every linear, a list of one per expert for the
    experts (in every fourth block, two experts idle: amax 0, as experts without tokens are)."""
    rng, amax = np.random.default_rng(seed), {}
    for i in range(model["num_layers"]):
        amax[f"layers.{i}.attn.qkv"] = float(rng.uniform(2, 8))
        amax[f"layers.{i}.attn.o"] = float(rng.uniform(1, 4))
        if not model.get("moe"):
            amax[f"layers.{i}.mlp.gate_up"] = float(rng.uniform(2, 8))
            amax[f"layers.{i}.mlp.down"] = float(rng.uniform(1, 16))
            continue
        for kind, high in (("gate_up", 8.0), ("down", 16.0)):
            values = rng.uniform(1.0, high, model["moe"]["num_experts"])
            if i % 4 == 1:
                values[[3 % len(values), 77 % len(values)]] = 0.0
            amax[f"layers.{i}.mlp.experts.{kind}"] = [float(x) for x in values]
    return {"activation_amax": amax}


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random N(0, 0.02) float32 weights (norm scales: ones), generated 1024 rows at a time."""
    if name.endswith(".scale"):
        return np.ones(shape, np.float32)
    if name.endswith(".score_bias"):
        return np.zeros(shape, np.float32)
    out = np.empty(shape, np.float32)
    rows = max(1, 1024 * 2048 // int(np.prod(shape[1:]) or 1))  # ~8 MB per step
    for start in range(0, shape[0], rows):
        block = out[start : start + rows]
        block[...] = rng.standard_normal(block.shape, dtype=np.float32) * np.float32(0.02)
    return out


def _nested(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _replace_arrays(item: Path, shapes: dict[str, tuple[int, ...]], rng) -> dict[str, list[int]]:
    """Writes every leaf of the params item as orbax's NumPy handler lays it out, one by one;
    returns the `integrity` checksums of the leaves written (`params.<path>` -> [s1, s2])."""
    import shutil

    import tensorstore as ts

    from nvfp4_export.checkpoint import checksums

    for stale in ("manifest.ocdbt", "d", "ocdbt.process_0"):  # the stand-ins' database
        path = item / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    kvstore = {"driver": "ocdbt", "base": f"file://{item.absolute()}/"}
    context = ts.Context()
    sums = {}
    for name, shape in shapes.items():
        value = _random(name, shape, rng)
        metadata = {"shape": list(shape), "chunks": list(shape), "dtype": "<f4",
                    "compressor": {"id": "zstd", "level": 1}, "order": "C",
                    "fill_value": None, "filters": None, "dimension_separator": "."}  # fmt: skip
        spec = {"driver": "zarr", "kvstore": {**kvstore, "path": f"{name}/"}, "metadata": metadata}
        array = ts.open(spec, create=True, context=context).result()
        array.write(value).result()
        sums[f"params.{name}"] = checksums(value)
        del value, array
    return sums


def write_checkpoint(run_dir: Path, model: dict, step: int = 1, seed: int = 0) -> int:
    """Writes `run_dir` (config.yaml, checkpoints/<step>/{params, config, integrity} and, for an
    MoE model, quant_stats); returns the number of parameters."""
    import orbax.checkpoint as ocp
    import yaml

    from nvfp4_export.checkpoint import INTEGRITY_ALGORITHM, JSON_CHECKSUMS
    from nvfp4_export.json_files import json_sha256

    config = {"model": model, "precision": {"recipe": "nvfp4"}, "output_dir": str(run_dir)}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    shapes = leaf_shapes(model)
    stand_ins = {name: np.zeros((1,) * len(shape), np.float32) for name, shape in shapes.items()}
    options = ocp.CheckpointManagerOptions(create=True)
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options) as mgr:
        items = {"params": ocp.args.StandardSave(_nested(stand_ins)),
                 "config": ocp.args.JsonSave(config)}  # fmt: skip
        stats = quant_stats(model, seed) if model.get("moe") else None
        if stats is not None:
            items["quant_stats"] = ocp.args.JsonSave(stats)
        mgr.save(step, args=ocp.args.Composite(**items))
        mgr.wait_until_finished()
    step_dir = run_dir / "checkpoints" / str(step)
    sums = _replace_arrays(step_dir / "params", shapes, np.random.default_rng(seed))
    integrity = {"algorithm": INTEGRITY_ALGORITHM, "finite": True, "checksums": sums,
                 JSON_CHECKSUMS: {"config": json_sha256(config)}}  # fmt: skip
    if stats is not None:
        integrity[JSON_CHECKSUMS]["quant_stats"] = json_sha256(stats)
    writer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    writer.save((step_dir / "integrity").absolute(), integrity)
    return int(sum(np.prod(s) for s in shapes.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    for flag in ("--layers", "--d-model", "--mlp-dim", "--vocab", "--heads", "--kv-heads",
                 "--head-dim", "--experts", "--expert-mlp-dim"):  # fmt: skip
        ap.add_argument(flag, type=int, default=None, help="default: the preset's")
    args = ap.parse_args()
    model = json.loads(json.dumps(PRESETS[args.preset]))
    keys = {"layers": "num_layers", "d_model": "d_model", "mlp_dim": "mlp_dim",
            "vocab": "vocab_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
            "head_dim": "head_dim"}  # fmt: skip
    for arg, key in keys.items():
        if getattr(args, arg) is not None:
            model[key] = getattr(args, arg)
    if args.head_dim is None and (args.d_model or args.heads):
        model["head_dim"] = model["d_model"] // model["num_heads"]
    for arg, key in (("experts", "num_experts"), ("expert_mlp_dim", "expert_mlp_dim")):
        if getattr(args, arg) is not None:
            model["moe"][key] = getattr(args, arg)
    start = time.perf_counter()
    n = write_checkpoint(args.run_dir, model)
    seconds = time.perf_counter() - start
    print(json.dumps({"run_dir": str(args.run_dir), "parameters": n, "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
