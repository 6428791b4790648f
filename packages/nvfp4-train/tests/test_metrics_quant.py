"""Telemetry rows in metrics.jsonl, TensorBoard and the progress line; readers of mixed files."""

from __future__ import annotations

import io
import json
import math

import numpy as np
from test_metrics import read_scalars

from nvfp4_train.observe.metrics import (
    MetricsFile,
    PlainProgress,
    TensorBoard,
    format_row,
    quant_row,
    read_metrics,
    summarize_quant,
    truncate_metrics,
)

STATS = {
    "layers.1.attn.qkv": {
        "fprop_x": {"amax": 3.5, "underflow": 0.0, "saturation": 0.034, "rel_error": 0.095},
        "wgrad_dy": {"amax": 1e-3, "underflow": 2e-4, "saturation": 0.036, "rel_error": 0.142},
    },
    "layers.2.mlp.down": {
        "dgrad_dy": {"amax": 2e-3, "underflow": 0.0, "saturation": 0.041, "rel_error": 0.13},
    },
}


def test_quant_row_holds_host_floats():
    row = quant_row(np.int32(40), {"layers.0.attn.o": {"fprop_x": {"amax": np.float32(2.5)}}})
    assert row == {"step": 40, "quant": {"layers.0.attn.o": {"fprop_x": {"amax": 2.5}}}}
    assert type(row["step"]) is int
    assert type(row["quant"]["layers.0.attn.o"]["fprop_x"]["amax"]) is float


def test_metrics_file_writes_nested_non_finite_as_null(tmp_path):
    path = tmp_path / "metrics.jsonl"
    metrics = MetricsFile(path)
    metrics.append({"step": 1, "loss": 2.0})
    metrics.append(
        quant_row(
            1,
            {
                "layers.0.attn.o": {
                    "dgrad_dy": {"amax": math.inf, "rel_error": math.nan, "underflow": 0.0}
                }
            },
        )
    )
    metrics.close()
    rows = read_metrics(path)
    assert rows[1] == {
        "step": 1,
        "quant": {"layers.0.attn.o": {"dgrad_dy": {"amax": None, "rel_error": None,
                                                   "underflow": 0.0}}},
    }  # fmt: skip
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()


def test_truncate_metrics_drops_quant_rows_after_the_checkpoint_too(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = []
    for s in (2, 4, 6, 8):
        rows += [{"step": s, "loss": 1.0 / s}, quant_row(s, STATS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert truncate_metrics(path, 4) == 4
    kept = read_metrics(path)
    assert [(r["step"], "quant" in r) for r in kept] == [
        (2, False), (2, True), (4, False), (4, True)
    ]  # fmt: skip
    assert kept[1]["quant"] == STATS


def test_tensorboard_writes_quant_scalars(tmp_path):
    board = TensorBoard(tmp_path)
    board.write(quant_row(5, {"layers.1.attn.qkv": {"fprop_x": {"amax": 3.5, "rel_error": None}}}))
    board.write({"step": 5, "loss": 2.0})
    board.close()
    assert read_scalars(tmp_path) == [
        ("quant/layers.1.attn.qkv/fprop_x/amax", 5, 3.5), ("train/loss", 5, 2.0),
    ]  # fmt: skip


def test_a_hybrid_rows_ssm_health_goes_to_the_row_and_tensorboard(tmp_path):
    ssm = {"layers.0": {"dt_min": np.float32(0.5), "state_norm": np.float32(2.0)}}
    row = quant_row(3, {"layers.0.mamba.in_proj": {"fprop_x": {"amax": 1.0}}}, ssm)
    assert row["ssm"] == {"layers.0": {"dt_min": 0.5, "state_norm": 2.0}}
    assert "ssm" not in quant_row(3, {}, {})  # no Mamba blocks: no field
    board = TensorBoard(tmp_path)
    board.write(row)
    board.close()
    assert ("ssm/layers.0/dt_min", 3, 0.5) in read_scalars(tmp_path)
    assert ("ssm/layers.0/state_norm", 3, 2.0) in read_scalars(tmp_path)


def test_tensorboard_tags_of_an_expert_have_no_brackets(tmp_path):
    board = TensorBoard(tmp_path)
    expert = {"fprop_x": {"amax": 1.5, "tokens": 7}, "fprop_w": {"amax": 0.5}}
    idle = {"fprop_x": {"amax": 0.0, "tokens": 0}, "fprop_w": {"amax": 0.25}}
    row = quant_row(
        3, {"layers.1.mlp.experts.down[2]": expert, "layers.1.mlp.experts.down[3]": idle}
    )
    board.write(row)
    board.close()
    assert sorted(read_scalars(tmp_path)) == [
        ("quant/layers.1.mlp.experts.down/2/fprop_w/amax", 3, 0.5),
        ("quant/layers.1.mlp.experts.down/2/fprop_x/amax", 3, 1.5),
        ("quant/layers.1.mlp.experts.down/2/fprop_x/tokens", 3, 7.0),
        ("quant/layers.1.mlp.experts.down/3/fprop_w/amax", 3, 0.25),  # no x row without tokens
    ]


def test_summarize_quant_names_the_worst_layer_and_the_largest_fractions():
    assert summarize_quant(STATS) == (
        "quant worst layers.1.attn.qkv wgrad_dy err 0.142  max uf 0.0002  sat 0.041"
    )


def test_summarize_quant_puts_non_finite_first():
    stats = {**STATS, "layers.3.attn.o": {"fprop_w": {"rel_error": None, "underflow": 0.0}}}
    assert summarize_quant(stats).startswith("quant worst layers.3.attn.o fprop_w err non-finite")
    assert summarize_quant({}) == "quant -"


def test_format_row_and_plain_progress_show_a_quant_row():
    row = quant_row(30, STATS)
    assert format_row(row) == f"step 30  {summarize_quant(STATS)}"
    stream = io.StringIO()
    PlainProgress(100, 0, stream).update(30, row)
    assert stream.getvalue() == f"[30/100] step 30  {summarize_quant(STATS)}\n"
