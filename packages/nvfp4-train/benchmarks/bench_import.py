"""Import time and peak host memory of `model.init_from` for a 1B-parameter Llama checkpoint.

transformers builds a Llama 3.2 1B-shaped model (d_model 2048, 16 blocks, GQA 32/8, mlp 8192,
vocab 128256, tied embeddings: 1.24B parameters) with its own random init and `save_pretrained`s
it, once in float32 and once in bfloat16. A fresh process per checkpoint then fills the config
from it and reads the weights into the run's parameter tree (`load_hf_params`; blocks stacked
and scanned, as `scan_layers: auto` does at 16 blocks) and reports wall time and its peak
resident set (`VmHWM`), next to the checkpoint's size and the float32 parameters' size the
import must produce. Prints a table, writes JSON and (with --md) Markdown.

    python packages/nvfp4-train/benchmarks/bench_import.py --md docs/benchmarks/import_1b.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
LLAMA_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
    rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)  # fmt: skip

CHILD = """
import json, sys, time
start = time.perf_counter()

def rss(field):  # bytes; VmHWM is the peak (reset at exec, unlike ru_maxrss), RssFile mapped files
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

import jax
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.hf.weights import load_hf_params
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.mesh.sharding import make_mesh, tree_shardings
baseline = rss("VmRSS")
imported = time.perf_counter()
cfg = config_from_dict({"model": {"init_from": sys.argv[1]}, "train": {"seq_len": 128}})
_, abstract = abstract_state(cfg)
shardings = tree_shardings(abstract, abstract.params, make_mesh(cfg.mesh, jax.devices()))
params, unused = load_hf_params(cfg.model.init_from, cfg.model, abstract.params, shardings.params)
jax.block_until_ready(params)
done = time.perf_counter()
nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
print(json.dumps({
    "import_s": done - imported, "process_start_s": imported - start,
    "peak_rss_bytes": rss("VmHWM"), "file_rss_after_bytes": rss("RssFile"),
    "baseline_rss_bytes": baseline, "params_bytes": nbytes,
    "params": sum(leaf.size for leaf in jax.tree.leaves(params)), "unused": unused,
    "layers_key": sorted(params["layers"]),
}))
"""


def write_checkpoint(out: Path, dtype: str) -> float:
    """Saves the random 1B model in `dtype`; returns the seconds transformers took."""
    import torch
    import transformers

    start = time.perf_counter()
    config = transformers.LlamaConfig(**LLAMA_1B)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    del model
    return time.perf_counter() - start


def measure(model_dir: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir)], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["checkpoint_bytes"] = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    return result


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Import of a 1B-parameter Hugging Face checkpoint (`model.init_from`)",
        "",
        f"Measured by `packages/nvfp4-train/benchmarks/bench_import.py` on {meta['machine']} "
        f"({meta['cpus']} CPUs, jax {meta['jax']}, one run each). Llama 3.2 1B shape "
        f"({meta['params']:,} parameters, tied embeddings), random weights written by "
        "transformers' `save_pretrained`; the import reads them into float32 master weights "
        "with the blocks stacked for `scan_layers`. Peak RSS is the importing process's "
        '`VmHWM` (JAX runtime included); "added" is peak RSS minus the process\'s RSS '
        "before the import minus the float32 parameters it produces: what the reading itself "
        "costs.",
        "",
        "| checkpoint | file | params (fp32) | import | peak RSS | peak / file | added |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        added = r["peak_rss_bytes"] - r["baseline_rss_bytes"] - r["params_bytes"]
        lines.append(
            f"| {r['dtype']} | {r['checkpoint_bytes'] / GIB:.2f} GiB | "
            f"{r['params_bytes'] / GIB:.2f} GiB | {r['import_s']:.1f} s | "
            f"{r['peak_rss_bytes'] / GIB:.2f} GiB | "
            f"{r['peak_rss_bytes'] / r['checkpoint_bytes']:.2f}x | {added / GIB:+.2f} GiB |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="docs/benchmarks/import_1b.json")
    parser.add_argument("--md", default=None)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--workdir", default=None, help="keep (and reuse) the checkpoints here")
    args = parser.parse_args()
    import jax

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            model_dir = Path(args.workdir or tmp) / dtype
            written = None
            if not (model_dir / "config.json").is_file():
                written = write_checkpoint(model_dir, dtype)
            rows.append({"dtype": dtype, "write_s": written, **measure(model_dir)})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "unused"}), flush=True)
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": __import__("os").cpu_count(),
        "jax": jax.__version__,
        "params": rows[0]["params"],
    }
    text = markdown(rows, meta)
    print(text)
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(text)


if __name__ == "__main__":
    main()
