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

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "configs" / "continue-from-hf-moe.yaml"
STEPS = 20
TRAIN = [
    f"train.steps={STEPS}", "train.batch_size=4", "train.seq_len=32", "train.log_every=5",
    f"train.eval_every={STEPS}", f"checkpoint.every_steps={STEPS}", "logging.tensorboard=false",
    "logging.progress=plain", "optimizer.learning_rate=3e-3", "optimizer.warmup_steps=2",
]  # fmt: skip
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


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


def _val_loss(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if r.get("step") == STEPS and "val_loss" in r][-1]


def _validation_batches(run: Path) -> list[dict]:
    from nvfp4_train.training.session import load_run_config, with_data

    _, datasets = with_data(load_run_config(run))
    return datasets.validation_batches()


def _modelopt_dense_copy(export: Path, out: Path) -> None:
    """A BF16 copy of a ModelOpt export: each FP4 module's `weight` (packed E2M1, low nibble
    first) x its `weight_scale` (E4M3 per 16 inputs) x `weight_scale_2` (the decode scale),
    the other tensors as stored, config.json without quantization_config."""
    import ml_dtypes
    import torch
    from safetensors.torch import save_file

    from nvfp4_format.safetensors_file import load_safetensors

    tensors = dict(load_safetensors(export / "model.safetensors")[0])
    dense = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and value.dtype == np.uint8:
            codes = np.stack([value & 0x0F, value >> 4], axis=-1).reshape(value.shape[0], -1)
            blocks = tensors[f"{module}.weight_scale"].astype(np.float32)
            w = E2M1[codes] * np.repeat(blocks, 16, axis=1) * tensors[f"{module}.weight_scale_2"]
            dense[name] = torch.from_numpy(w.astype(ml_dtypes.bfloat16).view(np.uint16)).view(
                torch.bfloat16
            )
        elif suffix not in ("weight_scale", "weight_scale_2", "input_scale"):
            array = np.array(value)  # a writable copy for torch
            if array.dtype == ml_dtypes.bfloat16:
                dense[name] = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
            else:
                dense[name] = torch.from_numpy(array)
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((export / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))


def _loss(model_dir: Path, batches: list[dict]) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(torch.tensor(np.asarray(batch["inputs"]), dtype=torch.long)).logits
            targets = torch.tensor(np.asarray(batch["targets"]), dtype=torch.long)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
            total, count = total + float(loss), count + targets.numel()
    return total / count


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
    from nvfp4_export.clients import moe_dense_copy

    run, exports, _ = trained
    if layout == "modelopt":
        _modelopt_dense_copy(exports[layout], tmp_path)
    else:
        moe_dense_copy(exports[layout], tmp_path)
    loss, val_loss = _loss(tmp_path, _validation_batches(run)), _val_loss(run)
    print(f"{layout}: transformers reload loss {loss:.4f}, the run's val_loss {val_loss:.4f} "
          f"({(loss - val_loss) / val_loss:+.2%})")  # fmt: skip
    assert abs(loss - val_loss) <= 0.01 * val_loss
