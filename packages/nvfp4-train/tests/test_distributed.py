"""Multi-process runs: when to call `jax.distributed.initialize`, and a real two-process run on
localhost (CPU collectives over gloo) that matches the single-process run of the same config."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.mesh.distributed import DistributedConfig, init_kwargs
from nvfp4_train.observe.metrics import read_metrics

ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}


def test_single_process_by_default():
    assert init_kwargs(DistributedConfig(), {}) is None
    assert init_kwargs(DistributedConfig(), {"JAX_NUM_PROCESSES": "1"}) is None
    assert init_kwargs(DistributedConfig(initialize="never"), ENV) is None


def test_environment_and_config():
    expected = {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}
    assert init_kwargs(DistributedConfig(), ENV) == expected
    cfg = DistributedConfig(coordinator_address="h:1", num_processes=2, process_id=0)
    assert init_kwargs(cfg, ENV) == {"coordinator_address": "h:1", "num_processes": 2,
                                     "process_id": 0}  # fmt: skip


def test_clusters_are_left_to_jax_detection():
    slurm = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}
    assert init_kwargs(DistributedConfig(), slurm) == {}
    assert init_kwargs(DistributedConfig(), {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert init_kwargs(DistributedConfig(initialize="always"), {}) == {}


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES must be an integer, got 'two'"):
        init_kwargs(DistributedConfig(), {"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, 2\), got 5"):
        init_kwargs(DistributedConfig(num_processes=2, process_id=5), {})
    with pytest.raises(
        ConfigError, match="distributed.initialize: expected one of 'auto', 'always', 'never'"
    ):
        config_from_dict({"distributed": {"initialize": "yes"}})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_localhost_match_one(trained_runs, tmp_path):
    """Data parallel over 2 processes x 1 CPU device. Same tolerance argument as the 8-device
    mesh test: step 1 to 1e-6 relative (summation order only), later steps to 1e-3."""
    run_dir = tmp_path / "two"
    config = trained_runs.cli_dir.parent / "cli.yaml"
    port = _free_port()
    procs = []
    for pid in range(2):
        env = {
            **os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid),
        }  # fmt: skip
        env.pop("XLA_FLAGS", None)
        command = [sys.executable, "-m", "nvfp4_train", "run", str(config),
                   f"train.steps={trained_runs.steps}", f"output_dir={run_dir}"]  # fmt: skip
        procs.append(
            subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
    assert "mesh: data=2, fsdp=1, expert=1, tensor=1 over 2 devices (2 processes)" in outs[0][0]
    rows = read_metrics(run_dir / "metrics.jsonl")  # written once, by process 0
    two = [r["loss"] for r in rows if "loss" in r]
    one = [r["loss"] for r in read_metrics(trained_runs.cli_dir / "metrics.jsonl") if "loss" in r]
    assert len(two) == len(one) == trained_runs.steps
    np.testing.assert_allclose(two[0], one[0], rtol=1e-6)
    np.testing.assert_allclose(two, one, rtol=1e-3)
    assert (run_dir / "checkpoints" / str(trained_runs.steps) / "params").is_dir()
