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


def leaf_shapes(model: dict) -> dict[str, tuple[int, ...]]:
    """Dotted path -> shape of every float32 master weight, in the order they are written."""
    d, f, v, hd = model["d_model"], model["mlp_dim"], model["vocab_size"], model["head_dim"]
    nh, nkv = model["num_heads"], model["num_kv_heads"]
    shapes = {"embed.embedding": (v, d), "final_norm.scale": (d,), "lm_head.kernel": (d, v)}
    for i in range(model["num_layers"]):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.scale": (d,), p + "mlp_norm.scale": (d,),
                   p + "attn.qkv.kernel": (d, (nh + 2 * nkv) * hd), p + "attn.o.kernel": (nh * hd, d),
                   p + "mlp.gate_up.kernel": (d, 2 * f), p + "mlp.down.kernel": (f, d)}  # fmt: skip
    return shapes


def _random(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random N(0, 0.02) float32 weights (norm scales: ones), generated 1024 rows at a time."""
    if name.endswith(".scale"):
        return np.ones(shape, np.float32)
    out = np.empty(shape, np.float32)
    for start in range(0, shape[0], 1024):
        block = out[start : start + 1024]
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
    """Writes `run_dir` (config.yaml, checkpoints/<step>/{params, config, integrity}); returns the
    number of parameters."""
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
        mgr.save(step, args=ocp.args.Composite(**items))
        mgr.wait_until_finished()
    step_dir = run_dir / "checkpoints" / str(step)
    sums = _replace_arrays(step_dir / "params", shapes, np.random.default_rng(seed))
    integrity = {"algorithm": INTEGRITY_ALGORITHM, "finite": True, "checksums": sums,
                 JSON_CHECKSUMS: {"config": json_sha256(config)}}  # fmt: skip
    writer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
    writer.save((step_dir / "integrity").absolute(), integrity)
    return int(sum(np.prod(s) for s in shapes.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--layers", type=int, default=LLAMA3_8B["num_layers"])
    ap.add_argument("--d-model", type=int, default=LLAMA3_8B["d_model"])
    ap.add_argument("--mlp-dim", type=int, default=LLAMA3_8B["mlp_dim"])
    ap.add_argument("--vocab", type=int, default=LLAMA3_8B["vocab_size"])
    ap.add_argument("--heads", type=int, default=LLAMA3_8B["num_heads"])
    ap.add_argument("--kv-heads", type=int, default=LLAMA3_8B["num_kv_heads"])
    args = ap.parse_args()
    model = {**LLAMA3_8B, "num_layers": args.layers, "d_model": args.d_model,
             "mlp_dim": args.mlp_dim, "vocab_size": args.vocab, "num_heads": args.heads,
             "num_kv_heads": args.kv_heads, "head_dim": args.d_model // args.heads}  # fmt: skip
    start = time.perf_counter()
    n = write_checkpoint(args.run_dir, model)
    seconds = time.perf_counter() - start
    print(json.dumps({"run_dir": str(args.run_dir), "parameters": n, "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
