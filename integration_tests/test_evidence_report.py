"""The evidence study's script (examples/evidence): pairing, statistics, ordering, and a tiny real run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

EVIDENCE = Path(__file__).resolve().parents[1] / "examples" / "evidence"
sys.path.insert(0, str(EVIDENCE))

import downstream  # noqa: E402
import evidence_report  # noqa: E402
import run_evidence  # noqa: E402


def _write_run(runs_dir: Path, variant: str, seed: int, curve: dict[int, float]) -> None:
    run_dir = runs_dir / evidence_report.run_dir_name(variant, seed)
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "loss": v + 0.1, "val_loss": v} for s, v in curve.items()]
    rows.insert(1, {"step": 1, "quant": {"layers.1.attn.qkv": {}}})  # telemetry rows are ignored
    text = "\n".join(json.dumps(r) for r in rows) + "\n{torn"
    (run_dir / "metrics.jsonl").write_text(text)


def test_paired_gaps_mean_and_sample_std(tmp_path):
    base = {0: 2.0, 1: 2.2, 2: 1.8}
    gaps = {0: 0.01, 1: 0.03, 2: -0.01}
    for seed in base:
        _write_run(tmp_path, "bf16", seed, {4: 3.0, 8: base[seed]})
        _write_run(tmp_path, "nvfp4", seed, {4: 3.3, 8: base[seed] * (1 + gaps[seed])})
    _write_run(tmp_path, "mxfp4", 0, {4: 3.0, 8: 2.1})  # seed 0 only: no std
    _write_run(tmp_path, "fp8", 0, {4: 3.0})  # unfinished: left out
    seeds = {"bf16": [0, 1, 2], "nvfp4": [0, 1, 2], "mxfp4": [0, 1], "fp8": [0]}
    rows, _ = evidence_report.collect(tmp_path, ["bf16", "nvfp4", "mxfp4", "fp8"], seeds, 8, 4)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"bf16", "nvfp4", "mxfp4"}
    nv = by_name["nvfp4"]
    assert nv["seeds"] == [0, 1, 2]
    assert nv["rel_gap_to_bf16"] == pytest.approx(0.01)
    assert nv["rel_gap_std"] == pytest.approx(0.02)  # sample std of 0.01, 0.03, -0.01
    assert nv["rel_gap_stable"] == pytest.approx(0.1)
    assert nv["final_val_loss"] == pytest.approx(sum(base[s] * (1 + gaps[s]) for s in base) / 3)
    assert by_name["bf16"]["rel_gap_to_bf16"] == 0.0
    mx = by_name["mxfp4"]
    assert mx["seeds"] == [0] and mx["rel_gap_std"] is None
    assert mx["rel_gap_to_bf16"] == pytest.approx(0.05)
    table = evidence_report.markdown_table(rows, {"nvfp4": "full recipe"})
    assert "| `nvfp4` | full recipe | 3 |" in table and "+1.00% ± 2.00" in table


def test_variants_are_paired_against_the_full_recipe_with_a_t_interval(tmp_path):
    full = {0: 2.0, 1: 2.2, 2: 1.8}
    diffs = {0: -0.010, 1: -0.012, 2: -0.008}  # consistent: the interval excludes 0
    noisy = {0: 0.02, 1: -0.03, 2: 0.005}
    for seed in full:
        _write_run(tmp_path, "bf16", seed, {8: full[seed] * 0.99})
        _write_run(tmp_path, "nvfp4", seed, {8: full[seed]})
        _write_run(tmp_path, "nvfp4-4over6", seed, {8: full[seed] * (1 + diffs[seed])})
        _write_run(tmp_path, "nvfp4-per-token", seed, {8: full[seed] * (1 + noisy[seed])})
    names = ["bf16", "nvfp4", "nvfp4-4over6", "nvfp4-per-token"]
    rows, _ = evidence_report.collect(tmp_path, names, dict.fromkeys(names, [0, 1, 2]), 8, None)
    by_name = {r["name"]: r for r in rows}
    assert "vs_nvfp4" not in by_name["nvfp4"] and "vs_nvfp4" not in by_name["bf16"]
    consistent = by_name["nvfp4-4over6"]["vs_nvfp4"]
    assert consistent["mean"] == pytest.approx(-0.010)
    assert consistent["std"] == pytest.approx(0.002)
    half = 4.303 * 0.002 / math.sqrt(3)  # Student t, 2 degrees of freedom
    assert consistent["ci95"] == pytest.approx([-0.010 - half, -0.010 + half])
    assert consistent["resolved"] is True
    assert by_name["nvfp4-per-token"]["vs_nvfp4"]["resolved"] is False
    assert by_name["nvfp4"]["vs_bf16"]["mean"] == pytest.approx(1 / 0.99 - 1)
    table = evidence_report.paired_table(rows)
    assert "| `nvfp4-4over6` | 3 | -1.00%, -1.20%, -0.80% | -1.00% [" in table
    assert "(resolved)" in table and "(not resolved)" in table


def test_a_nonfinite_loss_marks_the_variant_diverged(tmp_path):
    _write_run(tmp_path, "bf16", 0, {4: 3.0, 8: 2.0})
    _write_run(tmp_path, "nvfp4-naive", 0, {4: math.inf, 8: 2.5})
    seeds = {"bf16": [0], "nvfp4-naive": [0]}
    rows, _ = evidence_report.collect(tmp_path, ["bf16", "nvfp4-naive"], seeds, 8, None)
    assert rows[1]["diverged"] and not rows[0]["diverged"]


def test_schedule_finishes_whole_seed_zero_before_extra_seeds():
    args = run_evidence._parser().parse_args(
        ["--variants", "bf16", "nvfp4", "mxfp4", "--seeds", "3", "--ablation-seeds", "2"]
    )
    order = run_evidence.schedule(args)
    assert order[:3] == [("bf16", 0), ("nvfp4", 0), ("mxfp4", 0)]
    assert order[3:] == [("bf16", 1), ("nvfp4", 1), ("bf16", 2), ("nvfp4", 2), ("mxfp4", 1)]


def test_every_variant_gets_its_own_recipe_and_the_seed_pairs_data_and_init():
    args = run_evidence._parser().parse_args(["--runs-dir", "r"])
    for variant in run_evidence.VARIANTS:
        ov = run_evidence.overrides(args, variant, 2)
        assert "train.seed=2" in ov and f"output_dir={Path('r') / f'{variant}-s2'}" in ov
    assert "precision.bf16_first_layers=0" in run_evidence.overrides(args, "nvfp4-naive", 0)
    assert any("bf16_forward_from" in o for o in run_evidence.overrides(args, "nvfp4-late-bf16", 0))


def test_a_tiny_study_trains_pairs_and_writes_the_outputs(tmp_path):
    tiny = [
        "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=64", "model.max_seq_len=32", "train.seq_len=32", "train.batch_size=4",
        "train.steps=4", "train.eval_every=2", "optimizer.warmup_steps=1",
        "data.validation_batches=2", "checkpoint.every_steps=4",
    ]  # fmt: skip
    argv = [
        "--runs-dir", str(tmp_path / "runs"), "--out-dir", str(tmp_path / "docs"),
        "--variants", "bf16", "nvfp4", "--seeds", "1", "--quant-stats-every", "0",
        "--jobs", "2", "--set", *tiny,
    ]  # fmt: skip
    assert run_evidence.main(argv) == 0
    rows = json.loads((tmp_path / "docs" / "evidence.json").read_text())
    assert [r["name"] for r in rows] == ["bf16", "nvfp4"]
    for key in ("final_val_loss", "seeds", "rel_gap_to_bf16", "rel_gap_std"):
        assert all(key in r for r in rows)
    assert rows[1]["rel_gap_to_bf16"] != 0.0 and math.isfinite(rows[1]["final_val_loss"])
    # the quantized forward is the run's own: the cross-evaluation reproduces its validation loss
    assert rows[1]["val_loss_quantized_forward"] == pytest.approx(rows[1]["final_val_loss"], 1e-6)
    assert rows[1]["val_loss_bf16_forward"] != rows[1]["val_loss_quantized_forward"]
    assert "val_loss_bf16_forward" not in rows[0]
    assert (tmp_path / "docs" / "evidence" / "loss-curves.png").stat().st_size > 10_000
    # Rerunning trains nothing new (finished runs are skipped) and gives the same table.
    assert run_evidence.main(argv) == 0
    assert json.loads((tmp_path / "docs" / "evidence.json").read_text()) == rows


def test_downstream_pairs_each_seed_with_its_bf16_run_and_leaves_unpaired_seeds_out():
    runs = {
        "bf16": {0: {"t/acc": 0.50}, 1: {"t/acc": 0.70}, 2: {"t/acc": 0.60}},
        "nvfp4": {0: {"t/acc": 0.55}, 1: {"t/acc": 0.65}},  # seed 2 not trained
    }
    summary = downstream.summarize(runs)
    row = summary["nvfp4"]["t/acc"]
    assert row["paired_seeds"] == 2
    assert row["paired_diff_mean"] == pytest.approx(0.0)  # +0.05 and -0.05
    assert row["paired_diff_std"] == pytest.approx(math.sqrt(2) * 0.05)
    assert summary["bf16"]["t/acc"]["mean"] == pytest.approx(0.6)
    assert "paired_diff_mean" not in summary["bf16"]["t/acc"]
