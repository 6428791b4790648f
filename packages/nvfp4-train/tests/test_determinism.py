"""`train.deterministic` (`training.determinism`): the XLA flag composed and appended to XLA_FLAGS
before JAX starts (the flags already there kept) where a GPU backend may start, "auto" resolved
from the run's checkpoints, a one-line warning when the backend has started already, and the key
validated. A GPU host is faked (a CUDA plugin's name); nothing here starts a GPU."""

from __future__ import annotations

import os

import pytest
import yaml

from nvfp4_train import cli
from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.training import determinism
from nvfp4_train.training.determinism import (
    FLAG,
    apply_to_environment,
    flag_value,
    wants_determinism,
    with_flag,
)

EIGHT = "--xla_force_host_platform_device_count=8"


def _cfg(deterministic="auto", every_steps=100, steps=300):
    return config_from_dict(
        {"train": {"steps": steps, "deterministic": deterministic},
         "checkpoint": {"every_steps": every_steps}}
    )  # fmt: skip


def test_the_flag_is_appended_to_the_flags_there_and_never_overrides_one_given():
    assert with_flag("") == FLAG == "--xla_gpu_deterministic_ops=true"
    assert with_flag(f"  {EIGHT} ") == f"{EIGHT} {FLAG}"
    given = f"{EIGHT} --xla_gpu_deterministic_ops=false"
    assert with_flag(given) == given
    assert flag_value(given) == "false" and flag_value(EIGHT) is None
    assert flag_value("--xla_gpu_deterministic_ops") == "true"  # a bare bool flag is on
    assert flag_value("--xla_gpu_deterministic_ops_level=2") is None  # another flag


def test_auto_is_on_when_the_run_checkpoints_before_its_end():
    assert wants_determinism(_cfg())  # every 100 of 300 steps: a kill resumes bit-identically
    assert not wants_determinism(_cfg(every_steps=0))  # only the last step is saved
    assert not wants_determinism(_cfg(every_steps=300))
    assert wants_determinism(_cfg(True, every_steps=0))
    assert not wants_determinism(_cfg(False))


@pytest.fixture
def gpu_host(monkeypatch):
    """This machine as one with a CUDA plugin installed and JAX's backend not yet started."""
    monkeypatch.setattr(determinism, "gpu_plugins", lambda: ["xla_cuda12"])
    monkeypatch.setattr(determinism, "backend_started", lambda: False)
    return monkeypatch


def test_the_environment_gets_the_flag_once_with_a_start_up_line(gpu_host):
    env = {"XLA_FLAGS": EIGHT}
    line = apply_to_environment(_cfg(), env)
    assert env["XLA_FLAGS"] == f"{EIGHT} {FLAG}"
    assert line.startswith("deterministic GPU ops: on, --xla_gpu_deterministic_ops=true added")
    assert "auto" in line
    again = apply_to_environment(_cfg(), env)  # already there: unchanged, said as it is
    assert env["XLA_FLAGS"] == f"{EIGHT} {FLAG}" and "as XLA_FLAGS already says" in again
    off = {"XLA_FLAGS": "--xla_gpu_deterministic_ops=false"}
    assert "off (xla_gpu_deterministic_ops=false)" in apply_to_environment(_cfg(True), off)
    cpu = {"JAX_PLATFORMS": "cpu"}
    assert apply_to_environment(_cfg(True), cpu) is None and "XLA_FLAGS" not in cpu
    assert apply_to_environment(_cfg(False), env := {}) is None and not env
    gpu_host.setattr(determinism, "gpu_plugins", lambda: [])  # a CPU-only install: nothing
    assert apply_to_environment(_cfg(True), env) is None and not env


def test_a_started_backend_gets_one_warning_line_and_no_change(gpu_host):
    gpu_host.setattr(determinism, "backend_started", lambda: True)
    env = {"XLA_FLAGS": EIGHT}
    line = apply_to_environment(_cfg(True), env)
    assert env == {"XLA_FLAGS": EIGHT}
    assert line.startswith("warning: train.deterministic cannot take effect") and "\n" not in line


def test_the_run_command_sets_it_before_the_run_and_the_key_is_checked(tmp_path, gpu_host, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "run"), "train": {"steps": 4}}))
    gpu_host.setenv("XLA_FLAGS", EIGHT)
    gpu_host.delenv("JAX_PLATFORMS", raising=False)
    seen = []
    gpu_host.setattr("nvfp4_train.training.run.run", lambda cfg: seen.append(cfg))
    assert cli.main(["run", str(path), "train.deterministic=true"]) == 0
    assert seen and capsys.readouterr().out.startswith("deterministic GPU ops: on")
    assert os.environ["XLA_FLAGS"] == f"{EIGHT} {FLAG}"
    assert cli.main(["run", str(path), "train.deterministic=maybe"]) == 2
    assert "train.deterministic: expected bool or one of 'auto'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train.deterministic"):
        _cfg("yes")
