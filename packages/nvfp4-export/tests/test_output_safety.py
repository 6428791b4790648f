"""Nothing a user wrote is lost: the export never deletes its source, only ever replaces a previous
export, leaves no partial output, writes files others can read, and verify catches flipped bytes."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct
import subprocess
import sys

import pytest
from conftest import write_run

from nvfp4_export import ExportError, export_hf, verify
from nvfp4_export.cli import main
from nvfp4_export.onnx_export import export_onnx
from nvfp4_export.output_dir import remove_leftovers


@pytest.fixture
def run(tmp_path):
    return write_run(tmp_path / "run", steps=(2,))


def _contents(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("out", [".", "checkpoints", "checkpoints/2", "checkpoints/2/x", ".."])
def test_the_output_is_never_the_checkpoint_or_around_it(run, out, capsys):
    before = _contents(run)
    target = run if out == "." else run / out
    code = main(["hf", str(run), str(target), "--layout", "modelopt", "--overwrite"])
    assert code == 2
    assert "would overwrite the checkpoint it is exported from" in capsys.readouterr().err
    assert _contents(run) == before


def test_an_output_inside_the_run_but_outside_its_checkpoints_is_fine(run):
    result = export_hf(run, run / "export", layout="modelopt")
    assert (result.out_dir / "nvfp4_export.json").is_file()


def test_overwrite_replaces_only_a_previous_export(run, tmp_path):
    user_dir = tmp_path / "my-notes"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="is not an nvfp4-export export"):
        export_hf(run, user_dir, layout="modelopt", overwrite=True)
    assert (user_dir / "notes.txt").read_text() == "mine"
    first = export_hf(run, tmp_path / "out", layout="modelopt").out_dir
    second = export_hf(run, first, layout="compressed-tensors", overwrite=True).out_dir
    assert json.loads((second / "nvfp4_export.json").read_text())["layout"] == "compressed-tensors"
    user_file = tmp_path / "model.onnx"
    user_file.write_bytes(b"not onnx")
    with pytest.raises(ExportError, match="is not an nvfp4-export export"):
        export_onnx(run, user_file, overwrite=True)
    assert user_file.read_bytes() == b"not onnx"


def test_relative_paths_work_as_the_readme_writes_them(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["hf", "run", "out", "--layout", "compressed-tensors"]) == 0
    assert main(["verify", "out", "--against", "run"]) == 0
    assert "result: OK" in capsys.readouterr().out


def test_exports_are_readable_by_others_like_any_file(run, tmp_path):
    old = os.umask(0o022)
    try:
        out = export_hf(run, tmp_path / "out", layout="modelopt").out_dir
        onnx = export_onnx(run, tmp_path / "model.onnx")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()} == {0o644}
    assert stat.S_IMODE(onnx.stat().st_mode) == 0o644


def test_leftovers_of_a_killed_export_are_cleaned_by_the_next(run, tmp_path):
    # a child that dies after creating its temporary sibling, as a SIGKILLed export would
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(child.stdout)
    host = __import__("socket").gethostname().replace("-", "_")
    leftover = tmp_path / f".out.tmp-{host}-{dead}-abcd1234"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    alive = tmp_path / f".out.tmp-{host}-{os.getpid()}-live0000"  # a running export's: kept
    alive.mkdir()
    export_hf(run, tmp_path / "out", layout="modelopt")
    assert not leftover.exists() and alive.exists()
    assert remove_leftovers(tmp_path / "out") == []


def test_a_failed_write_is_a_sentence_and_leaves_nothing(run, tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(ExportError, match=r"cannot write output .*Read-only file system"):
        export_hf(run, tmp_path / "out", layout="modelopt")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_a_symlink_loop_is_called_a_loop(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(ExportError, match="is a loop of symbolic links"):
        export_hf(tmp_path / "loop", tmp_path / "out", layout="modelopt")


def _flip(export_dir, tensor, byte_offset=0, mask=0x01, value=None):
    """Flip bits of (or set) one byte of a tensor in the export's safetensors file."""
    path = export_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    start = 8 + n + json.loads(data[8 : 8 + n])[tensor]["data_offsets"][0] + byte_offset
    data[start] = value if value is not None else data[start] ^ mask
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "tensor",
    [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",  # a BF16 layer
        "model.layers.1.mlp.down_proj.weight_packed",
    ],
)
def test_verify_catches_one_flipped_bit_in_any_tensor(run, tmp_path, tensor):
    out = export_hf(run, tmp_path / "out", layout="compressed-tensors").out_dir
    _flip(out, tensor)
    report = verify(out, against=run)
    assert not report.ok
    assert any(tensor.rsplit(".", 1)[0] in p for p in report.problems), report.problems


def test_nan_scales_are_a_problem_not_a_traceback(run, tmp_path, capsys):
    out = export_hf(run, tmp_path / "out", layout="modelopt").out_dir
    _flip(out, "model.layers.1.mlp.down_proj.weight_scale", value=0x7F)  # E4M3 NaN
    assert main(["verify", str(out), "--against", str(run)]) == 1
    text = capsys.readouterr().out
    assert "PROBLEM: model.layers.1.mlp.down_proj.weight_scale: 1 NaN or Inf value(s)" in text
    assert "result: FAILED" in text


def test_a_copied_export_directory_is_still_an_export(run, tmp_path):
    out = export_hf(run, tmp_path / "out", layout="modelopt").out_dir
    copy = shutil.copytree(out, tmp_path / "copy")
    export_hf(run, copy, layout="modelopt", overwrite=True)  # recognised by its manifest
