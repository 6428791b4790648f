"""The `nvfp4-train` command line: a real run in a subprocess (conftest), eval, plot, user errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from nvfp4_train import cli
from nvfp4_train.cli import main
from nvfp4_train.config.run_config import config_from_dict, load_config
from nvfp4_train.errors import DataError
from nvfp4_train.observe.metrics import read_metrics

RUN_STEPS = 8  # conftest's trained_runs


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nvfp4_train", *args], capture_output=True, text=True, timeout=600
    )


def test_run_end_to_end(trained_runs):
    run_dir, result = trained_runs.cli_dir, trained_runs.cli_result
    assert trained_runs.steps == RUN_STEPS
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    losses = [r["loss"] for r in rows]
    assert [r["step"] for r in rows] == list(range(1, RUN_STEPS + 1))  # train.steps=8 overrode 50
    assert losses[-1] < losses[0]
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 8]
    resolved = load_config(run_dir / "config.yaml")
    assert resolved.train.steps == RUN_STEPS and resolved.precision.recipe == "nvfp4"
    assert (run_dir / "checkpoints" / str(RUN_STEPS) / "params").is_dir()
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (
        f"[{RUN_STEPS}/{RUN_STEPS}] step {RUN_STEPS}  loss" in result.stdout
    )  # plain lines: no TTY
    assert "run directory:" in result.stdout and "parameters" in result.stdout


def test_eval_prints_and_appends(trained_runs, capsys):
    assert main(["eval", str(trained_runs.cli_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"step {RUN_STEPS}  val_loss ")
    assert read_metrics(trained_runs.cli_dir / "metrics.jsonl")[-1]["source"] == "eval"


def test_plot_writes_png(trained_runs, tmp_path, capsys):
    out = tmp_path / "loss.png"
    runs = [str(trained_runs.cli_dir), str(trained_runs.api_dir)]
    assert main(["plot", *runs, "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_show_config_round_trips(tmp_path, capsys, tiny_config):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path / "r")))
    assert main(["show-config", str(config), "model.num_layers=3", "precision.recipe=fp8"]) == 0
    printed = capsys.readouterr().out
    expected = config_from_dict(
        tiny_config(tmp_path / "r"), ["model.num_layers=3", "precision.recipe=fp8"]
    )
    again = tmp_path / "again.yaml"
    again.write_text(printed)
    assert load_config(again) == expected
    assert yaml.safe_load(printed)["model"]["num_layers"] == 3
    assert not (tmp_path / "r").exists()  # showing a config creates nothing


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["show-config", "{cfg}", "train.stepz=3"], "unknown config key 'train.stepz'"),
        (["show-config", "{cfg}", "train.steps=abc"], "train.steps: expected int, got 'abc'"),
        (["show-config", "{cfg}", "train.steps"], "override must look like section.key=value"),
        (["show-config", "{cfg}", "precision.recipe=nvfp5"], "precision.recipe"),
        (["show-config", "{missing}"], "cannot read config file"),
        (["run", "{cfg}", "model.zzz=1"], "unknown config key 'model.zzz'"),
        (["eval", "{tmp}"], "is not a run directory"),
        (["plot", "{tmp}"], "has no metrics.jsonl"),
    ],
)
def test_user_errors_exit_2_with_one_line(args, needle, tmp_path, capsys, tiny_config):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path / "r")))
    values = {"cfg": config, "missing": tmp_path / "missing.yaml", "tmp": tmp_path}
    assert main([a.format(**values) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_a_bug_keeps_its_traceback(monkeypatch):
    # only the project's error types become one-line errors; a plain ValueError is a bug
    def buggy(args):
        raise ValueError("a bug, not a user mistake")

    monkeypatch.setitem(cli._COMMANDS, "eval", buggy)
    with pytest.raises(ValueError, match="a bug"):
        main(["eval", "somewhere"])


def test_a_data_error_is_one_line(monkeypatch, capsys):
    def bad_data(args):
        raise DataError("data.path: 'nowhere.txt' does not exist")

    monkeypatch.setitem(cli._COMMANDS, "eval", bad_data)
    assert main(["eval", "somewhere"]) == 2
    assert capsys.readouterr().err == "error: data.path: 'nowhere.txt' does not exist\n"


def test_user_error_in_subprocess_has_no_traceback(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("trian: {}\n")
    result = _cli("run", str(config))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: unknown config key 'trian' (did you mean 'train'?); allowed keys: "
        "output_dir, model, precision, optimizer, data, train, checkpoint, logging, mesh, "
        "distributed, eval"
    ]


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["run"])
    assert e.value.code == 2
