"""Surviving kills: SIGKILL at a random step and SIGTERM both resume to the exact losses of an
uninterrupted run; unreadable or half-written checkpoints are skipped; retention with keep_period."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from run_reading import signal_each, start_run, train_losses

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.errors import ConfigError
from nvfp4_train.training.evaluation import evaluate_run
from nvfp4_train.training.run import run
from nvfp4_train.training.session import load_run_config

STEPS = 60
SECTIONS = {
    "train": {"steps": STEPS, "log_every": 1, "eval_every": 0, "batch_size": 4, "seq_len": 16},
    "checkpoint": {"every_steps": 10, "keep": 2},
    "logging": {"progress": "plain", "tensorboard": False},
}


@dataclasses.dataclass(frozen=True)
class KilledRuns:
    reference: Path
    killed: Path
    killed_at: int
    terminated: Path
    terminated_at: int
    term_output: str
    term_returncode: int
    resumed_outputs: tuple[str, str]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory, tiny_config) -> KilledRuns:
    """An uninterrupted run, then one SIGKILLed and one SIGTERMed at random steps after the
    first checkpoint (both at once), then both interrupted ones resumed to the end.

    The reference runs first and alone: under nox's persistent compilation cache the later runs
    load its compiled steps instead of compiling the same programs again (three compiles at once
    were most of this fixture's minutes on 2 cores)."""
    root = tmp_path_factory.mktemp("killed")
    rng = random.Random(os.getpid())
    kill_step, term_step = rng.randint(11, 45), rng.randint(11, 45)
    configs = {}
    for name in ("reference", "killed", "terminated"):
        configs[name] = root / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(tiny_config(root / name, **SECTIONS)))
    procs = {"reference": start_run(configs["reference"])}
    outs = {"reference": procs["reference"].communicate(timeout=900)}
    assert procs["reference"].returncode == 0, outs["reference"][1][-3000:]
    procs.update({name: start_run(configs[name]) for name in ("killed", "terminated")})
    try:
        seen = signal_each({
            "killed": (procs["killed"], root / "killed", kill_step, signal.SIGKILL),
            "terminated": (procs["terminated"], root / "terminated", term_step, signal.SIGTERM),
        })  # fmt: skip
        killed_at, terminated_at = seen["killed"], seen["terminated"]
        outs.update({name: procs[name].communicate(timeout=900) for name in seen})
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    assert procs["killed"].returncode == -signal.SIGKILL, f"kill at {kill_step} came too late"
    resumed = {name: start_run(configs[name]) for name in ("killed", "terminated")}
    resumed_out = {name: p.communicate(timeout=900) for name, p in resumed.items()}
    for name, p in resumed.items():
        assert p.returncode == 0, resumed_out[name][1][-3000:]
    return KilledRuns(
        root / "reference", root / "killed", killed_at, root / "terminated", terminated_at,
        outs["terminated"][0] + outs["terminated"][1], procs["terminated"].returncode,
        (resumed_out["killed"][0], resumed_out["terminated"][0]),
    )  # fmt: skip


def test_sigkill_at_a_random_step_resumes_bit_identically(killed_runs):
    reference = train_losses(killed_runs.reference)
    assert [s for s, _ in reference] == list(range(1, STEPS + 1))
    assert 10 < killed_runs.killed_at < STEPS
    assert "resumed from" in killed_runs.resumed_outputs[0]
    assert train_losses(killed_runs.killed) == reference  # bit-identical floats, every step


def test_sigterm_finishes_the_step_saves_and_says_how_to_resume(killed_runs):
    out = killed_runs.term_output
    assert killed_runs.term_returncode == 0, out[-3000:]
    assert "stopped by SIGTERM after step" in out and "To resume, rerun the same command" in out
    stopped = int(out.split("stopped by SIGTERM after step ")[1].split(";")[0])
    assert killed_runs.terminated_at <= stopped < STEPS
    assert f"(step {stopped})" in killed_runs.resumed_outputs[1]  # resumed from that exact step
    assert train_losses(killed_runs.terminated) == train_losses(killed_runs.reference)


