"""Nothing lost, nothing silent: a diverged run stops and keeps its good checkpoints, corrupt
checkpoints are refused, one run per directory, and bad config files are clear errors."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.items import CorruptCheckpoint
from nvfp4_train.checkpoint.run_dir import make_run_dir, run_lock
from nvfp4_train.cli import main
from nvfp4_train.config.run_config import ConfigError, config_from_dict, load_config
from nvfp4_train.errors import RunError
from nvfp4_train.observe.metrics import MetricsFile
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.run import run
from nvfp4_train.training.session import load_run_config


def _cfg(tiny_config, run_dir, *overrides):
    return config_from_dict(tiny_config(run_dir), ["train.eval_every=0", *overrides])


# ----------------------------------------------------------------------------- config files


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_config_values_are_refused(tmp_path, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"optimizer:\n  learning_rate: {value}\n")
    with pytest.raises(ConfigError, match="optimizer.learning_rate: expected a finite number"):
        load_config(path)
    with pytest.raises(ConfigError, match="expected a finite number"):
        config_from_dict({}, ["optimizer.grad_clip_norm=inf"])


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 3\ntrain:\n  seed: 1\n")
    with pytest.raises(ConfigError, match="duplicate key 'train' at line 3"):
        load_config(path)
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        config_from_dict({}, ["precision.overrides={a: 1, a: 2}"])


def test_an_alias_bomb_is_refused_quickly_and_the_message_stays_short(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join([*lines, "train:", "  steps: *a8", ""]))  # 444 bytes, 9^9 values
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="once its aliases .* are expanded") as info:
        load_config(path)
    assert time.perf_counter() - t0 < 5 and len(str(info.value)) < 500
    with pytest.raises(ConfigError) as info:  # a huge value quoted in a message is cut
        config_from_dict({"precision": {"recipe": "x" * 10**6}})
    assert len(str(info.value)) < 1000


def test_yaml_nested_too_deeply_is_a_clear_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("[" * 200_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(path)


# ----------------------------------------------------------------------------- run directory


def test_an_output_dir_that_is_a_file_or_under_one_is_a_sentence(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory; choose another output_dir"):
        make_run_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match="one of its parents is a file"):
        make_run_dir(tmp_path / "file" / "run")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_an_unwritable_output_dir_is_a_sentence(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError, match="permission denied|not writable"):
        make_run_dir(locked / "run")


HOLD = """
import sys, time
from pathlib import Path
from nvfp4_train.checkpoint.run_dir import run_lock
with run_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_one_run_per_directory_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        in_use = rf"in use by another nvfp4-train process \(pid {holder.pid} on"
        with pytest.raises(ConfigError, match=in_use), run_lock(tmp_path):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(tmp_path):  # the lock died with its holder
        assert json.loads((tmp_path / ".nvfp4-train.lock").read_text())["pid"] == os.getpid()


def test_a_second_run_in_the_same_directory_is_refused(tiny_config, tmp_path):
    cfg = _cfg(tiny_config, tmp_path / "run", "train.steps=2")
    (tmp_path / "run").mkdir()
    with run_lock(tmp_path / "run"), pytest.raises(ConfigError, match="is in use by another"):
        run(cfg, stream=io.StringIO())
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_deleted_metrics_file_is_reported_and_started_again(tmp_path):
    said = []
    metrics = MetricsFile(tmp_path / "metrics.jsonl", say=said.append)
    metrics.append({"step": 1, "loss": 2.0})
    (tmp_path / "metrics.jsonl").unlink()
    metrics.append({"step": 2, "loss": 1.5})
    metrics.close()
    assert "disappeared (deleted or replaced)" in said[0] and "before step 2" in said[0]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, "loss": 1.5}]


# ----------------------------------------------------------------------------- divergence


def test_a_diverging_run_stops_with_an_error_and_keeps_its_checkpoints(tiny_config, tmp_path):
    # learning_rate 1e6: the parameters blow up and every later update is skipped as non-finite
    cfg = _cfg(
        tiny_config, tmp_path / "run", "optimizer.learning_rate=1e6", "train.steps=40",
        "train.log_every=1", "checkpoint.every_steps=1", "checkpoint.keep=2",
        "train.stop_after_nonfinite=3", "optimizer.warmup_steps=0",
    )  # fmt: skip
    with pytest.raises(
        RunError, match=r"training diverged: the 3 steps \d+\.\.\d+ were all skipped"
    ):
        run(cfg, stream=io.StringIO())
    assert main(["run", str(tmp_path / "run" / "config.yaml")]) == 1  # resumed: the same stop
    with Checkpoints(tmp_path / "run" / "checkpoints", keep=2) as ckpts:
        assert len(ckpts.all_steps()) >= 1  # every saved state is a finite one (checked on save)


