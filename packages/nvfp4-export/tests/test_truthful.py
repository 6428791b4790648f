"""Export and verify tell the truth: a checkpoint or export that is not what was written is
refused or reported, and what could not be checked is said (docs/when-things-go-wrong.md,
"Nothing silent"). One small run and three small exports, shared; tampering is done on copies
at the file level."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    SMALL_MODEL,
    VOCAB,
    add_pytree_item,
    model_config,
    set_scalar_and_reseal,
    write_run,
)

from nvfp4_export import (
    ExportError,
    export_hf,
    forward,
    load_export,
    read_checkpoint,
    resolve_checkpoint,
    spec_from_config,
    verify,
)
from nvfp4_export.checkpoint import CONFIG_ITEM, INTEGRITY_ITEM, JSON_CHECKSUMS, QUANT_STATS_ITEM
from nvfp4_export.cli import main
from nvfp4_export.json_files import file_sha256
from nvfp4_export.manifest import MANIFEST, OLDER_VERSION
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import weights_from_checkpoint
from nvfp4_export.verify import render
from nvfp4_format.safetensors_header import read_safetensors_header
from nvfp4_format.safetensors_index import read_safetensors_index


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Block 0 NVFP4, block 1 BF16; a `reference` item of 2 sequences (for --calibrate)."""
    run = write_run(tmp_path_factory.mktemp("truth") / "run", model=model_config(**SMALL_MODEL))
    ckpt = read_checkpoint(resolve_checkpoint(run))
    spec = spec_from_config(ckpt.config, ckpt.params)
    weights = weights_from_checkpoint(ckpt, spec, linear_recipes(spec, ckpt.config, None), {})
    tokens = np.random.default_rng(5).integers(0, VOCAB, size=(2, 16)).astype(np.int32)
    reference = {"tokens": tokens, "logits": forward(weights, tokens)}
    add_pytree_item(_step_dir(run), "reference", reference)
    return run


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("truth_exports")
    return {
        "modelopt": export_hf(run, root / "mo", layout="modelopt").out_dir,
        "sharded": export_hf(run, root / "sh", layout="modelopt", max_shard_bytes=4000).out_dir,
        "compressed-tensors": export_hf(run, root / "ct", layout="compressed-tensors").out_dir,
    }


def _step_dir(run: Path) -> Path:
    return run / "checkpoints" / "2"