def test_unreadable_and_half_written_checkpoints_are_skipped(trained_runs, tiny_config, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs.cli_dir, run_dir)
    before = train_losses(run_dir)
    ckpts = run_dir / "checkpoints"
    last = trained_runs.steps
    for path in (ckpts / str(last) / "params").rglob("*"):
        if path.is_file() and path.stat().st_size > 0:
            path.write_bytes(b"\0" * 8)  # corrupt every file of the newest params item
    shutil.copytree(ckpts / "4", ckpts / "12.orbax-checkpoint-tmp-1700000000")  # a killed save
    out = io.StringIO()
    cfg = config_from_dict(tiny_config(run_dir, **trained_runs.sections))
    summary = run(cfg, stream=out)
    text = out.getvalue()
    assert f"checkpoint {ckpts.absolute() / str(last)} is unreadable" in text, text
    assert f"moved it to {last}.unreadable" in text and (ckpts / f"{last}.unreadable").is_dir()
    assert summary.start_step == 4 and "(step 4)" in text
    assert train_losses(run_dir) == before


def _as_saved_before_the_move(config: dict) -> dict:
    """A saved config as versions before `optimizer.loss_scaling` wrote it (in `precision`)."""
    old = copy.deepcopy(config)
    scaling = old["optimizer"].pop("loss_scaling")
    old["precision"].update(
        loss_scaling=scaling["mode"], initial_loss_scale=scaling["initial_scale"],
        loss_scale_growth_interval=scaling["growth_interval"],
        skip_nonfinite=scaling["skip_nonfinite"],
    )  # fmt: skip
    return old


def test_a_run_directory_saved_before_loss_scaling_moved_evaluates_and_resumes(
    trained_runs, tiny_config, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs.api_dir, run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    (run_dir / "config.yaml").write_text(yaml.safe_dump(_as_saved_before_the_move(saved)))
    items = sorted((run_dir / "checkpoints").glob("*/config/metadata"))
    assert items, "no checkpoint config items found"
    for item in items:
        item.write_text(json.dumps(_as_saved_before_the_move(json.loads(item.read_text()))))
    assert "loss_scaling" in yaml.safe_load((run_dir / "config.yaml").read_text())["precision"]

    assert load_run_config(run_dir) == config_from_dict(saved)
    assert evaluate_run(run_dir, stream=io.StringIO())["step"] == trained_runs.steps
    longer = {**trained_runs.sections["train"], "steps": trained_runs.steps + 2}
    out = io.StringIO()
    summary = run(config_from_dict(tiny_config(run_dir, **{**trained_runs.sections, "train": longer})), stream=out)  # fmt: skip
    assert summary.start_step == trained_runs.steps, out.getvalue()
    assert f"(step {trained_runs.steps})" in out.getvalue()

    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for other, message in [
        ({"loss_scaling": {"mode": "dynamic"}}, r"optimizer\.loss_scaling\.mode differ"),
        ({"grad_clip_norm": 0.0}, r"grad_clip_norm=1\.0, and 0\.0 turns clipping off"),
    ]:
        changed = {**trained_runs.sections, "train": longer, "optimizer": other}
        with pytest.raises(ConfigError, match=message):
            run(config_from_dict(tiny_config(run_dir, **changed)), stream=io.StringIO())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # none set aside


class _Tiny(NamedTuple):
    step: Any
    params: dict


def test_keep_period_keeps_every_mth_besides_the_newest(tmp_path):
    import jax.numpy as jnp

    with Checkpoints(tmp_path, keep=1, keep_period=4) as ckpts:
        for step in (2, 4, 6, 8, 10):
            state = _Tiny(jnp.int32(step), {"w": jnp.ones(3) * step})
            ckpts.save(step, state, data_iter_state={}, config={})
        assert ckpts.all_steps() == [4, 8, 10]
    with pytest.raises(ValueError, match="keep_period must be >= 0"):
        Checkpoints(tmp_path, keep=1, keep_period=-1)
