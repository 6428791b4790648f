"""Loss-curve plots of several runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvfp4_train.observe.plot import ema, loss_series, plot_runs, run_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(run_dir, recipe: str, scale: float) -> None:
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"precision:\n  recipe: {recipe}\n")
    rows = [{"step": s, "loss": scale * 5.0 / s} for s in range(1, 41)]
    rows += [{"step": s, "loss": scale / s, "val_loss": scale * 5.5 / s} for s in (20, 40)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_ema_matches_hand_computation():
    np.testing.assert_allclose(ema([1.0, 3.0], 0.5), [0.5 / 0.5, (0.25 + 1.5) / 0.75])
    np.testing.assert_allclose(ema([4.0, 2.0, 7.0], 0.0), [4.0, 2.0, 7.0])
    with pytest.raises(ValueError, match="alpha must be in"):
        ema([1.0], 1.0)


def test_ema_bias_correction_keeps_a_constant_series():
    np.testing.assert_allclose(ema([2.0] * 5, 0.9), [2.0] * 5)


def test_loss_series_skips_rows_without_the_key_and_nulls():
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "val_loss": 2.0}, {"step": 3, "loss": None}]
    steps, values = loss_series(rows, "loss")
    assert steps.tolist() == [1.0] and values.tolist() == [3.0]
    steps, values = loss_series(rows, "val_loss")
    assert steps.tolist() == [2.0] and values.tolist() == [2.0]
    assert loss_series([], "loss")[0].shape == (0,)


def test_run_label_uses_recipe(tmp_path):
    _fake_run(tmp_path / "a", "bf16", 1.0)
    assert run_label(tmp_path / "a") == "a (bf16)"
    (tmp_path / "b").mkdir()
    assert run_label(tmp_path / "b") == "b"


def test_plot_runs_writes_png(tmp_path):
    _fake_run(tmp_path / "bf16", "bf16", 1.0)
    _fake_run(tmp_path / "nvfp4", "nvfp4", 1.1)
    out = plot_runs([tmp_path / "bf16", tmp_path / "nvfp4"], tmp_path / "plots" / "loss.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_runs_errors_name_the_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="has no loss rows"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")


def test_cli_plot_output_keeps_a_users_file_and_needs_a_format_matplotlib_writes(tmp_path, capsys):
    """`plot -o` refuses a file it did not write (eval -o's wording), replaces its own PNG, and
    refuses an extension matplotlib cannot write before drawing anything."""
    from nvfp4_train.cli import main

    _fake_run(tmp_path / "run", "bf16", 1.0)
    mine = tmp_path / "mine.png"
    mine.write_bytes(PNG_MAGIC + b"a user's picture")
    assert main(["plot", str(tmp_path / "run"), "-o", str(mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {str(mine)!r} exists; not overwriting it (remove it or choose -o)"
    assert mine.read_bytes() == PNG_MAGIC + b"a user's picture"
    ours = tmp_path / "ours.png"
    for _ in range(2):  # the second time replaces the first's PNG
        assert main(["plot", str(tmp_path / "run"), "-o", str(ours)]) == 0
        assert ours.read_bytes().startswith(PNG_MAGIC)
    assert main(["plot", str(tmp_path / "run"), "-o", str(tmp_path / "loss.pdf")]) == 0
    capsys.readouterr()
    notes = tmp_path / "out" / "notes.txt"
    assert main(["plot", str(tmp_path / "run"), "-o", str(notes)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: -o {str(notes)!r}: matplotlib cannot write '.txt' files; use")
    assert ".pdf" in err and ".png" in err and ".svg" in err and len(err.splitlines()) == 1
    assert not notes.parent.exists()  # checked before anything is drawn
