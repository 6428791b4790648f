"""The training loop: outputs, bit-identical reruns, resume from a checkpoint, evaluation."""

from __future__ import annotations

import io
import json
import shutil

import jax
import numpy as np
import pytest
import yaml
from run_reading import train_losses

from nvfp4_train.config.run_config import ConfigError, config_from_dict, load_config
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.training.evaluation import evaluate_run
from nvfp4_train.training.run import run

RUN_STEPS = 8  # conftest's trained_runs: checkpoints at 4 and 8, evaluation at 4 and 8


def _config(trained_runs, tiny_config, run_dir, *overrides: str):
    return config_from_dict(tiny_config(run_dir, **trained_runs.sections), overrides)


def test_run_writes_its_outputs(trained_runs):
    assert trained_runs.steps == RUN_STEPS
    run_dir, summary = trained_runs.api_dir, trained_runs.api_summary
    assert summary.run_dir == run_dir and (summary.start_step, summary.final_step) == (0, RUN_STEPS)
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, RUN_STEPS + 1))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "skipped_steps"):
        assert all(key in r for r in rows), key
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    assert summary.val_loss == rows[-1]["val_loss"] and summary.last_loss == rows[-1]["loss"]
    assert load_config(run_dir / "config.yaml").model.vocab_size == 64  # resolved from the data
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == RUN_STEPS and 4 in steps
    stats = json.loads((run_dir / "checkpoints" / "8" / "quant_stats" / "metadata").read_text())
    assert stats["recipes"] == {
        "layers.0.attn.qkv": "nvfp4", "layers.0.attn.o": "nvfp4",
        "layers.0.mlp.gate_up": "nvfp4", "layers.0.mlp.down": "nvfp4",
    }  # fmt: skip
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert "parameters" in trained_runs.api_output
    assert str(run_dir.resolve()) in trained_runs.api_output


def _items(step_dir):
    """(quant_stats, reference) of a checkpoint, read with plain orbax (no target)."""
    import orbax.checkpoint as ocp

    stats = json.loads((step_dir / "quant_stats" / "metadata").read_text())
    return stats, ocp.StandardCheckpointer().restore((step_dir / "reference").absolute())


def test_checkpoints_hold_activation_amax_and_reference(trained_runs):
    ckpts = trained_runs.api_dir / "checkpoints"
    stats4, _ = _items(ckpts / "4")
    stats, reference = _items(ckpts / str(RUN_STEPS))
    paths = sorted(stats["recipes"])
    assert sorted(stats["activation_amax"]) == paths and len(paths) == 4
    for path in paths:  # a running max: finite, positive, never falling
        assert 0 < stats4["activation_amax"][path] <= stats["activation_amax"][path] < 1e4
    tokens, logits = np.asarray(reference["tokens"]), np.asarray(reference["logits"])
    assert tokens.dtype == np.int32 and tokens.shape == (4, 32)  # n=4, L=min(seq_len, 64)
    assert logits.dtype == np.float32 and logits.shape == (4, 32, 64)
    assert np.all(np.isfinite(logits)) and tokens.min() >= 0 and tokens.max() < 64
    cfg = load_config(trained_runs.api_dir / "config.yaml")
    from nvfp4_train.data import make_datasets

    datasets = make_datasets(cfg.data, seq_len=32, batch_size=8, seed=cfg.train.seed)
    np.testing.assert_array_equal(tokens[0], datasets.validation_sequences[0]["inputs"])


def test_loss_falls(trained_runs):
    losses = [loss for _, loss in train_losses(trained_runs.api_dir)]
    assert losses[-1] < losses[0] - 0.1


def test_rerun_with_same_seed_is_bit_identical(trained_runs):
    """The CLI run and the in-process run of one config (NVFP4, stochastic rounding) agree exactly."""
    assert train_losses(trained_runs.cli_dir) == train_losses(trained_runs.api_dir)
    val = [
        [
            r["val_loss"]
            for r in read_metrics(d / "metrics.jsonl")
            if "val_loss" in r and "loss" in r
        ]
        for d in (trained_runs.cli_dir, trained_runs.api_dir)
    ]
    assert val[0] == val[1] and len(val[0]) == 2


def test_resume_continues_from_checkpoint_exactly(trained_runs, tiny_config):
    """Drop the last checkpoint: rerunning resumes at step 4 and reproduces steps 5..8 exactly."""
    run_dir = trained_runs.api_dir
    before = train_losses(run_dir)
    items_before = _items(run_dir / "checkpoints" / str(RUN_STEPS))
    shutil.rmtree(run_dir / "checkpoints" / str(RUN_STEPS))
    out = io.StringIO()
    summary = run(_config(trained_runs, tiny_config, run_dir), stream=out)
    assert (summary.start_step, summary.final_step) == (4, RUN_STEPS)
    assert "resumed from" in out.getvalue() and "(step 4)" in out.getvalue()
    assert "dropped 4 metrics rows" in out.getvalue()
    assert train_losses(run_dir) == before
    stats, reference = _items(run_dir / "checkpoints" / str(RUN_STEPS))
    assert stats == items_before[0]  # the activation amax resumes too
    jax.tree.map(np.testing.assert_array_equal, reference, items_before[1])


def test_rerun_of_a_finished_run_does_nothing(trained_runs, tiny_config):
    run_dir = trained_runs.cli_dir
    before = read_metrics(run_dir / "metrics.jsonl")
    out = io.StringIO()
    summary = run(_config(trained_runs, tiny_config, run_dir), stream=out)
    assert summary.start_step == summary.final_step == RUN_STEPS
    assert "nothing to do" in out.getvalue()
    assert read_metrics(run_dir / "metrics.jsonl") == before


def test_resume_with_a_different_model_is_refused(trained_runs, tiny_config):
    cfg = _config(trained_runs, tiny_config, trained_runs.cli_dir, "model.mlp_dim=32")
    with pytest.raises(ConfigError, match=r"different run \(model\.mlp_dim differ\)"):
        run(cfg, stream=io.StringIO())


def test_evaluate_run_appends_a_row(trained_runs):
    run_dir = trained_runs.api_dir
    out = io.StringIO()
    row = evaluate_run(run_dir, stream=out)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert rows[-1] == row and row["step"] == RUN_STEPS and row["source"] == "eval"
    trained = [r["val_loss"] for r in rows if "val_loss" in r and "loss" in r][-1]
    assert row["val_loss"] == pytest.approx(trained, rel=1e-6)
    assert out.getvalue().startswith(f"step {RUN_STEPS}  val_loss")


def test_evaluate_run_errors(tmp_path, tiny_config):
    with pytest.raises(ConfigError, match="is not a run directory"):
        evaluate_run(tmp_path)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tiny_config(tmp_path)))
    with pytest.raises(ConfigError, match="has no checkpoint"):
        evaluate_run(tmp_path)