def _edit_json(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def _flip_tensor_byte(export_dir: Path, tensor: str) -> str:
    """Flips the lowest bit of a tensor's first byte in whichever weight file holds it."""
    index = export_dir / "model.safetensors.index.json"
    file = read_safetensors_index(index).weight_map[tensor] if index.is_file() else None
    path = export_dir / (file or "model.safetensors")
    begin = read_safetensors_header(path).tensors[tensor].begin
    data = bytearray(path.read_bytes())
    data[begin] ^= 0x01
    path.write_bytes(bytes(data))
    return path.name


# --- 8: the checkpoint's config and quant_stats are covered by its checksums ---------------


def test_8_a_config_or_recipe_edited_after_training_is_refused(run, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    config = _step_dir(copy) / CONFIG_ITEM / "metadata"
    original = config.read_text()
    edits = {"rms_norm_eps": 1e-3, "num_heads": 1, "rope_theta": 5e5, "max_seq_len": 4096}
    for key, value in edits.items():
        _edit_json(config, lambda c, key=key, value=value: c["model"].update({key: value}))
        with pytest.raises(ExportError, match=r"its 'config' item differs from the checksum"):
            export_hf(copy, tmp_path / "out", layout="modelopt")
        config.write_text(original)
    stats = _step_dir(copy) / QUANT_STATS_ITEM / "metadata"
    original_stats = stats.read_text()
    _edit_json(stats, lambda s: s.update({"recipes": {"layers.1.attn.qkv": "nvfp4"}}))
    with pytest.raises(ExportError, match=r"its 'quant_stats' item differs from the checksum"):
        export_hf(copy, tmp_path / "out", layout="modelopt")
    assert not (tmp_path / "out").exists()
    # on purpose (a longer context): --no-integrity-check exports it, loudly
    stats.write_text(original_stats)
    _edit_json(config, lambda c: c["model"].update({"max_seq_len": 64}))
    out = str(tmp_path / "out")
    assert main(["hf", str(copy), out, "--layout", "modelopt", "--no-integrity-check"]) == 0
    assert "warning: INTEGRITY NOT CHECKED (--no-integrity-check)" in capsys.readouterr().err
    assert load_export(out).config["max_position_embeddings"] == 64


def test_8_a_checkpoint_without_integrity_is_refused_unless_asked(run, exports, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    shutil.rmtree(_step_dir(copy) / INTEGRITY_ITEM)
    assert main(["hf", str(copy), str(tmp_path / "out"), "--layout", "modelopt"]) == 2
    err = capsys.readouterr().err
    assert "has no 'integrity' item" in err and "--no-integrity-check" in err
    assert not (tmp_path / "out").exists()
    against = ["verify", str(exports["modelopt"]), "--against", str(copy)]
    assert main(against) == 2
    assert "has no 'integrity' item" in capsys.readouterr().err
    assert main([*against, "--no-integrity-check"]) == 0
    text = capsys.readouterr().out
    assert "result: NO PROBLEM FOUND, NOT FULLY CHECKED (INTEGRITY NOT CHECKED" in text
    assert "result: OK" not in text
    out = tmp_path / "unchecked"
    assert main(["hf", str(copy), str(out), "--layout", "modelopt", "--no-integrity-check"]) == 0
    assert "warning: INTEGRITY NOT CHECKED" in capsys.readouterr().err
    report = verify(out)  # the export remembers that its source was not checked
    assert report.ok and not report.complete
    assert "exported without its integrity check" in render(report)


def test_8_a_checkpoint_from_before_config_checksums_exports_with_a_notice(run, tmp_path, capsys):
    copy = shutil.copytree(run, tmp_path / "run")
    _edit_json(_step_dir(copy) / INTEGRITY_ITEM / "metadata", lambda i: i.pop(JSON_CHECKSUMS))
    assert main(["hf", str(copy), str(tmp_path / "out"), "--layout", "modelopt"]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "not checked" in line]
    assert len(notices) == 1 and "config not checked" in notices[0], notices
    report = verify(tmp_path / "out", against=copy)
    assert report.ok and any("config not checked" in u for u in report.unchecked)


# --- 9: verify without --against: "OK" means the files are the ones written -------------------


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.0.self_attn.q_proj.weight",  # FP4 codes (block 0 is NVFP4)
        "model.layers.1.self_attn.q_proj.weight",  # a BF16 weight (block 1)
        "model.layers.0.mlp.down_proj.weight_scale",  # a block scale
        "model.embed_tokens.weight",
    ],
)
def test_9_verify_alone_catches_a_flipped_byte_in_any_tensor(exports, tmp_path, tensor):
    copy = shutil.copytree(exports["modelopt"], tmp_path / "copy")
    assert verify(copy).ok  # the copy itself passes
    _flip_tensor_byte(copy, tensor)
    report = verify(copy)
    assert not report.ok
    assert "model.safetensors is not the file the export wrote (its SHA-256 differs)" in (
        report.problems
    )


def test_9_verify_alone_catches_a_flipped_byte_in_a_sharded_export(exports, tmp_path):
    copy = shutil.copytree(exports["sharded"], tmp_path / "copy")
    shard = _flip_tensor_byte(copy, "model.layers.0.mlp.gate_proj.weight")
    assert shard.startswith("model-0") and "-of-" in shard
    report = verify(copy)
    assert f"{shard} is not the file the export wrote (its SHA-256 differs)" in report.problems


def test_9_verify_alone_catches_an_edited_config_and_manifest(exports, tmp_path, capsys):
    copy = shutil.copytree(exports["modelopt"], tmp_path / "copy")
    _edit_json(copy / "config.json", lambda c: c.update({"rms_norm_eps": 1e-6}))
    assert main(["verify", str(copy)]) == 1
    text = capsys.readouterr().out
    assert "PROBLEM: config.json is not the file the export wrote" in text
    assert "PROBLEM: config.json rms_norm_eps is 1e-06, but the exported model has 1e-05" in text
    _edit_json(copy / MANIFEST, lambda m: m["input_amax"].update({"layers.0.attn.qkv": 9.0}))
    assert f"{MANIFEST} is not the one the export wrote (its SHA-256 differs)" in (
        verify(copy).problems
    )


def test_9_the_manifest_seals_every_file_and_an_older_export_is_never_plain_ok(exports, tmp_path):
    manifest = json.loads((exports["sharded"] / MANIFEST).read_text())
    files = sorted(p.name for p in exports["sharded"].iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == files and len(files) > 9  # shards, index, tokenizer, ...
    index = exports["sharded"] / "model.safetensors.index.json"
    assert manifest["files"][index.name]["sha256"] == file_sha256(index)
    assert manifest["spec"]["rms_norm_eps"] == 1e-5
    copy = shutil.copytree(exports["modelopt"], tmp_path / "copy")
    _edit_json(copy / MANIFEST, lambda m: [m.pop("files"), m.pop("manifest_sha256")])
    report = verify(copy)
    assert report.ok and not report.complete and report.unchecked == (OLDER_VERSION,)
    assert f"result: NO PROBLEM FOUND, NOT FULLY CHECKED ({OLDER_VERSION})" in render(report)
    assert "result: OK" not in render(report)


# --- 10: verify --against compares config.json field by field and loads the tokenizer ---------

EDITED_FIELDS = {
    "max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    "rope_theta": 5e5, "tie_word_embeddings": True, "hidden_act": "gelu", "rms_norm_eps": 1e-6,
    "num_hidden_layers": 1, "num_key_value_heads": 2, "vocab_size": 300,
}  # fmt: skip


def test_10_verify_against_names_each_edited_config_field_and_a_broken_tokenizer(
    run, exports, tmp_path
):
    copy = shutil.copytree(exports["modelopt"], tmp_path / "copy")
    _edit_json(copy / "config.json", lambda c: c.update(EDITED_FIELDS))
    (copy / "tokenizer.json").write_text("{{")
    report = verify(copy, against=run)
    assert not report.ok
    for field in EDITED_FIELDS:
        assert any(p.startswith(f"config.json {field} is ") for p in report.problems), field
    assert any(p.startswith("tokenizer.json does not load") for p in report.problems)


def test_10_an_edited_head_count_is_a_problem_not_a_transformers_traceback(
    run, exports, tmp_path, capsys
):
    copy = shutil.copytree(exports["compressed-tensors"], tmp_path / "copy")
    _edit_json(copy / "config.json", lambda c: c.update({"num_key_value_heads": 2}))
    assert main(["verify", str(copy), "--against", str(run)]) == 1
    captured = capsys.readouterr()
    assert "PROBLEM: config.json num_key_value_heads is 2, but the exported model has 1" in (
        captured.out
    )
    assert "Traceback" not in captured.out + captured.err


# --- issue 48: verify compares every exported input scale tensor with the run's amax ---------

W4A4_LINE = "export reload, W4A4 with the input scale tensors of the files"


@pytest.mark.parametrize(
    ("layout", "suffix"),
    [("modelopt", "input_scale"), ("compressed-tensors", "input_global_scale")],
)
def test_48_a_wrong_input_scale_under_a_resealed_manifest_fails_naming_it(
    run, exports, tmp_path, layout, suffix
):
    tensor = f"model.layers.0.self_attn.o_proj.{suffix}"
    before = verify(exports[layout], against=run)
    assert before.ok, before
    copy = shutil.copytree(exports[layout], tmp_path / "copy")
    set_scalar_and_reseal(copy, tensor, 1e6)
    assert verify(copy).problems != ()  # without --against: against the manifest's amax
    report = verify(copy, against=run)
    assert not report.ok and not any("SHA-256" in p for p in report.problems), report.problems
    (problem,) = [p for p in report.problems if p.startswith(tensor)]
    assert f"{tensor} is 1000000, expected " in problem and "quant_stats" in problem
    # the W4A4 line quantizes activations with the scales read from the files, not the manifest
    w4a4 = [{c.name: c for c in r.comparisons}[W4A4_LINE] for r in (before, report)]
    assert w4a4[0].max_abs != w4a4[1].max_abs


# --- 13: --calibrate says how many sequences it used ---------------------------------------------


def test_13_calibrate_says_how_many_sequences_it_used(run, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["hf", str(run), str(out), "--layout", "modelopt", "--calibrate", "100000"]) == 0
    captured = capsys.readouterr()
    assert "calibrating input scales on 2 sequences of 16 tokens from the checkpoint's" in (
        captured.err
    )
    assert "warning: calibrated on 2 sequences, fewer than the 100000 asked" in captured.err
    assert "input scales from 2 calibration sequences" in captured.out
    calibration = load_export(out).provenance["calibration"]
    assert calibration == {
        "sequences": 2, "requested": 100000, "tokens_per_sequence": 16, "from": "reference"
    }  # fmt: skip
    report = verify(out, against=run)  # calibrated scales: checked against the manifest's amax
    assert report.ok and any("does not repeat" in s for s in report.skipped), report
