"""The continued-pretraining path end to end, as the train README's guide runs it.

A small random Qwen 3 and a Llama 3.2-style model (llama3 RoPE scaling, tied embeddings) made by
transformers are trained with `examples/configs/continue-from-hf.yaml` (NVFP4 recipe), resumed,
exported, and loaded back by transformers + compressed-tensors as the same architecture class.

The random models' logits are nearly flat and chaotic (a 4e-3 rounding change moves them as much
as FP4 emulation does), so verify's "trained" comparisons, which suit trained models, are not
asserted here; the loader comparisons and every layout invariant are.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "configs" / "continue-from-hf.yaml"
SHORT = [
    "train.batch_size=4", "train.seq_len=32", "train.log_every=1", "train.eval_every=2",
    "checkpoint.every_steps=2", "logging.tensorboard=false", "logging.progress=plain",
]  # fmt: skip
CLASSES = {"qwen3": "Qwen3ForCausalLM", "llama3.2": "LlamaForCausalLM"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture(scope="module", params=sorted(CLASSES))
def exported(request, tmp_path_factory):
    case = request.param
    root = tmp_path_factory.mktemp(case.replace(".", "_"))
    hf_models.make_model(case, root / "model")
    run, out = root / "run", root / "export"
    train = [sys.executable, "-m", "nvfp4_train", "run", str(EXAMPLE),
             f"model.init_from={root / 'model'}", f"output_dir={run}", *SHORT]  # fmt: skip
    first = _cli(*train, "train.steps=6")
    # as if stopped after step 4 (checkpoints 2, 4, 6, two kept): the same run resumes from 4
    # and compiles nothing new (its steps are in nox's compilation cache)
    shutil.rmtree(run / "checkpoints" / "6")
    again = _cli(*train, "train.steps=6")
    _cli(sys.executable, "-m", "nvfp4_export.cli", "hf", str(run), str(out),
         "--layout", "compressed-tensors", "--calibrate", "4")  # fmt: skip
    return case, run, out, first.stdout, again.stdout


def test_training_starts_from_the_model_and_resumes_from_its_checkpoint(exported):
    case, run, _, first, again = exported
    assert f"initialised from {run.parent / 'model'} ({hf_models.ARCHITECTURE[case]})" in first
    assert "resumed from" in again and "(step 4)" in again
    assert "initialised from" not in again
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_the_export_is_the_same_architecture(exported):
    case, _, out, _, _ = exported
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [CLASSES[case]]
    assert config["model_type"] == hf_models.ARCHITECTURE[case]
    if case == "llama3.2":
        assert config["rope_scaling"] == hf_models.LLAMA3_ROPE and config["tie_word_embeddings"]
    tensors = json.loads((out / "nvfp4_export.json").read_text())["spec"]
    assert tensors["qk_norm"] == (case == "qwen3")


def test_transformers_loads_it_as_that_class_and_computes_the_same_logits(exported):
    import transformers

    from nvfp4_export.verify import verify

    case, run, out, _, _ = exported
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == CLASSES[case]
    if case == "qwen3":
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    report = verify(out, against=run)
    assert report.problems == ()
    by_name = {(c.name, c.against): c for c in report.comparisons}
    loader = by_name["transformers+compressed-tensors", "NumPy forward, same weights (fp32)"]
    assert loader.passed, loader
    reload = by_name[
        "export reload, activations as trained", "trained model with the export's BF16 norms"
    ]
    assert reload.passed and reload.max_abs == 0.0, reload


def test_the_modelopt_layout_of_it_is_sound(exported, tmp_path):
    from nvfp4_export import export_hf
    from nvfp4_export.verify import verify

    _, run, _, _, _ = exported
    out = tmp_path / "modelopt"
    export_hf(run, out, layout="modelopt", calibrate_n=4)
    assert verify(out, against=run).problems == ()
