"""Quantization telemetry of the routed experts (one row per expert) and `plot --experts`.

One probe of a 2-block NVFP4 MoE model (block 0 quantized, block 1 BF16 as the last block) with
one expert pushed out of the routing by its balancing bias, checked against each expert's dense
`gemm_operand_stats` on its own rows of the captured tensors; and one short MoE run with the
telemetry on, against the same run with it off (the same config as test_moe's runs, so the
train step's compile is shared through the compilation cache).
"""

from __future__ import annotations

import functools
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from run_steps import initial, probe_of
from test_moe import MOE_RUN

import nvfp4_ops
from nvfp4_train.cli import main
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.decoder import linear_keys
from nvfp4_train.observe.health import QuantHealthConfig, make_health_tracker
from nvfp4_train.observe.metrics import EXPERT_TOKENS, quant_row, read_metrics
from nvfp4_train.observe.plot import quant_grid
from nvfp4_train.observe.plot_experts import expert_load, plot_experts
from nvfp4_train.observe.telemetry import capture_linear_operands, expert_stats
from nvfp4_train.training.run import run
from nvfp4_train.training.step import step_key

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPERTS = MOE_RUN["model"]["moe"]["num_experts"]
GROUPED = ("layers.0.mlp.experts.gate_up", "layers.0.mlp.experts.down")
TOKEN_ROLES = {"fprop_x", "dgrad_dy", "wgrad_x", "wgrad_dy"}
WEIGHT_ROLES = {"fprop_w"}  # 2D weights: no dgrad_w
IDLE = 3  # the expert of block 0 that gets no tokens in the probe


# ----------------------------------------------------------------------------- one probe


@functools.cache
def probed(tiny_config):
    """(cfg, probe output, captured operands, the probe's micro key); block 0's expert `IDLE`
    has a balancing bias of -1e3, so the router never picks it."""
    sections = {**MOE_RUN, "model": {**MOE_RUN["model"], "vocab_size": 64}}
    cfg = config_from_dict(tiny_config("unused", **sections))
    graphdef, state = initial(cfg)
    router = state.params["layers"]["0"]["mlp"]["router"]
    router["score_bias"] = router["score_bias"].at[IDLE].set(-1e3)
    probe = probe_of(cfg, graphdef)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 64, dtype=jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    key = step_key(cfg.train.seed, 2)
    micro_key = jax.random.fold_in(key, 0)

    def both(params):  # one jit, so both see the same x
        operands = capture_linear_operands(graphdef, params, batch, micro_key)
        return probe(params, batch, key), operands

    stats, operands = jax.jit(both)(state.params)
    return cfg, stats, operands, micro_key


def test_grouped_operands_are_captured_with_their_group_sizes(tiny_config):
    _, _, operands, _ = probed(tiny_config)
    x, w, dy, sizes = operands["layers.0.mlp.experts.down"]
    assigned = 4 * 16 * MOE_RUN["model"]["moe"]["experts_per_token"]
    assert x.shape == (assigned, 32) and w.shape == (EXPERTS, 32, 32) and dy.shape == (assigned, 32)
    assert sizes.dtype == jnp.int32 and int(sizes.sum()) == assigned and int(sizes[IDLE]) == 0
    np.testing.assert_array_equal(operands["layers.0.mlp.experts.gate_up"][3], sizes)


