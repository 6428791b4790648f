"""Shared fixtures: a config small enough that a whole CLI run takes seconds on a CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


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
