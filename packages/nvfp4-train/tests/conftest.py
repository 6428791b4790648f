"""Shared fixtures: a config small enough that a whole run takes seconds on a CPU, and two runs of it."""

from __future__ import annotations

import dataclasses
import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml


def pytest_addoption(parser):
    parser.addoption(
        "--scan-layers-from", type=int, default=None, metavar="N",
        help="run the in-process tests with `model.scan_layers: auto` scanning from N blocks on "
        "(e.g. 2: every multi-block model of the suite scans); subprocess runs keep the default",
    )  # fmt: skip


@pytest.fixture(autouse=True, scope="session")
def _scan_layers_from(request):
    """`--scan-layers-from N`: `nvfp4_train.model.config.AUTO_SCAN_LAYERS` set to N for the session."""
    value = request.config.getoption("--scan-layers-from")
    if value is None:
        yield
        return
    import nvfp4_train.model.config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nvfp4_train.model.config, "AUTO_SCAN_LAYERS", value)
        yield


LONGEST_FIRST = (
    "test_scan.py", "test_weight_gather.py", "test_step.py", "test_telemetry.py",
    "test_backend_check.py",
    "test_schedule.py", "test_moe_telemetry.py", "test_safety.py", "test_moe.py",
    "test_distributed.py", "test_resume.py", "test_ssd.py", "test_hybrid.py",
    "test_precision_schedule.py", "test_attention.py", "test_sharding.py",
    "test_run_telemetry.py", "test_cli.py", "test_tasks.py", "test_model.py",
)  # fmt: skip
"""The test files that take longest (tens of seconds to minutes of compiling), longest first;
the others follow in their own order (see `pytest_collection_modifyitems`)."""


def pytest_collection_modifyitems(items):
    """Longest files first: pytest-xdist hands out whole files in collection order (noxfile's
    `--no-loadscope-reorder`), and a long file that starts last leaves the other workers idle."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept


RUN_STEPS = 8
RUN_SECTIONS = {
    "train": {"log_every": 1, "eval_every": 4},
    "checkpoint": {"every_steps": 4, "keep": 3},
}


def _tiny_config(output_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    """A plain config mapping: 1-layer model on synthetic tokens; `sections` update it."""
    cfg: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": {
            "d_model": 32,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
            "mlp_dim": 64,
            "max_seq_len": 32,
        },
        "precision": {"recipe": "nvfp4"},
        "optimizer": {"learning_rate": 3e-3, "warmup_steps": 2},
        "data": {
            "source": "synthetic",
            "synthetic_vocab_size": 64,
            "synthetic_tokens": 20_000,
            "validation_batches": 2,
        },
        "train": {
            "steps": 12,
            "batch_size": 8,
            "seq_len": 32,
            "log_every": 2,
            "eval_every": 6,
        },
        "checkpoint": {"every_steps": 6, "keep": 3},
        "logging": {"progress": "plain"},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return cfg


@pytest.fixture(scope="session")
def tiny_config():
    """`tiny_config(output_dir, **sections)`: a plain config mapping (see `_tiny_config`)."""
    return _tiny_config


@dataclasses.dataclass(frozen=True)
class TrainedRuns:
    """One NVFP4 config trained twice: by the CLI in a subprocess and by `run()` in-process.

    Attributes:
        cli_dir: the run directory of `python -m nvfp4_train run cli.yaml train.steps=8`.
        cli_result: that subprocess (returncode, stdout, stderr).
        api_dir: the run directory of `nvfp4_train.training.run.run(cfg)` with the same config.
        api_summary: what `run` returned.
        api_output: what `run` printed.
        steps: `train.steps` of both runs.
        sections: the config sections both runs updated `tiny_config` with.
    """

    cli_dir: Path
    cli_result: subprocess.CompletedProcess
    api_dir: Path
    api_summary: Any
    api_output: str
    steps: int = RUN_STEPS
    sections: dict = dataclasses.field(
        default_factory=lambda: {
            **RUN_SECTIONS,
            "train": {**RUN_SECTIONS["train"], "steps": RUN_STEPS},
        }
    )


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory) -> TrainedRuns:
    """The CLI run, then the in-process one (`RUN_STEPS` steps, checkpoints at 4 and 8): one after
    the other, so that under nox's persistent compilation cache the second loads the first's
    compiled steps (at once, both compiled the same programs)."""
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.run import run

    root = tmp_path_factory.mktemp("trained")
    cli_config = root / "cli.yaml"
    cli_train = {**RUN_SECTIONS["train"], "steps": 50}  # the command line sets 8
    cli_config.write_text(
        yaml.safe_dump(_tiny_config(root / "cli", **{**RUN_SECTIONS, "train": cli_train}))
    )
    command = [
        sys.executable,
        "-m",
        "nvfp4_train",
        "run",
        str(cli_config),
        f"train.steps={RUN_STEPS}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    api_train = {**RUN_SECTIONS["train"], "steps": RUN_STEPS}
    cfg = config_from_dict(_tiny_config(root / "api", **{**RUN_SECTIONS, "train": api_train}))
    output = io.StringIO()
    summary = run(cfg, stream=output)
    return TrainedRuns(root / "cli", result, root / "api", summary, output.getvalue())
