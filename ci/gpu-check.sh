#!/usr/bin/env bash
# The checks that need a GPU, in one command, results as JSON under OUT (default gpu-check/):
#   1. `nvfp4-ops doctor --verify`: every available backend against "emulated" on this GPU;
#   2. the ops benchmark (one dot_general and a 2-layer MLP per recipe, per backend) and the
#      train-step benchmark (the tiny Llama, BF16 vs NVFP4) for each available backend;
#   3. a short NVFP4 training of examples/configs/tiny.yaml on each available backend;
#   4. each fused attention kernel that runs here (cudnn; te with TE) against the reference
#      (nvfp4_train.precision.attention_check, Llama-3-8B's heads: 32 query / 8 key-value heads of
#      128, 8192 tokens, up to 16 documents per row, remat dots);
#   5. with TE available on 2 or more GPUs: backend="te" on a sharded mesh against one device
#      (packages/nvfp4-ops/conformance/sharded_te.py --installed);
#   6. the GPU-only risks that remain untested elsewhere (docs/ops.md), each with what above shows it.
# It installs the packages into a fresh virtualenv with JAX's CUDA wheels unless NO_INSTALL=1
# (then the current Python must already have them); WITH_TE=1 also builds TransformerEngine's JAX
# extension as the README does (--no-build-isolation, against the jax installed here). On a
# Hopper GPU (H100/H200) TE's NVFP4 GEMMs cannot run (sm_100+ only): the check shows what `auto`
# picks there and how fast emulation and the xla backend are on a GPU.
# QUICK=1 shrinks the benchmarks and the run (a smoke test of this script, e.g. on a CPU).
#   bash ci/gpu-check.sh [OUT]
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
cd "$repo"
if [ "${NO_INSTALL:-0}" != 1 ]; then
  python3 -m venv "$out/venv"
  # shellcheck disable=SC1091
  . "$out/venv/bin/activate"
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet "jax[cuda12]" ./packages/nvfp4-format ./packages/nvfp4-ops \
    ./packages/nvfp4-train "flax>=0.10" "hypothesis>=6.100" "pytest>=8"
  if [ "${WITH_TE:-0}" = 1 ]; then
    # As the README: TE's JAX extension is compiled against the jax installed above, so its build
    # must see that jax (no isolated build environment); its build requirements come first.
    python -m pip install --quiet "setuptools>=61" "pybind11[global]"
    python -m pip install --quiet --no-build-isolation "transformer_engine[jax]>=2.14"
  fi
fi
export PYTHONUNBUFFERED=1
ops_sizes=(--repeats 10)
train_sizes=(--rounds 5)
steps=100
if [ "${QUICK:-0}" = 1 ]; then
  ops_sizes=(--gemm-size 256 --tokens 256 --d-model 128 --d-hidden 256 --repeats 2)
  train_sizes=(--rounds 1 --steps 2)
  steps=10
fi
status=0
nvfp4-ops doctor --verify --json "$out/verify.json" | tee "$out/doctor.txt" || status=1
backends=$(python -c "import nvfp4_ops; print(' '.join(n for n, (ok, _) in nvfp4_ops.backend_capabilities().items() if ok))")
for backend in $backends; do
  python packages/nvfp4-ops/benchmarks/bench_step.py --backend "$backend" "${ops_sizes[@]}" \
    --json "$out/ops_step_$backend.json" | tee "$out/ops_step_$backend.txt" || status=1
  python packages/nvfp4-train/benchmarks/bench_train_step.py "${train_sizes[@]}" \
    --override "precision.backend=$backend" --out "$out/train_step_$backend.json" --md "" \
    | tee "$out/train_step_$backend.txt" || status=1
  nvfp4-train run examples/configs/tiny.yaml "precision.backend=$backend" "train.steps=$steps" \
    "output_dir=$out/run-$backend" logging.progress=plain | tee "$out/run_$backend.txt" || status=1
done
python - "$out/attention.json" <<'PY' || status=1
import json, sys
import jax, jax.numpy as jnp
from nvfp4_train.model.attention import attention_capability, host_gpu
from nvfp4_train.precision.attention_check import verify_attention
rows = {}
heads = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
platform = jax.default_backend()
quick = bool(int(__import__("os").environ.get("QUICK", "0")))
for name in ("cudnn", "te"):
    ok, why = attention_capability(name, platform=platform, dtype=jnp.bfloat16, gpu=host_gpu(platform), **heads)
    # as a run of 8192 tokens with up to 16 documents per row and remat dots computes it
    shape = {"seq_len": 256 if quick else 8192, "max_documents": 16, "remat": "dots"}
    report = verify_attention(name, dtype=jnp.bfloat16, **heads, **shape) if ok else None
    rows[name] = {"runs_here": ok, "why_not": why, "ok": report.ok if report else None,
                  "errors": report.errors if report else None, "error": report.error if report else None}
    print(f"attention {name}: {report.summary() if report else 'not here: ' + why}")
open(sys.argv[1], "w").write(json.dumps(rows, indent=2) + "\n")
sys.exit(any(r["ok"] is False for r in rows.values()))
PY
if [[ " $backends " == *" te "* ]] && [ "$(python -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
  (cd packages/nvfp4-ops/conformance && python sharded_te.py --installed) \
    | tee "$out/sharded_te.txt" || status=1
fi
python - "$out" "$backends" <<'PY'
import json, sys
from pathlib import Path
out, backends = Path(sys.argv[1]), sys.argv[2].split()
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.is_file() else None
def final(backend):
    rows = [json.loads(l) for l in (out / f"run-{backend}" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    last = [r for r in rows if "loss" in r][-1]  # throughput of the last window (compiled)
    return {"final_loss": last["loss"], "final_val_loss": val[-1] if val else None,
            **{k: last.get(k) for k in ("tokens_per_s", "model_tflops_per_device", "mfu", "mfu_fp4")}}
summary = {
    "verify": load("verify.json"),
    "attention": load("attention.json"),
    "backends": {b: {"ops_step": load(f"ops_step_{b}.json"), "train_step": load(f"train_step_{b}.json"),
                     "tiny_run": final(b)} for b in backends},
}
(out / "gpu-check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"wrote {out / 'gpu-check.json'}")
PY
echo
echo "GPU-only risks untested on CPU (docs/ops.md), and what above shows each:"
sed -n '/<!-- gpu-only-risks -->/,/<!-- \/gpu-only-risks -->/p' docs/ops.md | grep -v '^<!--' \
  | tee "$out/gpu_only_risks.txt"
exit $status
