"""metrics.jsonl rows, TensorBoard events and the progress display."""

from __future__ import annotations

import io
import json
import math
import struct
from pathlib import Path

import pytest

from nvfp4_train.observe.metrics import (
    MetricsFile,
    PlainProgress,
    RichProgress,
    TensorBoard,
    format_row,
    make_progress,
    read_metrics,
    summarize_window,
    truncate_metrics,
)


def _steps(*losses: float) -> list[dict[str, float]]:
    return [
        {"loss": v, "grad_norm": 2 * v, "lr": 0.1 * i, "skipped": 0} for i, v in enumerate(losses)
    ]


def test_summarize_window_means_and_rates():
    row = summarize_window(
        _steps(1.0, 2.0, 3.0, 6.0), step=40, seconds=2.0, tokens=4000, skipped_total=3
    )
    assert row == {
        "step": 40,
        "loss": 3.0,
        "lr": pytest.approx(0.3),
        "grad_norm": 6.0,
        "tokens_per_s": 2000.0,
        "step_time_s": 0.5,
        "skipped_steps": 3,
    }
    json.dumps(row)  # plain Python types only


def test_summarize_window_rejects_empty_window():
    with pytest.raises(ValueError, match="at least one step"):
        summarize_window([], step=1, seconds=1.0, tokens=1, skipped_total=0)


def test_format_row_shows_the_fields_present():
    assert format_row({"step": 5, "val_loss": 1.25}) == "step 5  val_loss 1.2500"
    line = format_row(
        summarize_window(_steps(2.5), step=7, seconds=1.0, tokens=100, skipped_total=0)
    )
    assert line.startswith("step 7  loss 2.5000  lr 0.00e+00") and "tok/s 100" in line


def test_metrics_file_appends_and_flushes_each_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = MetricsFile(path)
    writer.append({"step": 1, "loss": 3.0})
    assert read_metrics(path) == [{"step": 1, "loss": 3.0}]  # visible before close
    writer.append({"step": 2, "loss": math.nan, "val_loss": math.inf})
    writer.close()
    assert read_metrics(path)[1] == {"step": 2, "loss": None, "val_loss": None}
    again = MetricsFile(path)  # append mode: a resumed run keeps earlier rows
    again.append({"step": 3, "loss": 1.0})
    again.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_read_missing_metrics_is_empty(tmp_path):
    assert read_metrics(tmp_path / "none.jsonl") == []


def test_truncate_metrics_drops_rows_after_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (2, 4, 6, 8)))
    assert truncate_metrics(path, 4) == 2
    assert [r["step"] for r in read_metrics(path)] == [2, 4]
    assert truncate_metrics(path, 4) == 0


def read_scalars(logdir) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files under `logdir` (TFRecord framing)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = []
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            scalars += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return scalars


def test_tensorboard_writes_scalars(tmp_path):
    board = TensorBoard(tmp_path)
    board.write({"step": 3, "loss": 2.0, "val_loss": 2.5, "source": "x"})
    board.write({"step": 6, "loss": 1.5})
    board.close()
    assert read_scalars(tmp_path) == [
        ("train/loss", 3, 2.0), ("val/loss", 3, 2.5), ("train/loss", 6, 1.5),
    ]  # fmt: skip


def test_tensorboard_event_file_exists(tmp_path):
    board = TensorBoard(tmp_path / "tb")
    board.write({"step": 1, "loss": 1.0})
    board.close()
    files = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1 and files[0].stat().st_size > 0


def test_plain_progress_prints_rows_only():
    out = io.StringIO()
    progress = make_progress("auto", total=10, stream=out)  # StringIO is not a terminal
    assert isinstance(progress, PlainProgress)
    progress.update(1)
    progress.update(2, {"step": 2, "loss": 1.5})
    progress.message("hello")
    progress.close()
    assert out.getvalue() == "[2/10] step 2  loss 1.5000\nhello\n"


def test_rich_progress_renders_loss():
    out = io.StringIO()
    progress = make_progress("rich", total=10, initial=2, stream=out)
    assert isinstance(progress, RichProgress)
    progress.update(5, {"step": 5, "loss": 1.2345, "tokens_per_s": 999.0})
    progress.update(6, {"step": 6, "loss": 1.0, "val_loss": 0.75})
    progress.close()
    text = out.getvalue()
    assert "1.0000" in text and "val_loss 0.7500" in text


def test_make_progress_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode must be"):
        make_progress("fancy", total=1, stream=io.StringIO())  # type: ignore[arg-type]
