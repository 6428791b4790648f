"""The training loop with quantization telemetry on: rows, health warnings, and no effect on training."""

from __future__ import annotations

import io

from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.observe.metrics import read_metrics
from nvfp4_train.training.run import run

STEPS = 4
ROLES = {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_x", "wgrad_dy"}  # 2D weights: no dgrad_w


def _train(tiny_config, run_dir, **logging):
    sections = {
        "train": {"steps": STEPS, "log_every": 1, "eval_every": 0},
        "checkpoint": {"every_steps": STEPS},
        "logging": {"progress": "plain", "tensorboard": False, **logging},
    }
    out = io.StringIO()
    run(config_from_dict(tiny_config(run_dir, **sections)), stream=out)
    return read_metrics(run_dir / "metrics.jsonl"), out.getvalue()


def test_telemetry_rows_warnings_and_unchanged_training(tiny_config, tmp_path):
    strict = {"activation": {"rel_error": 0.01}, "patience": 2}  # NVFP4's ~0.1 breaks it
    rows, output = _train(tiny_config, tmp_path / "on", quant_stats_every=1, quant_health=strict)
    plain_rows, _ = _train(tiny_config, tmp_path / "off")

    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in plain_rows if "loss" in r]  # bit-identical
    quant = [r for r in rows if "quant" in r]
    assert [r["step"] for r in quant] == list(range(1, STEPS + 1))
    assert not any("quant" in r for r in plain_rows)
    linears = {"layers.0.attn.qkv", "layers.0.attn.o", "layers.0.mlp.gate_up", "layers.0.mlp.down"}
    for row in quant:
        assert set(row["quant"]) == linears
        for roles in row["quant"].values():
            assert set(roles) == ROLES
            for stats in roles.values():
                assert stats["amax"] > 0 and 0.0 <= stats["underflow"] <= 1.0
                assert 0.0 < stats["rel_error"] < 0.5
    assert "quant worst layers.0." in output
    # patience 2: one warning per (layer, activation role) once it is out of range twice
    warnings = [line for line in output.splitlines() if line.startswith("quant health:")]
    assert warnings and all("rel_error" in w and "(since step 1)" in w for w in warnings)
    assert any("layers.0.mlp.down fprop_x" in w for w in warnings)
    assert len(warnings) == len({w.split(" rel_error")[0] for w in warnings})
