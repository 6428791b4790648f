"""Wall time and peak memory of exporting a large checkpoint (e.g. the synthetic Llama-3-8B one).

Each layout is exported weight-only in a fresh process, which reports its wall time, its peak
resident set (`VmHWM`: what the export held, file pages it touched included) and the peak of its
anonymous memory sampled every 50 ms (`RssAnon`: what it allocated, the memory a smaller machine
must have); a process that only imports the libraries gives the baseline. Prints a table, writes
JSON and Markdown. Not for CI: the checkpoint is tens of GB.

    python packages/nvfp4-export/benchmarks/make_synthetic_checkpoint.py /data/llama3-8b-synth
    python packages/nvfp4-export/benchmarks/bench_export_large.py /data/llama3-8b-synth \\
        --name export_8b
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

GIB = 2**30
CHILD = """
import json, sys, threading, time
def field(name):
    for line in open("/proc/self/status"):
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
peak_anon = [0]
def sample():
    while True:
        peak_anon[0] = max(peak_anon[0], field("RssAnon"))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
from nvfp4_export import export_hf
import orbax.checkpoint, jax
baseline = (field("VmRSS"), field("RssAnon"))
if sys.argv[2] != "-":
    start = time.perf_counter()
    result = export_hf(sys.argv[1], sys.argv[2], layout=sys.argv[3],
                       weight_only=sys.argv[4] == "weight-only")
    seconds, nbytes = time.perf_counter() - start, result.total_bytes
else:
    seconds, nbytes = 0.0, 0
time.sleep(0.1)
print(json.dumps({"seconds": seconds, "bytes": nbytes, "vm_hwm": field("VmHWM"),
                  "peak_anon": peak_anon[0], "baseline_rss": baseline[0],
                  "baseline_anon": baseline[1]}))
"""


def _child(run_dir: Path, out: str, layout: str, mode: str = "weight-only") -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(run_dir), out, layout, mode],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--name", default="export_8b")
    ap.add_argument("--w4a4", action="store_true",
                    help="W4A4 (input scales from the checkpoint's quant_stats) instead of "
                    "weight-only")  # fmt: skip
    args = ap.parse_args()
    mode = "w4a4" if args.w4a4 else "weight-only"
    ckpt = args.run_dir / "checkpoints"
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    libraries = _child(args.run_dir, "-", "-")
    rows = []
    for layout in ("modelopt", "compressed-tensors"):
        out = args.run_dir.parent / f"{args.run_dir.name}-{layout}"
        shutil.rmtree(out, ignore_errors=True)
        r = _child(args.run_dir, str(out), layout, mode)
        shutil.rmtree(out, ignore_errors=True)
        rows.append({"layout": layout, **r})
    lines = [
        f"# nvfp4-export: {args.run_dir.name}, {mode}, {os.cpu_count()} CPU cores",
        "",
        f"Checkpoint on disk: {ckpt_bytes / GIB:.1f} GiB. Libraries alone: RSS "
        f"{libraries['vm_hwm'] / GIB:.2f} GiB, anonymous {libraries['peak_anon'] / GIB:.2f} GiB.",
        "",
        "| layout | export s | output GiB | peak RSS GiB (VmHWM) | peak anonymous GiB |",
        "|---|---:|---:|---:|---:|",
        *(f"| {r['layout']} | {r['seconds']:.1f} | {r['bytes'] / GIB:.2f} | "
          f"{r['vm_hwm'] / GIB:.2f} | {r['peak_anon'] / GIB:.2f} |" for r in rows),
    ]  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    report = {"run_dir": str(args.run_dir), "checkpoint_bytes": ckpt_bytes, "mode": mode,
              "libraries": libraries, "exports": rows,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out_dir / f"{args.name}.md").write_text(text)


if __name__ == "__main__":
    main()
