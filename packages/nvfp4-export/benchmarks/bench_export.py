"""Export time and output size for a ~1B-parameter Llama checkpoint with random weights.

Builds the checkpoint with orbax directly in the training schema (float32 master weights), exports
it in both layouts (weight-only), and compares the output with the BF16 size of the same model.
Prints a table and writes JSON + Markdown (default: docs/benchmarks/export_1b.{json,md}).

    python packages/nvfp4-export/benchmarks/bench_export.py [--layers 16] [--out-dir docs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from nvfp4_export import export_hf
from nvfp4_export.checkpoint import (
    CONFIG_ITEM,
    INTEGRITY_ALGORITHM,
    INTEGRITY_ITEM,
    JSON_CHECKSUMS,
    PARAMS_ITEM,
    checksums,
)
from nvfp4_export.json_files import json_sha256

PRESET = {"vocab_size": 32000, "d_model": 2048, "num_heads": 32, "num_kv_heads": 8, "head_dim": 64,
          "mlp_dim": 8192, "max_seq_len": 2048, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
          "tie_embeddings": False, "dtype": "bfloat16"}  # fmt: skip


def _params(model: dict, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    d, f, v, hd = model["d_model"], model["mlp_dim"], model["vocab_size"], model["head_dim"]
    nh, nkv = model["num_heads"], model["num_kv_heads"]

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)

    layers = {
        str(i): {
            "attn_norm": {"scale": np.ones(d, np.float32)},
            "mlp_norm": {"scale": np.ones(d, np.float32)},
            "attn": {"qkv": {"kernel": w(d, (nh + 2 * nkv) * hd)}, "o": {"kernel": w(nh * hd, d)}},
            "mlp": {"gate_up": {"kernel": w(d, 2 * f)}, "down": {"kernel": w(f, d)}},
        }
        for i in range(model["num_layers"])
    }
    return {"embed": {"embedding": w(v, d)}, "layers": layers,
            "final_norm": {"scale": np.ones(d, np.float32)}, "lm_head": {"kernel": w(d, v)}}  # fmt: skip


def _count(tree) -> int:
    if isinstance(tree, dict):
        return sum(_count(v) for v in tree.values())
    return int(tree.size)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        out |= _flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value}
    return out


def _integrity(params: dict, config: dict) -> dict:
    """The `integrity` item training writes (docs/checkpoint-schema.md)."""
    sums = {f"params.{k}": checksums(v) for k, v in _flat(params).items()}
    return {"algorithm": INTEGRITY_ALGORITHM, "finite": True, "checksums": sums,
            JSON_CHECKSUMS: {CONFIG_ITEM: json_sha256(config)}}  # fmt: skip


def _write_checkpoint(run_dir: Path, model: dict, precision: dict) -> int:
    import orbax.checkpoint as ocp

    params = _params(model, 0)
    n = _count(params)
    config = {"model": model, "precision": precision}
    options = ocp.CheckpointManagerOptions(create=True)
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options) as manager:
        items = {PARAMS_ITEM: ocp.args.StandardSave(params), CONFIG_ITEM: ocp.args.JsonSave(config),
                 INTEGRITY_ITEM: ocp.args.JsonSave(_integrity(params, config))}  # fmt: skip
        manager.save(1, args=ocp.args.Composite(**items))
        manager.wait_until_finished()
    return n


def _linear_params(model: dict) -> int:
    d, f, hd = model["d_model"], model["mlp_dim"], model["head_dim"]
    per_layer = d * (model["num_heads"] + 2 * model["num_kv_heads"]) * hd
    per_layer += model["num_heads"] * hd * d + 3 * d * f
    return per_layer * model["num_layers"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument(
        "--all-nvfp4", action="store_true", help="no BF16 blocks (default: the paper rule)"
    )
    ap.add_argument("--out-dir", default="docs/benchmarks")
    ap.add_argument("--name", default="export_1b")
    args = ap.parse_args()
    model = {**PRESET, "num_layers": args.layers}
    precision = {"recipe": "nvfp4"}
    if args.all_nvfp4:
        precision |= {"bf16_first_layers": 0, "bf16_last_layers": 0}
    work = Path(tempfile.mkdtemp(prefix="bench_export_"))
    try:
        t0 = time.perf_counter()
        n_params = _write_checkpoint(work / "run", model, precision)
        build_s = time.perf_counter() - t0
        rows = []
        for layout in ("modelopt", "compressed-tensors"):
            result = export_hf(work / "run", work / layout, layout=layout, weight_only=True)
            rows.append({"layout": layout, "seconds": round(result.seconds, 1),
                         "bytes": result.total_bytes, "bf16_modules": len(result.plan.excluded)})  # fmt: skip
            shutil.rmtree(work / layout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bf16_bytes = 2 * n_params
    linear = _linear_params(model)
    floor = 2 * (n_params - linear) + linear * 2 * 4.5 / 16
    report = {
        "model": model, "precision": precision, "parameters": n_params, "linear_parameters": linear,
        "bf16_bytes": bf16_bytes, "floor_bytes_all_linears_nvfp4": int(floor),
        "checkpoint_build_seconds": round(build_s, 1), "exports": rows,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }  # fmt: skip
    lines = [
        f"# nvfp4-export: {n_params / 1e9:.2f}B-parameter Llama (random weights), weight-only",
        "",
        f"{model['num_layers']} blocks, d_model {model['d_model']}, mlp {model['mlp_dim']}, vocab "
        f"{model['vocab_size']}; precision {precision}; {os.cpu_count()} CPU cores.",
        "",
        "| layout | export s | output GB | vs BF16 | BF16 modules |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['seconds']} | {r['bytes'] / 1e9:.3f} | "
                     f"{r['bytes'] / bf16_bytes:.3f} | {r['bf16_modules']} |")  # fmt: skip
    lines += ["", f"BF16 size: {bf16_bytes / 1e9:.3f} GB. Floor with every block linear in NVFP4 "
              f"(4.5/16 of BF16 for linears; embeddings, norms, lm_head BF16): {floor / 1e9:.3f} GB "
              f"({floor / bf16_bytes:.3f} of BF16)."]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
