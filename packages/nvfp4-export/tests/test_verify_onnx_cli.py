"""The NumPy forward, verify (reference item, broken exports), ONNX and the CLI."""

import importlib.util

import numpy as np
import pytest
from conftest import add_pytree_item, write_run

from nvfp4_export import (
    export_hf,
    forward,
    read_checkpoint,
    resolve_checkpoint,
    spec_from_config,
    verify,
)
from nvfp4_export.cli import main
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import load_export, weights_from_checkpoint, weights_from_export

needs_ort = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="onnx / onnxruntime not installed",
)


def _trained_weights(run):
    ckpt = read_checkpoint(resolve_checkpoint(run))
    spec = spec_from_config(ckpt.config, ckpt.params)
    return weights_from_checkpoint(ckpt, spec, linear_recipes(spec, ckpt.config, None), {})


def test_forward_is_causal_and_activation_quantization_changes_logits(tiny_run):
    w = _trained_weights(tiny_run)
    tokens = np.random.default_rng(0).integers(0, 257, size=(2, 12))
    # weight-only is causal; dynamic per-tensor activation scaling (as in training) couples positions
    a = forward(w, tokens, activations="none")
    changed = tokens.copy()
    changed[:, 8] = (changed[:, 8] + 1) % 257
    b = forward(w, changed, activations="none")
    np.testing.assert_array_equal(a[:, :8], b[:, :8])
    assert not np.allclose(a[:, 8:], b[:, 8:])
    assert np.abs(a - forward(w, tokens)).max() > 1e-3
    with pytest.raises(ValueError, match="token ids must be in"):
        forward(w, tokens + 300)


def test_verify_against_a_reference_item_passes_and_catches_wrong_logits(tmp_path):
    run = write_run(tmp_path / "run")
    tokens = np.random.default_rng(2).integers(0, 257, size=(3, 16)).astype(np.int32)
    logits = forward(_trained_weights(run), tokens)
    add_pytree_item(run / "checkpoints" / "2", "reference", {"tokens": tokens, "logits": logits})
    out = export_hf(run, tmp_path / "mo", layout="modelopt").out_dir  # (transformers: integration)
    report = verify(out, against=run)
    assert report.ok, report
    first = report.comparisons[0]
    assert first.against.startswith("JAX reference") and first.top1 >= 0.9
    wrong = write_run(tmp_path / "wrong", seed=7)
    add_pytree_item(
        wrong / "checkpoints" / "2", "reference", {"tokens": tokens, "logits": logits[::-1].copy()}
    )
    bad = verify(out, against=wrong)
    assert not bad.ok
    emulation = {c.name: c for c in bad.comparisons}["NumPy emulation of the trained model"]
    assert emulation.passed is False and not emulation.note  # a failure for a dense model
    assert any("differs from the checkpoint" in p for p in bad.problems)


def test_export_reload_matches_the_trained_forward_up_to_bf16_norms(tiny_run, tmp_path):
    out = export_hf(tiny_run, tmp_path / "mo", layout="modelopt").out_dir
    tokens = np.random.default_rng(3).integers(0, 257, size=(2, 16))
    ref = forward(_trained_weights(tiny_run), tokens)
    got = forward(weights_from_export(load_export(out)), tokens)
    assert np.mean(np.abs(got - ref)) < 0.05 * np.mean(np.abs(ref))


@needs_ort
def test_onnx_portable_runs_on_onnxruntime_and_dq_form_checks(tiny_run, tmp_path):
    from nvfp4_export import export_onnx

    path = export_onnx(tiny_run, tmp_path / "m.onnx")
    report = verify(path, against=tiny_run)
    assert report.ok and report.comparisons[0].max_abs < 1e-3, report
    import onnx

    model = onnx.load(str(path))
    assert model.ir_version == 8 and model.opset_import[0].version == 18
    packed = [
        t
        for t in model.graph.initializer
        if t.data_type == onnx.TensorProto.UINT8 and t.name.endswith("packed_1") is False
    ]
    assert packed, "packed uint8 weights stay in the file"
    dq = export_onnx(tiny_run, tmp_path / "dq.onnx", form="dq")
    dq_model = onnx.load(str(dq))
    assert dq_model.ir_version == 11 and dq_model.opset_import[0].version == 23
    assert any(t.data_type == onnx.TensorProto.FLOAT4E2M1 for t in dq_model.graph.initializer)
    onnx.checker.check_model(dq_model)


def test_cli_export_verify_and_errors(tiny_run, tmp_path, capsys):
    out = tmp_path / "mo"
    assert main(["hf", str(tiny_run), str(out), "--layout", "modelopt", "--step", "2"]) == 0
    assert "W4A4" in capsys.readouterr().out
    assert main(["verify", str(out), "--against", str(tiny_run)]) == 0
    assert "result: OK" in capsys.readouterr().out
    assert main(["hf", str(tiny_run), str(out), "--layout", "modelopt"]) == 2
    assert "already exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert main(["hf", str(tmp_path / "missing"), str(tmp_path / "x"), "--layout", "modelopt"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hf", str(tiny_run), str(tmp_path / "y"), "--layout", "gguf"])


def test_tied_float32_model_exports_and_verifies(tmp_path):
    from conftest import model_config

    run = write_run(tmp_path / "run", model=model_config(tie_embeddings=True, dtype="float32"))
    out = export_hf(run, tmp_path / "mo", layout="modelopt").out_dir
    loaded = load_export(out)
    assert "lm_head.weight" not in loaded.tensors
    assert loaded.config["tie_word_embeddings"] is True
    report = verify(out, against=run)
    assert report.ok, report
