"""`nvfp4-train run` writes the two checkpoint items export reads (docs/export.md): the
`quant_stats.activation_amax` of every quantized linear and the `reference` logits. A tiny run is
exported W4A4 by the `nvfp4-export` CLI from those items alone, and `nvfp4-export verify` passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nvfp4_export import read_checkpoint, resolve_checkpoint
from nvfp4_export.reload import load_export

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("train") / "tiny"
    _run(
        "nvfp4_train", "run", str(ROOT / "examples/configs/tiny.yaml"), f"output_dir={run_dir}",
        "train.steps=4", "train.batch_size=4", "train.seq_len=32", "train.eval_every=4",
        "checkpoint.every_steps=4", "logging.tensorboard=false", "logging.progress=plain",
    )  # fmt: skip
    return run_dir


def test_checkpoint_holds_activation_amax_and_reference(run_dir):
    ckpt = read_checkpoint(resolve_checkpoint(run_dir))
    recipes = ckpt.quant_stats["recipes"]
    quantized = sorted(p for p, r in recipes.items() if r != "bf16")
    assert quantized and len(quantized) < len(recipes)  # tiny.yaml keeps blocks 0 and 3 in BF16
    amax = ckpt.quant_stats["activation_amax"]
    assert sorted(amax) == quantized
    assert all(np.isfinite(v) and v > 0 for v in amax.values())
    tokens, logits = ckpt.reference["tokens"], ckpt.reference["logits"]
    assert tokens.shape == (4, 32) and tokens.dtype == np.int32
    assert logits.shape == (4, 32, ckpt.params["embed.embedding"].shape[0])
    assert np.all(np.isfinite(logits))


def test_export_cli_is_w4a4_from_the_training_items_and_verifies(run_dir, tmp_path):
    out = tmp_path / "hf"
    done = _run("nvfp4_export.cli", "hf", str(run_dir), str(out), "--layout", "modelopt")
    assert "WEIGHT-ONLY" not in done.stdout + done.stderr
    provenance = load_export(out).provenance
    assert provenance["w4a4"] is True and provenance["input_amax_from"] == "quant_stats"
    stats = read_checkpoint(resolve_checkpoint(run_dir)).quant_stats
    assert provenance["input_amax"] == pytest.approx(stats["activation_amax"])
    verified = _run("nvfp4_export.cli", "verify", str(out), "--against", str(run_dir))
    assert "result: OK" in verified.stdout
    assert "JAX reference (checkpoint item)" in verified.stdout


def test_export_checks_the_checksums_training_wrote(run_dir, tmp_path):
    # The same checksum algorithm on both sides of the schema: training's JAX one and export's
    # NumPy one agree on every parameter; an altered checksum makes export refuse the tensor when
    # it reads it (export reads the checkpoint one tensor at a time).
    import json
    import shutil

    from nvfp4_export import ExportError, export_hf
    from nvfp4_export.checkpoint import checksums

    ckpt = read_checkpoint(resolve_checkpoint(run_dir))  # passes: every checksum matches
    step_dir = ckpt.ref.step_dir
    saved = json.loads((step_dir / "integrity" / "metadata").read_text())
    for name, value in ckpt.params.items():
        assert saved["checksums"][f"params.{name}"] == checksums(value)
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    item = copy / "checkpoints" / step_dir.name / "integrity" / "metadata"
    saved["checksums"]["params.embed.embedding"][1] ^= 1
    item.write_text(json.dumps(saved))
    altered = read_checkpoint(resolve_checkpoint(copy))
    with pytest.raises(ExportError, match=r"not what was saved: the checksums of embed.embedding"):
        altered.params["embed.embedding"]
    altered.params["final_norm.scale"]  # the others still read
    out = tmp_path / "export"
    with pytest.raises(ExportError, match=r"the checksums of embed.embedding"):
        export_hf(copy, out, layout="modelopt")
    assert not out.exists()  # nothing half-written


def test_export_checks_the_config_checksum_training_wrote(run_dir, tmp_path, capsys):
    # Training's SHA-256 of the canonical JSON of its config and quant_stats items is the one
    # export computes; an edit to either after training is refused by export and by verify.
    import json
    import shutil

    from nvfp4_export import ExportError, export_hf
    from nvfp4_export.cli import main
    from nvfp4_export.json_files import json_sha256

    ckpt = read_checkpoint(resolve_checkpoint(run_dir))
    assert not ckpt.notes  # everything was checked
    saved = json.loads((ckpt.ref.step_dir / "integrity" / "metadata").read_text())
    assert saved["json_sha256"] == {
        "config": json_sha256(ckpt.config), "quant_stats": json_sha256(ckpt.quant_stats)
    }  # fmt: skip
    out = tmp_path / "hf"
    export_hf(run_dir, out, layout="modelopt")
    copy = shutil.copytree(run_dir, tmp_path / "copy")
    config = copy / "checkpoints" / ckpt.ref.step_dir.name / "config" / "metadata"
    edited = json.loads(config.read_text())
    edited["model"]["rms_norm_eps"] = 1e-3
    config.write_text(json.dumps(edited))
    with pytest.raises(ExportError, match=r"its 'config' item differs from the checksum"):
        export_hf(copy, tmp_path / "edited", layout="modelopt")
    assert not (tmp_path / "edited").exists()
    assert main(["verify", str(out), "--against", str(copy)]) == 2
    assert "its 'config' item differs from the checksum" in capsys.readouterr().err
