"""A Mixture-of-Experts model from Hugging Face and back, as the continue-from-HF MoE example runs it.

A tiny random Qwen3-MoE made by transformers (2 blocks, 4 experts, top-2) is trained for 20 NVFP4
steps with `examples/configs/continue-from-hf-moe.yaml` (block 0 NVFP4, block 1 BF16 by the policy
rule), exported in both layouts from the run's own per-expert activation amax, verified against
the run, and loaded back by transformers as `Qwen3MoeForCausalLM`: the compressed-tensors export
through compressed-tensors' own NVFP4 dequantization (`nvfp4_export.clients.moe_dense_copy`:
transformers 5's loader drops the experts' global scales), the ModelOpt export through this
file's own reading of the ModelOpt tensors (codes x E4M3 block scale x `weight_scale_2`, the
decode convention of docs/spec/export-formats.md). The reloaded model's loss on the run's
held-out validation batches must be within 1% of the run's own evaluation at that step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import hf_models  # noqa: E402
from reload_loss import dense_copy, reloaded_loss, val_loss, validation_batches  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "configs" / "continue-from-hf-moe.yaml"
STEPS = 20
TRAIN = [
    f"train.steps={STEPS}", "train.batch_size=4", "train.seq_len=32", "train.log_every=5",
    f"train.eval_every={STEPS}", f"checkpoint.every_steps={STEPS}", "logging.tensorboard=false",
    "logging.progress=plain", "optimizer.learning_rate=3e-3", "optimizer.warmup_steps=2",
]  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_roundtrip")
    hf_models.make_model("qwen3_moe", root / "model")
    run = root / "run"
    first = _cli(sys.executable, "-m", "nvfp4_train", "run", str(EXAMPLE),
                 f"model.init_from={root / 'model'}", f"output_dir={run}", *TRAIN)  # fmt: skip
    exports = {}
    for layout in ("modelopt", "compressed-tensors"):
        out = root / layout
        _cli(sys.executable, "-m", "nvfp4_export.cli", "hf", str(run), str(out), "--layout", layout)
        exports[layout] = out
    return run, exports, first.stdout


def test_the_run_starts_from_the_moe_model(trained):
    run, _, stdout = trained
    assert f"initialised from {run.parent / 'model'} (qwen3_moe)" in stdout
    stats = json.loads((run / "checkpoints" / str(STEPS) / "quant_stats" / "metadata").read_text())
    amax = stats["activation_amax"]["layers.0.mlp.experts.gate_up"]
    assert isinstance(amax, list) and len(amax) == 4


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_each_export_verifies_against_the_run(trained, layout):
    from nvfp4_export.verify import verify

    run, exports, _ = trained
    report = verify(exports[layout], against=run)
    assert report.problems == () and report.ok and report.complete, report
    by_name = {c.name: c for c in report.comparisons}
    emulation = by_name["NumPy emulation of the trained model"]  # vs the JAX reference logits
    assert emulation.passed is None and "routing ties" in emulation.note  # informational for MoE


@pytest.mark.parametrize("layout", ["modelopt", "compressed-tensors"])
def test_transformers_reloads_it_within_1_percent_of_the_runs_eval_loss(trained, layout, tmp_path):
    run, exports, _ = trained
    dense_copy(exports[layout], layout, tmp_path)
    loss = reloaded_loss(tmp_path, validation_batches(run), "Qwen3MoeForCausalLM")
    val = val_loss(run, STEPS)
    print(f"{layout}: transformers reload loss {loss:.4f}, the run's val_loss {val:.4f} "
          f"({(loss - val) / val:+.2%})")  # fmt: skip
    assert abs(loss - val) <= 0.01 * val