def test_every_expert_has_a_row_with_its_dense_operand_statistics(tiny_config):
    """Expert e of a grouped linear: `gemm_operand_stats` of its rows of x and dy and its
    weight, with the key its dense call would get (`fold_in(linear key, e)`)."""
    cfg, stats, operands, micro_key = probed(tiny_config)
    recipe = nvfp4_ops.get_recipe("nvfp4")
    assert {p for p in stats if "experts" in p} == {f"{p}[{e}]" for p in GROUPED for e in range(4)}
    for path in GROUPED:
        x, w, dy, sizes = operands[path]
        linear_key = linear_keys(cfg.model, micro_key)[path]
        starts = np.cumsum(sizes) - sizes
        for e in range(EXPERTS):
            got = stats[f"{path}[{e}]"]
            assert set(got) == TOKEN_ROLES | WEIGHT_ROLES
            rows = slice(int(starts[e]), int(starts[e] + sizes[e]))
            if e == IDLE:  # no rows: zeros in the probe (no NaN), the weight as always
                assert all(float(v) == 0 for r in TOKEN_ROLES for v in got[r].values())
                rows = slice(0, 1)
            want = nvfp4_ops.gemm_operand_stats(
                x[rows], w[e], dy[rows], recipe, jax.random.fold_in(linear_key, e)
            )  # fmt: skip
            for role in WEIGHT_ROLES if e == IDLE else set(want):
                for stat in nvfp4_ops.STATS:
                    where = f"{path}[{e}] {role} {stat}"
                    g, v = float(got[role][stat]), float(want[role][stat])
                    assert (
                        g == pytest.approx(v, rel=1e-6, abs=0) if stat == "rel_error" else g == v
                    ), where
                if role in TOKEN_ROLES:
                    assert int(got[role][EXPERT_TOKENS]) == int(sizes[e])


def test_an_idle_expert_has_no_x_or_dy_rows(tiny_config):
    _, stats, _, _ = probed(tiny_config)
    row = quant_row(2, stats)["quant"]
    assert set(row["layers.0.mlp.experts.down[3]"]) == WEIGHT_ROLES
    assert set(row["layers.0.mlp.experts.down[0]"]) == TOKEN_ROLES | WEIGHT_ROLES
    assert isinstance(row["layers.0.mlp.experts.down[0]"]["fprop_x"][EXPERT_TOKENS], int)
    assert json.loads(json.dumps(row)) == row


def test_expert_rows_and_health_warnings_name_the_expert():
    stats = {
        "fprop_x": {"rel_error": jnp.array([0.09, 0.4, 0.0]), "amax": jnp.array([1.0, 2, 0])},
        "fprop_w": {"rel_error": jnp.array([0.1, 0.1, 0.1])},
    }
    rows = expert_stats("layers.2.mlp.experts.gate_up", stats, jnp.array([5, 2, 0], jnp.int32))
    quant = quant_row(7, rows)["quant"]
    assert quant["layers.2.mlp.experts.gate_up[2]"] == {
        "fprop_w": {"rel_error": pytest.approx(0.1)}
    }
    tracker = make_health_tracker(QuantHealthConfig(patience=1))
    _, lines = tracker.update(tracker.init(), quant, step=7)
    assert lines == [
        "quant health: layers.2.mlp.experts.gate_up[1] fprop_x rel_error 0.4 above its limit "
        "0.15 for 1 probe (since step 7)"
    ]


# ----------------------------------------------------------------------------- one run


@pytest.fixture(scope="module")
def moe_telemetry_runs(tmp_path_factory, tiny_config):
    """(rows with telemetry, rows without, what the telemetry run printed, its directory)."""
    root = tmp_path_factory.mktemp("moe_telemetry")
    strict = {"activation": {"rel_error": 0.01}, "patience": 2}
    out, rows = io.StringIO(), {}
    for name, logging in (("on", {"quant_stats_every": 1, "quant_health": strict}), ("off", {})):
        sections = {**MOE_RUN, "logging": {**MOE_RUN["logging"], **logging}}
        run(config_from_dict(tiny_config(root / name, **sections)), stream=out)
        rows[name] = read_metrics(root / name / "metrics.jsonl")
        if name == "on":
            printed = out.getvalue()
    return rows["on"], rows["off"], printed, root / "on"


def test_the_probe_changes_nothing_in_training(moe_telemetry_runs):
    on, off, _, _ = moe_telemetry_runs
    losses = [(r["step"], r["loss"]) for r in on if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in off if "loss" in r]  # bit-identical
    assert [r["moe"] for r in on if "moe" in r] == [r["moe"] for r in off if "moe" in r]
    assert not any("quant" in r for r in off)


