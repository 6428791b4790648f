"""The training loop in-process: outputs, bit-identical reruns, and resume from a checkpoint."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import yaml

from nvfp4_train.config import ConfigError, config_from_dict, load_config
from nvfp4_train.metrics import read_metrics
from nvfp4_train.run import evaluate_run, run

STEPS = 8
SECTIONS = {
    "train": {"steps": STEPS, "log_every": 1, "eval_every": 4},
    "checkpoint": {"every_steps": 4, "keep": 3},
}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_config):
    """The same config (NVFP4, stochastic rounding) trained twice in two run directories."""
    root = tmp_path_factory.mktemp("runs")
    outputs = []
    for name in ("a", "b"):
        cfg = config_from_dict(tiny_config(root / name, **SECTIONS))
        out = io.StringIO()
        summary = run(cfg, stream=out)
        outputs.append((summary, out.getvalue()))
    return root, outputs


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def test_run_writes_its_outputs(two_runs):
    root, [(summary, text), _] = two_runs
    run_dir = root / "a"
    assert summary.run_dir == run_dir and (summary.start_step, summary.final_step) == (0, STEPS)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "skipped_steps"):
        assert all(key in r for r in rows), key
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert summary.val_loss == rows[-1]["val_loss"] and summary.last_loss == rows[-1]["loss"]
    assert load_config(run_dir / "config.yaml").model.vocab_size == 64  # resolved from the data
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [
        "4",
        "8",
    ]
    stats = json.loads((run_dir / "checkpoints" / "8" / "quant_stats" / "metadata").read_text())
    assert stats["recipes"] == {
        "layers.0.attn.qkv": "nvfp4", "layers.0.attn.o": "nvfp4",
        "layers.0.mlp.gate_up": "nvfp4", "layers.0.mlp.down": "nvfp4",
    }  # fmt: skip
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert "parameters" in text and str(run_dir.resolve()) in text


def test_loss_falls(two_runs):
    root, _ = two_runs
    losses = [loss for _, loss in _losses(root / "a")]
    assert losses[-1] < losses[0] - 0.1


def test_rerun_with_same_seed_is_bit_identical(two_runs):
    root, _ = two_runs
    assert _losses(root / "a") == _losses(root / "b")
    val = [
        [r["val_loss"] for r in read_metrics(root / d / "metrics.jsonl") if "val_loss" in r]
        for d in "ab"
    ]
    assert val[0] == val[1]


def test_resume_continues_from_checkpoint_exactly(two_runs, tiny_config):
    """Drop run b's last checkpoint: rerunning resumes at step 4 and reproduces steps 5..8."""
    root, _ = two_runs
    shutil.rmtree(root / "b" / "checkpoints" / str(STEPS))
    out = io.StringIO()
    summary = run(config_from_dict(tiny_config(root / "b", **SECTIONS)), stream=out)
    assert (summary.start_step, summary.final_step) == (4, STEPS)
    assert "resumed from" in out.getvalue() and "(step 4)" in out.getvalue()
    assert "dropped 4 metrics rows" in out.getvalue()
    assert _losses(root / "b") == _losses(root / "a")


def test_rerun_of_a_finished_run_does_nothing(two_runs, tiny_config):
    root, _ = two_runs
    out = io.StringIO()
    summary = run(config_from_dict(tiny_config(root / "a", **SECTIONS)), stream=out)
    assert summary.start_step == summary.final_step == STEPS
    assert "nothing to do" in out.getvalue()
    assert len(read_metrics(root / "a" / "metrics.jsonl")) == STEPS


def test_resume_with_a_different_model_is_refused(two_runs, tiny_config):
    root, _ = two_runs
    cfg = config_from_dict(tiny_config(root / "a", **SECTIONS), ["model.mlp_dim=32"])
    with pytest.raises(ConfigError, match=r"different run \(model\.mlp_dim differ\)"):
        run(cfg, stream=io.StringIO())


def test_evaluate_run_appends_a_row(two_runs):
    root, _ = two_runs
    out = io.StringIO()
    row = evaluate_run(root / "a", stream=out)
    rows = read_metrics(root / "a" / "metrics.jsonl")
    assert rows[-1] == row and row["step"] == STEPS and row["source"] == "eval"
    trained = [r["val_loss"] for r in rows if "val_loss" in r and "loss" in r][-1]
    assert row["val_loss"] == pytest.approx(trained, rel=1e-6)
    assert out.getvalue().startswith(f"step {STEPS}  val_loss")


def test_evaluate_run_errors(tmp_path, tiny_config):
    with pytest.raises(ConfigError, match="is not a run directory"):
        evaluate_run(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config(tmp_path)))
    with pytest.raises(ConfigError, match="has no checkpoint"):
        evaluate_run(tmp_path)