def test_a_non_finite_state_is_never_saved(tiny_config, tmp_path):
    # without skip-step the NaN reaches the parameters; the checkpoint of that state is refused
    cfg = _cfg(
        tiny_config, tmp_path / "run", "optimizer.learning_rate=1e9", "train.steps=12",
        "optimizer.loss_scaling.skip_nonfinite=false", "train.stop_after_nonfinite=0",
        "checkpoint.every_steps=1", "checkpoint.keep=2", "optimizer.warmup_steps=0",
    )  # fmt: skip
    with pytest.raises(RunError, match=r"not saving step \d+: the train state holds NaN or Inf"):
        run(cfg, stream=io.StringIO())
    abstract = abstract_state(load_run_config(tmp_path / "run"))[1]
    with Checkpoints(tmp_path / "run" / "checkpoints", keep=2) as ckpts:
        assert ckpts.all_steps()
        for step in ckpts.all_steps():
            ckpts.restore(step, abstract)  # raises if one held NaN


# ----------------------------------------------------------------------------- corrupt checkpoints


@pytest.fixture
def two_checkpoints(tiny_config, tmp_path):
    cfg = _cfg(tiny_config, tmp_path / "run", "train.steps=4", "checkpoint.every_steps=2")
    run(cfg, stream=io.StringIO())
    return cfg, tmp_path / "run" / "checkpoints"


def test_a_checkpoint_whose_checksums_differ_is_refused_and_set_aside(two_checkpoints):
    cfg, directory = two_checkpoints
    item = directory / "4" / "integrity" / "metadata"
    saved = json.loads(item.read_text())
    path = sorted(saved["checksums"])[0]
    saved["checksums"][path][0] ^= 1  # as if one bit of that array had flipped
    item.write_text(json.dumps(saved))
    abstract = abstract_state(load_run_config(directory.parent))[1]
    with Checkpoints(directory, keep=3) as ckpts, pytest.raises(CorruptCheckpoint, match=path):
        ckpts.restore(4, abstract)
    out = io.StringIO()
    run(
        config_from_dict({**_as_dict(cfg), "train": {**_as_dict(cfg)["train"], "steps": 6}}),
        stream=out,
    )
    text = out.getvalue()
    assert "checksums of" in text and "moved it to 4.unreadable" in text
    assert "resumed from" in text and "(step 2)" in text
    assert (directory / "4.unreadable").is_dir()  # kept for inspection, never deleted


def test_flipped_bytes_on_disk_are_never_trained_on(two_checkpoints):
    cfg, directory = two_checkpoints
    files = [p for p in (directory / "4" / "params").rglob("*") if p.is_file()]
    data_file = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(data_file.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 64):
        data[i] ^= 0xFF
    data_file.write_bytes(bytes(data))
    out = io.StringIO()
    run(
        config_from_dict({**_as_dict(cfg), "train": {**_as_dict(cfg)["train"], "steps": 6}}),
        stream=out,
    )
    assert "is unreadable" in out.getvalue() and "(step 2)" in out.getvalue()


def _as_dict(cfg):
    from nvfp4_train.config.loader import to_dict

    return to_dict(cfg)


def test_integrity_is_the_same_on_any_mesh_and_catches_one_bit():
    import jax.numpy as jnp

    from nvfp4_train.checkpoint.integrity import state_integrity
    from nvfp4_train.training.step import TrainState

    params = {"w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8)}
    state = TrainState(jnp.zeros((), jnp.int32), params, {"count": jnp.int32(3)}, {})
    a = state_integrity(state)
    flipped = np.asarray(params["w"]).copy().view(np.uint32)
    flipped[3, 4] ^= 1 << 7
    b = state_integrity(state._replace(params={"w": jnp.asarray(flipped.view(np.float32))}))
    assert a["finite"] and a["checksums"]["params.w"] != b["checksums"]["params.w"]
    assert a["checksums"]["opt_state.count"] == b["checksums"]["opt_state.count"]
    nan = state_integrity(state._replace(params={"w": params["w"].at[0, 0].set(jnp.nan)}))
    assert not nan["finite"]
