"""The quantization health tracker and its config section (`logging.quant_health`)."""

from __future__ import annotations

import math

import pytest

from nvfp4_train.config.loader import to_yaml
from nvfp4_train.config.run_config import config_from_dict, load_config
from nvfp4_train.errors import ConfigError
from nvfp4_train.observe.health import (
    ROLE_FAMILIES,
    QuantHealthConfig,
    StatLimits,
    make_health_tracker,
)

PATH = "layers.2.mlp.down"


def stats(rel_error=0.1, underflow=0.0, saturation=0.03, amax=1.5, role="wgrad_dy", path=PATH):
    values = {
        "amax": amax,
        "underflow": underflow,
        "saturation": saturation,
        "rel_error": rel_error,
    }
    return {path: {role: values}}


def feed(tracker, sequence, start_step=10, every=10):
    """Runs `tracker` over a list of stats; returns [(step, lines)] and the final state."""
    state, out = tracker.init(), []
    for i, s in enumerate(sequence):
        state, lines = tracker.update(state, s, step=start_step + i * every)
        out.append((start_step + i * every, lines))
    return out, state


def test_healthy_stats_give_no_warnings():
    tracker = make_health_tracker(QuantHealthConfig())
    out, state = feed(tracker, [stats()] * 5)
    assert all(lines == [] for _, lines in out)
    assert state.reported == frozenset() and state.streaks == {}


def test_warns_once_after_patience_then_once_on_recovery():
    cfg = QuantHealthConfig(gradient=StatLimits(rel_error=0.2), patience=3)
    seq = [stats(0.3)] * 5 + [stats(0.1)] * 2
    out, _ = feed(make_health_tracker(cfg), seq)
    lines = [(step, line) for step, ls in out for line in ls]
    assert len(lines) == 2
    step, first = lines[0]
    assert step == 30
    assert first == (
        "quant health: layers.2.mlp.down wgrad_dy rel_error 0.3 above its limit 0.2 "
        "for 3 probes (since step 10)"
    )
    step, second = lines[1]
    assert step == 60
    assert second == (
        "quant health: layers.2.mlp.down wgrad_dy rel_error back in range (0.1, <= 0.2) "
        "after 5 probes"
    )


def test_a_short_excursion_below_patience_is_silent_and_resets():
    cfg = QuantHealthConfig(patience=3)
    seq = [stats(0.5), stats(0.5), stats(0.1), stats(0.5), stats(0.5), stats(0.1)]
    out, _ = feed(make_health_tracker(cfg), seq)
    assert all(lines == [] for _, lines in out)


def test_limits_follow_the_role_family():
    cfg = QuantHealthConfig(
        activation=StatLimits(saturation=0.05), gradient=StatLimits(saturation=0.02), patience=1
    )
    tracker = make_health_tracker(cfg)
    _, lines = tracker.update(tracker.init(), stats(saturation=0.03, role="fprop_x"))
    assert lines == []
    _, lines = tracker.update(tracker.init(), stats(saturation=0.03, role="dgrad_dy"))
    assert lines == [
        "quant health: layers.2.mlp.down dgrad_dy saturation 0.03 above its limit 0.02 for 1 probe"
    ]
    assert cfg.limits("wgrad_x") == cfg.activation and cfg.limits("dgrad_w") == cfg.weight


def test_non_finite_amax_is_reported_at_once_and_recovers():
    tracker = make_health_tracker(QuantHealthConfig(patience=5))
    seq = [stats(amax=math.inf, rel_error=math.nan), stats(amax=None), stats()]
    out, _ = feed(tracker, seq)
    first = out[0][1]
    assert first[0] == "quant health: layers.2.mlp.down wgrad_dy amax is inf, not finite at step 10"
    assert len(first) == 1  # rel_error nan only counts towards its patience
    assert out[1][1] == []  # still non-finite (null in metrics.jsonl): not repeated
    assert out[2][1] == [
        "quant health: layers.2.mlp.down wgrad_dy amax back in range (1.5, finite) after 2 probes"
    ]


