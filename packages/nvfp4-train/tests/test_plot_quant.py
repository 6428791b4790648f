"""Heat maps of the quantization telemetry: `plot_quant`, `quant_grid`, `nvfp4-train plot --quant`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nvfp4_train.cli import main
from nvfp4_train.observe.plot import plot_quant, plot_runs, quant_grid, row_label, run_pattern

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PATHS = ["layers.1.attn.qkv", "layers.1.mlp.down", "layers.10.attn.o", "layers.2.mlp.gate_up"]
ROLES = ("fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy")


def quant(step: int, rng: np.random.Generator) -> dict:
    return {
        path: {
            role: {
                "amax": float(rng.uniform(0.01, 5)),
                "underflow": 0.0 if role != "dgrad_dy" else float(rng.choice([0.0, 1e-4, 3e-2])),
                "saturation": float(rng.uniform(0.02, 0.05)),
                "rel_error": float(rng.uniform(0.08, 0.16)) + step * 1e-4,
            }
            for role in ROLES
        }
        for path in PATHS
    }


def write_run(run_dir, *, quant_steps=(10, 20, 30), loss_steps=(10, 20, 30)) -> None:
    rng = np.random.default_rng(0)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("precision:\n  recipe: nvfp4\n")
    rows = [{"step": s, "loss": 3.0 / s, "lr": 1e-3} for s in loss_steps]
    rows += [{"step": s, "quant": quant(s, rng)} for s in quant_steps]
    rows.append({"step": 30, "val_loss": 2.0, "source": "eval"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_quant_grid_orders_linears_by_model_order_and_steps(tmp_path):
    rows = [
        {"step": 20, "quant": {"layers.10.attn.o": {"fprop_x": {"rel_error": 0.2}}}},
        {"step": 10, "loss": 1.0},
        {"step": 10, "quant": {
            "layers.2.mlp.down": {"fprop_x": {"rel_error": 0.1}, "wgrad_dy": {"rel_error": None}},
            "layers.2.attn.qkv": {"fprop_x": {"rel_error": 0.3}},
        }},
    ]  # fmt: skip
    paths, steps, grids = quant_grid(rows, "rel_error")
    assert paths == ["layers.2.attn.qkv", "layers.2.mlp.down", "layers.10.attn.o"]
    assert steps == [10, 20]
    assert list(grids) == ["fprop_x", "wgrad_dy"]
    np.testing.assert_array_equal(grids["fprop_x"], [[0.3, np.nan], [0.1, np.nan], [np.nan, 0.2]])
    assert np.isnan(grids["wgrad_dy"]).all()  # null (non-finite) and missing are NaN


def test_quant_grid_keeps_the_later_row_of_a_repeated_step():
    rows = [
        {"step": 10, "quant": {"layers.0.attn.o": {"fprop_x": {"underflow": 0.5}}}},
        {"step": 10, "quant": {"layers.0.attn.o": {"fprop_x": {"underflow": 0.25}}}},
    ]
    assert quant_grid(rows, "underflow")[2]["fprop_x"].tolist() == [[0.25]]


@pytest.mark.parametrize("stat", ["rel_error", "underflow", "saturation", "amax"])
def test_plot_quant_writes_a_png(tmp_path, stat):
    write_run(tmp_path / "run")
    out = plot_quant(tmp_path / "run", tmp_path / "plots" / f"{stat}.png", stat=stat)
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_plot_quant_errors_are_clear(tmp_path):
    write_run(tmp_path / "noquant", quant_steps=())
    with pytest.raises(ValueError, match="has no quantization telemetry rows; train with "
                                         "logging.quant_stats_every > 0"):  # fmt: skip
        plot_quant(tmp_path / "noquant", tmp_path / "q.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no metrics.jsonl"):
        plot_quant(tmp_path / "empty", tmp_path / "q.png")
    write_run(tmp_path / "run")
    with pytest.raises(ValueError, match="stat must be one of .* got 'err'"):
        plot_quant(tmp_path / "run", tmp_path / "q.png", stat="err")
    assert not (tmp_path / "q.png").exists()


def test_loss_plot_ignores_quant_rows(tmp_path):
    write_run(tmp_path / "run")
    assert plot_runs([tmp_path / "run"], tmp_path / "loss.png").read_bytes().startswith(PNG_MAGIC)
    write_run(tmp_path / "onlyquant", loss_steps=())
    rows = (tmp_path / "onlyquant" / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "onlyquant" / "metrics.jsonl").write_text(rows[0] + "\n")
    with pytest.raises(ValueError, match="has no loss rows"):
        plot_runs([tmp_path / "onlyquant"], tmp_path / "loss2.png")


def test_cli_plot_quant(tmp_path, capsys, monkeypatch):
    write_run(tmp_path / "run")
    out = tmp_path / "heat.png"
    assert (
        main(["plot", "--quant", str(tmp_path / "run"), "-o", str(out), "--stat", "saturation"])
        == 0
    )
    assert out.read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "--quant", "run"]) == 0
    assert (tmp_path / "run" / "quant.png").read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "quant.png").exists()


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--quant", "{run}", "{run}"], "plot --quant takes one RUN_DIR, got 2"),
        (["--quant", "{tmp}"], "has no metrics.jsonl"),
        (["--quant", "{run}", "--stat", "error"], "stat must be one of"),
    ],
)
def test_cli_plot_quant_user_errors(tmp_path, capsys, extra, needle):
    write_run(tmp_path / "run")
    values = {"run": tmp_path / "run", "tmp": tmp_path}
    assert main(["plot", *(a.format(**values) for a in extra)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_plot_quant_draws_a_hybrid_run_with_block_letters(tmp_path, monkeypatch):
    run = tmp_path / "hybrid"
    run.mkdir()
    (run / "config.yaml").write_text('model:\n  pattern: "M*-"\nprecision:\n  recipe: nvfp4\n')
    names = ["0.mamba.in_proj", "0.mamba.out_proj", "1.attn.qkv", "1.attn.o", "2.mlp.up",
             "2.mlp.down"]  # fmt: skip
    stats = {"fprop_x": {"rel_error": 0.1}, "wgrad_dy": {"rel_error": 0.12}}
    rows = [{"step": s, "quant": {f"layers.{n}": stats for n in reversed(names)},
             "ssm": {"layers.0": {"dt_min": 0.01, "dt_max": 0.1, "dt_mean": 0.05,
                                  "state_norm": 0.3}}} for s in (2, 4)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths, _, _ = quant_grid(rows, "rel_error")
    assert paths == [f"layers.{n}" for n in names]  # model order across the block kinds
    assert [row_label(p, run_pattern(run)) for p in paths[:3]] == ["0 M in_proj", "0 M out_proj",
                                                                   "1 * qkv"]  # fmt: skip
    labels = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.set_yticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_yticks",
                        lambda self, ticks, text=None, **kw: labels.append(text)
                        or original(self, ticks, text, **kw))  # fmt: skip
    assert plot_quant(run, tmp_path / "h.png").read_bytes().startswith(PNG_MAGIC)
    assert "2 - up" in labels[0] and "layers.2.mlp.up" not in labels[0]
