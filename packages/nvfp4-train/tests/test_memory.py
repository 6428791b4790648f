"""`show-config --memory`: exact per-device parameter, optimizer and gradient bytes from the
sharding rules, and the activation estimate ordered by how much each remat policy keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nvfp4_train.cli import main
from nvfp4_train.config.run_config import ConfigError, config_from_dict, load_config
from nvfp4_train.training.memory import GIB, estimate_memory
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.step import count_params

REPO = Path(__file__).resolve().parents[3]
MODEL = {"vocab_size": 256, "d_model": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
         "mlp_dim": 128, "max_seq_len": 64}  # fmt: skip


def cfg(remat="none", **sections):
    return config_from_dict(
        {"model": {**MODEL, "remat": remat},
         "train": {"batch_size": 16, "seq_len": 64, "grad_accum_steps": 2}, **sections}
    )  # fmt: skip


def test_parameters_and_optimizer_are_counted_exactly_and_split_by_fsdp():
    one = estimate_memory(cfg(), 1)
    n = count_params(abstract_state(cfg())[1].params)
    assert one.parameters == one.gradients == 4 * n
    assert 0 <= one.optimizer - 2 * 4 * n < 64  # Adam's mu and nu in float32, a few counters
    sharded = estimate_memory(cfg(mesh={"data": 1, "fsdp": -1}), 4)
    assert sharded.mesh == {"data": 1, "fsdp": 4, "expert": 1, "tensor": 1}
    assert sharded.parameters < one.parameters / 3  # norm scales stay replicated
    assert sharded.sequences == 16 // 2 // 4


def test_activations_shrink_with_each_remat_policy_that_keeps_less():
    kept = [estimate_memory(cfg(remat), 1).activations
            for remat in ("none", "dots", "dots_no_batch", "quantized", "full")]  # fmt: skip
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 5
    full = estimate_memory(cfg("full"), 1)
    assert full.activations == 4 * 8 * 64 * 64 * 2  # blocks x sequences x tokens x d_model x bf16


def test_the_8b_config_fits_8_blackwell_gpus_as_its_comment_says():
    cfg = load_config(REPO / "examples/configs/llama3-8b-blackwell.yaml")
    estimate = estimate_memory(cfg, 8)
    assert estimate.attention == "cudnn"  # auto on NVIDIA GPUs, bfloat16, head_dim 128
    assert round(estimate.parameters / GIB, 1) == 3.7 and round(estimate.optimizer / GIB, 1) == 7.5
    assert (
        round(estimate.activations / GIB, 1) == 20.3 and round(estimate.transient / GIB, 1) == 31.3
    )
    assert round(estimate.total / GIB) == 67
    naive = estimate_memory(cfg, 8, "naive")
    assert round(naive.transient / GIB) == 48 and round(naive.total / GIB) == 83


def test_show_config_prints_the_estimate_as_yaml_comments(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "train": {"batch_size": 8, "seq_len": 32}}))
    assert main(["show-config", str(path), "model.remat=full", "--devices", "1"]) == 0
    printed = capsys.readouterr().out
    assert "# memory per device on 1 devices" in printed and "remat: full" in printed
    assert yaml.safe_load(printed)["model"]["remat"] == "full"


def test_memory_needs_a_vocabulary_and_a_mesh_that_fits():
    with pytest.raises(ConfigError, match="vocab_size is 0"):
        estimate_memory(config_from_dict({}), 1)
    with pytest.raises(ConfigError, match="mesh for 3 devices"):
        estimate_memory(cfg(mesh={"data": 2, "fsdp": 1}), 3)


def test_a_schedule_counts_the_phase_that_keeps_the_most():
    edges = {"bf16_first_layers": 0, "bf16_last_layers": 0}
    quantized = estimate_memory(cfg("quantized", precision={"recipe": "nvfp4", **edges}), 1)
    plain = estimate_memory(cfg("quantized", precision={"recipe": "bf16", **edges}), 1)
    assert plain.activations < quantized.activations and not quantized.peak_phase
    late = {"recipe": "bf16", **edges,
            "schedule": [{"layers": ".*", "from": 5, "recipe": "nvfp4"}]}  # fmt: skip
    scheduled = estimate_memory(cfg("quantized", precision=late), 1)
    assert scheduled.activations == quantized.activations
    assert scheduled.peak_phase == "[5, end)"


def _at_length(seq_len, remat="none"):
    model = {**MODEL, "max_seq_len": 512, "remat": remat, "attention_block": 128}
    return config_from_dict({"model": model, "train": {"batch_size": 2, "seq_len": seq_len}})


def test_fused_attention_keeps_no_scores_and_grows_linearly_with_length():
    kept = {
        (name, length): estimate_memory(_at_length(length), 1, name)
        for name in ("naive", "cudnn", "chunked")
        for length in (256, 512)
    }
    for name in ("cudnn", "chunked"):  # per token the same at any length
        assert kept[name, 512].activations == 2 * kept[name, 256].activations
    assert kept["naive", 512].activations > 2.5 * kept["naive", 256].activations
    assert kept["naive", 512].activations > 3 * kept["cudnn", 512].activations
    heads, c = MODEL["num_heads"], 2  # bfloat16
    logits = 2 * 2 * 512 * 256 * 4
    assert kept["naive", 512].transient == 2 * heads * 512 * 512 * (4 + c)
    assert kept["chunked", 512].transient == max(2 * heads * 128 * 128 * (4 + c), logits)
    assert kept["cudnn", 512].transient == logits
    full = {name: estimate_memory(_at_length(512, "full"), 1, name) for name in ("naive", "cudnn")}
    assert full["naive"].activations == full["cudnn"].activations  # only the block inputs


def test_show_config_estimates_the_gpu_attention_and_lists_the_others(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL, "train": {"batch_size": 8, "seq_len": 32}}))
    assert main(["show-config", str(path), "--devices", "1"]) == 0
    printed = capsys.readouterr().out
    assert "attention: cudnn)" in printed  # auto on an NVIDIA GPU, bfloat16, head_dim 16
    table = printed[printed.index("# total per device by model.attention") :].splitlines()
    assert table[1].split() == ["#", "none", "dots", "quantized", "full"]
    assert [row.split()[1] for row in table[2:]] == ["naive", "cudnn", "chunked"]
    assert yaml.safe_load(printed)["model"]["attention"] == "auto"