def test_each_layer_role_and_stat_is_tracked_separately():
    tracker = make_health_tracker(QuantHealthConfig(patience=2))
    both = {
        "layers.1.attn.o": {"fprop_x": {"underflow": 0.5}, "fprop_w": {"underflow": 0.0}},
        "layers.2.attn.o": {"fprop_x": {"underflow": 0.0}},
    }
    out, state = feed(tracker, [both, both])
    assert out[0][1] == []
    assert out[1][1] == [
        "quant health: layers.1.attn.o fprop_x underflow 0.5 above its limit 0.01 "
        "for 2 probes (since step 10)"
    ]
    assert state.reported == {("layers.1.attn.o", "fprop_x", "underflow")}


def test_update_is_pure():
    tracker = make_health_tracker(QuantHealthConfig(patience=1))
    state0 = tracker.init()
    state1, lines1 = tracker.update(state0, stats(0.9))
    state1b, lines1b = tracker.update(state0, stats(0.9))
    assert state0.streaks == {} and state0.reported == frozenset()
    assert (state1, lines1) == (state1b, lines1b) and len(lines1) == 1


def test_unknown_role_is_named():
    tracker = make_health_tracker(QuantHealthConfig())
    with pytest.raises(ValueError, match="role must be one of .* got 'gemm_z'"):
        tracker.update(tracker.init(), stats(role="gemm_z"))


def test_role_families_cover_every_gemm_operand_role():
    from nvfp4_ops.qdot import KEY_SLOTS  # gemm_operand_stats names its roles like the key slots

    assert set(ROLE_FAMILIES) == set(KEY_SLOTS)


# ----------------------------------------------------------------------------- config section


def test_logging_section_loads_nested_limits_and_round_trips(tmp_path):
    cfg = config_from_dict(
        {
            "logging": {
                "quant_stats_every": 50,
                "quant_health": {"patience": 2, "gradient": {"rel_error": 0.3}},
            }
        }
    )
    assert cfg.logging.quant_stats_every == 50
    assert cfg.logging.quant_health.patience == 2
    assert cfg.logging.quant_health.gradient.rel_error == 0.3
    assert cfg.logging.quant_health.weight == QuantHealthConfig().weight
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_telemetry_is_off_by_default():
    assert config_from_dict({}).logging.quant_stats_every == 0


@pytest.mark.parametrize(
    ("logging", "needle"),
    [
        ({"quant_stats_every": -1}, "logging.quant_stats_every must be >= 0, got -1"),
        ({"quant_health": {"patiense": 2}}, "'logging.quant_health.patiense' (did you mean"),
        ({"quant_health": {"patience": 0}}, "logging.quant_health.patience must be >= 1, got 0"),
        (
            {"quant_health": {"gradient": {"rel_error": 2}}},
            "logging.quant_health.gradient: rel_error must be in (0, 1], got 2.0",
        ),
        ({"quant_health": {"weight": {"amax": 1}}}, "'logging.quant_health.weight.amax'"),
        ({"quant_health": 3}, "logging.quant_health: expected a mapping, got 3"),
    ],
)
def test_bad_values_are_named(logging, needle):
    with pytest.raises(ConfigError) as e:
        config_from_dict({"logging": logging})
    assert needle in str(e.value)


MEASURED_HEALTHY_MAXIMA = {
    # role: (underflow, saturation, rel_error), the largest values over every quantized linear
    # and probe of the tiny (300 steps) and small (600 steps) example runs, docs/telemetry.md
    "fprop_x": (0.0, 0.0458, 0.109),
    "wgrad_x": (0.0, 0.0613, 0.107),
    "fprop_w": (0.0, 0.0044, 0.120),
    "dgrad_dy": (0.0085, 0.0366, 0.156),
    "wgrad_dy": (0.0, 0.0376, 0.149),
}


def test_default_limits_pass_the_measured_healthy_runs_and_catch_twice_their_values():
    tracker = make_health_tracker(QuantHealthConfig(patience=1))
    keys = ("underflow", "saturation", "rel_error")
    healthy = {
        PATH: {r: dict(zip(keys, v, strict=True)) for r, v in MEASURED_HEALTHY_MAXIMA.items()}
    }
    assert tracker.update(tracker.init(), healthy)[1] == []
    doubled = {PATH: {r: {"saturation": 2 * v[1] + 0.02, "rel_error": 2 * v[2]}
                      for r, v in MEASURED_HEALTHY_MAXIMA.items()}}  # fmt: skip
    assert len(tracker.update(tracker.init(), doubled)[1]) == 2 * len(MEASURED_HEALTHY_MAXIMA)