def test_run_rows_have_every_expert_that_got_tokens(moe_telemetry_runs):
    """The probe of step s sees the batch and parameters of step s: an expert has x/dy roles
    exactly when the step's `moe` load gives it a share, and its rows are that share."""
    on, _, printed, _ = moe_telemetry_runs
    load = {r["step"]: r["moe"]["layers.0"]["load"] for r in on if "moe" in r}
    quant = [r for r in on if "quant" in r]
    assert [r["step"] for r in quant] == sorted(load)
    for row in quant:
        for path in GROUPED:
            tokens = []
            for e in range(EXPERTS):
                roles = row["quant"][f"{path}[{e}]"]
                assert set(roles) == (TOKEN_ROLES if load[row["step"]][e] else set()) | WEIGHT_ROLES
                tokens.append(roles.get("fprop_x", {}).get(EXPERT_TOKENS, 0))
            np.testing.assert_allclose(np.array(tokens) / sum(tokens), load[row["step"]], rtol=1e-6)
    warnings = [line for line in printed.splitlines() if line.startswith("quant health:")]
    assert any("layers.0.mlp.experts.down[" in w and "fprop_x rel_error" in w for w in warnings)


def test_plot_quant_draws_one_row_per_expert(moe_telemetry_runs, tmp_path):
    on, _, _, run_dir = moe_telemetry_runs
    paths, _, _ = quant_grid(on, "rel_error")
    assert paths == [
        "layers.0.attn.qkv", "layers.0.attn.o",
        *(f"{p}[{e}]" for p in GROUPED for e in range(EXPERTS)),
    ]  # fmt: skip
    assert main(["plot", "--quant", str(run_dir), "-o", str(tmp_path / "q.png")]) == 0


def test_plot_experts_writes_a_png(moe_telemetry_runs, tmp_path, capsys):
    _, _, _, run_dir = moe_telemetry_runs
    out = tmp_path / "load.png"
    assert main(["plot", "--experts", str(run_dir), "-o", str(out)]) == 0
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    assert capsys.readouterr().out.strip() == f"wrote {out}"


def test_plot_experts_refuses_a_dense_run(tmp_path, capsys):
    dense = tmp_path / "dense"
    dense.mkdir()
    rows = [{"step": s, "loss": 3.0 / s} for s in (1, 2)] + [{"step": 2, "quant": {}}]
    (dense / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["plot", "--experts", str(dense)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: run_dir: '{dense}' has no Mixture")
    assert not (dense / "experts.png").exists()
    assert main(["plot", "--experts", str(dense), str(dense)]) == 2
    assert "plot --experts takes one RUN_DIR, got 2" in capsys.readouterr().err


def _block(load, dropped=0.0):
    return {"load": load, "max_load": max(load) * len(load), "dropped": dropped}


def test_expert_load_orders_blocks_by_layer_and_keeps_the_later_row(tmp_path):
    rows = [
        {"step": 2, "moe": {"layers.10": _block([0.5, 0.5]), "layers.2": _block([0.9, 0.1])}},
        {"step": 1, "moe": {"layers.2": _block([0.25, 0.75], dropped=0.125)}},
        {"step": 2, "quant": {}},
        {"step": 2, "moe": {"layers.10": _block([1.0, 0.0]), "layers.2": _block([0.5, 0.5])}},
    ]
    load = expert_load(rows)
    assert load.steps == [1, 2] and list(load.share) == ["layers.2", "layers.10"]
    np.testing.assert_array_equal(load.share["layers.2"], [[0.25, 0.5], [0.75, 0.5]])
    np.testing.assert_array_equal(load.share["layers.10"], [[np.nan, 1.0], [np.nan, 0.0]])
    np.testing.assert_array_equal(load.max_load["layers.10"], [np.nan, 2.0])
    np.testing.assert_array_equal(load.dropped["layers.2"], [0.125, 0.0])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_experts(tmp_path / "run", tmp_path / "load.png")  # with the dropped panel
    assert out.read_bytes().startswith(PNG_MAGIC)
