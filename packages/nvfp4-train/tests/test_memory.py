"""`show-config --memory`: exact per-device parameter, optimizer and gradient bytes from the
sharding rules, and the activation estimate ordered by how much each remat policy keeps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from nvfp4_train.cli import main
from nvfp4_train.config.run_config import ConfigError, config_from_dict, load_config
from nvfp4_train.model.blocks.attention import cudnn_mask_is_dense
from nvfp4_train.training import memory
from nvfp4_train.training.device_memory import (
    check_memory_fits,
    device_capacity,
    host_ram,
    memory_refusal,
)
from nvfp4_train.training.memory import GIB, estimate_memory
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.step import count_params
from nvfp4_train.tree_paths import flat_paths

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
    policies = ("none", "dots", "dots_no_batch", "quantized", "full")
    kept = [estimate_memory(cfg(remat), 1, "naive").activations for remat in policies]
    assert kept == sorted(kept, reverse=True) and len(set(kept)) == 5
    # a fused kernel's matmuls are no dots: both dots policies keep just its output and
    # statistics (attention.SAVES_ATTENTION), so that its forward does not run twice
    fused = {remat: estimate_memory(cfg(remat), 1, "cudnn").activations for remat in policies}
    assert fused["dots"] == fused["dots_no_batch"] > fused["quantized"]
    heads, q = MODEL["num_heads"], MODEL["d_model"]  # head_dim * heads = d_model
    linears = estimate_memory(cfg("dots_no_batch"), 1, "naive").activations
    assert fused["dots_no_batch"] - linears == 4 * 8 * 64 * (q * 2 + heads * 4)
    full = estimate_memory(cfg("full"), 1)
    assert full.activations == 4 * 8 * 64 * 64 * 2  # blocks x sequences x tokens x d_model x bf16


def test_the_8b_config_fits_8_blackwell_gpus_as_its_comment_says():
    cfg = load_config(REPO / "examples/configs/llama3-8b-blackwell.yaml")
    estimate = estimate_memory(cfg, 8)
    # auto on NVIDIA GPUs without TE: cudnn, but not for 8192 masked tokens where it holds a
    # dense mask (jax <= 0.10.2)
    assert estimate.attention == ("chunked" if cudnn_mask_is_dense() else "cudnn")
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


def _at_length(seq_len, remat="none", masked=False):
    model = {**MODEL, "max_seq_len": 512, "remat": remat, "attention_block": 128}
    train = {"batch_size": 2, "seq_len": seq_len}
    return config_from_dict({"model": model, "train": train, "data": {"document_mask": masked}})


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


@pytest.mark.parametrize("dense", (True, False), ids=("jax<=0.10.2", "newer"))
def test_cudnn_with_document_masks_holds_a_dense_mask_where_jax_gives_it_one(monkeypatch, dense):
    monkeypatch.setattr(memory, "cudnn_mask_is_dense", lambda: dense)
    masked = {n: estimate_memory(_at_length(512, masked=True), 1, n) for n in ("cudnn", "chunked")}
    plain = estimate_memory(_at_length(512), 1, "cudnn")
    logits = 2 * 2 * 512 * 256 * 4
    if dense:  # the [L, L] bias kept per block (L*c per token), the mask, bias and gradient
        assert masked["cudnn"].activations - plain.activations == 4 * 2 * 512 * 512 * 2
        assert masked["cudnn"].transient == 2 * 512 * 512 * (1 + 2 * 2) > logits
    else:
        assert masked["cudnn"] == dataclasses.replace(plain, dense_mask=False)
    assert (
        masked["chunked"].activations == estimate_memory(_at_length(512), 1, "chunked").activations
    )
    assert masked["cudnn"].dense_mask is dense


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


MOE = {"num_experts": 8, "experts_per_token": 2, "expert_mlp_dim": 32}


def _moe_cfg(remat="quantized", mesh=None, **moe):
    model = {**MODEL, "remat": remat, "moe": {**MOE, **moe}}
    precision = {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0}
    return config_from_dict({"model": model, "precision": precision, "mesh": mesh or {},
                             "train": {"batch_size": 16, "seq_len": 64}})  # fmt: skip


def test_expert_parameters_split_over_the_expert_axis_exactly():
    """Routed experts' kernels [E, in, out] split by expert, their optimizer moments and gradients
    with them; everything else as with expert=1 (the expert axis is data parallelism there)."""
    one = estimate_memory(_moe_cfg(mesh={"data": 1}), 1)
    split = estimate_memory(_moe_cfg(mesh={"data": 1, "expert": 4}), 4)
    params = abstract_state(_moe_cfg())[1].params
    expert = sum(4 * leaf.size for path, leaf in flat_paths(params).items() if ".experts." in path)
    assert expert == 4 * MODEL["num_layers"] * 8 * (64 * 64 + 32 * 64)
    assert one.parameters == one.gradients == 4 * count_params(params)
    assert split.parameters == one.parameters - expert + expert // 4
    assert split.optimizer - (one.optimizer - 2 * expert + 2 * expert // 4) in range(-64, 64)


def test_moe_activations_count_the_routed_rows_and_the_dispatch_buffers():
    """remat quantized, one device: an MoE block keeps the FP4 operands of its grouped GEMMs for
    the k routed copies of each token, R = T k rows of (d + F) elements, instead of a dense MLP's
    (d + f) per token; with data=2 x expert=4 each device's experts see all T = 8 T_l tokens and
    its buffer holds every row its experts could take (one expert per device: R = T)."""
    d, f, big_f, k, t = 64, 128, 32, 2, 16 * 64  # t: tokens per device (16 sequences)
    dense = estimate_memory(_moe_cfg(num_experts=0), 1).activations
    moe = estimate_memory(_moe_cfg(), 1).activations
    per_block = t * k * (d + big_f) * 9 / 16 - t * (d + f) * 9 / 16
    assert moe - dense == int(4 * per_block) or moe - dense == int(4 * per_block) + 1
    ep = estimate_memory(_moe_cfg(mesh={"data": 2, "expert": 4}), 8)
    t_local = 2 * 64  # 16 sequences over 8 devices
    rows = 8 * t_local  # all tokens of the batch, each taking at most one row per expert
    per_block = rows * (d + big_f) * 9 / 16 - t_local * (d + f) * 9 / 16
    ep_dense = estimate_memory(_moe_cfg(mesh={"data": 2, "expert": 4}, num_experts=0), 8)
    assert abs(ep.activations - ep_dense.activations - 4 * per_block) <= 1
    kept = {r: estimate_memory(_moe_cfg(r), 1).activations
            for r in ("none", "dots", "quantized", "full")}  # fmt: skip
    assert kept["none"] > kept["dots"] > kept["quantized"] > kept["full"]


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ConfigError, match=r"num_experts=8 must be a multiple of mesh.expert=16"):
        estimate_memory(_moe_cfg(mesh={"data": 1, "expert": -1}), 16)


ROUTED = ("dispatch: the routed tokens [T, D]", "dispatch: the sorted token rows [R, D]",
          "grouped GEMM: operands, FP4 copies, float32 decodes and output",
          "the experts' outputs in assignment order [T k, D]",
          "combine: the k outputs per token [T, k, D] (float32)")  # fmt: skip


def _routed_by_hand(k, tokens=16 * 64, d=64, f=32, experts=8, c=2):
    """One device's routed-expert buffers of `_moe_cfg` by hand: R = T k rows, padded per expert
    to 16-row tiles (R_p); the largest GEMM is gate_up's (K = d, N = 2F: R_p (K + N) = 2160 x 128
    against down's 2160 x 96), each element of its operands and output an FP4 copy and a float32
    decode (4 + 9/16 bytes), its token tiles in BF16."""
    rows = tokens * k
    padded = (rows + experts * 15) // 16 * 16  # 2160 for k = 2
    gemm = padded * d * c + (padded * (d + 2 * f) + experts * d * 2 * f) * (4 + 9 / 16)
    values = (tokens * d * c, rows * d * c, gemm, tokens * k * d * c, tokens * k * d * 4)
    return {name: int(v) for name, v in zip(ROUTED, values, strict=True)}


def test_one_moe_block_holds_its_routed_buffers_at_once_named_and_scaling_with_top_k():
    estimate = estimate_memory(_moe_cfg(), 1, "naive")
    routed = dict(estimate.moe_buffers)
    assert routed == _routed_by_hand(2)
    top4 = dict(estimate_memory(_moe_cfg(experts_per_token=4), 1, "naive").moe_buffers)
    assert top4 == _routed_by_hand(4)
    for name in ROUTED[1:2] + ROUTED[3:]:  # the dispatch rows, the outputs, the combine buffer
        assert top4[name] == 2 * routed[name]
    assert top4[ROUTED[0]] == routed[ROUTED[0]]  # the tokens do not depend on k
    assert estimate.transient == sum(routed.values())  # larger than the logits and the scores
    text = memory.format_estimate(estimate)
    assert "largest transient: one MoE block's routed experts (below)" in text
    assert all(name in text for name in ROUTED)
    mesh = {"data": 2, "expert": 4}  # one expert per device: R = the batch's 8 T_l tokens
    local, batch = 2 * 64, 8 * 2 * 64
    ep = dict(estimate_memory(_moe_cfg(mesh=mesh), 8).moe_buffers)  # all-to-all: its T_l tokens
    assert ep[ROUTED[0]] == local * 64 * 2 and ep[ROUTED[1]] == batch * 64 * 2
    assert ep[ROUTED[4]] == local * 2 * 64 * 4
    gather = dict(estimate_memory(_moe_cfg(mesh=mesh, dispatch="all_gather"), 8).moe_buffers)
    assert gather[ROUTED[0]] == batch * 64 * 2 and gather[ROUTED[1]] == batch * 64 * 2
    assert gather[ROUTED[4]] == batch * 2 * 64 * 4  # every device combines the whole batch
    assert not estimate_memory(cfg(), 1).moe_buffers  # a dense model has none


QWEN3_GIB = {"parameters": 2.4, "optimizer": 4.8, "activations": 32.2, "transient": 12.4,
             "total": 54.2}  # fmt: skip


def test_the_qwen3_moe_config_estimate_is_the_one_its_comment_states():
    cfg = load_config(REPO / "examples/configs/qwen3-30b-a3b.yaml")
    estimate = estimate_memory(cfg, 64)
    assert estimate.mesh == {"data": 1, "fsdp": 8, "expert": 8, "tensor": 1}
    gib = {k: round(getattr(estimate, k) / GIB, 1)
           for k in ("parameters", "optimizer", "activations", "transient", "total")}  # fmt: skip
    assert gib == QWEN3_GIB


def hybrid(remat="none", seq_len=64, chunk=16, **model):
    mamba = {"num_heads": 16, "head_dim": 8, "state_dim": 16, "n_groups": 2, "chunk_size": chunk}
    return config_from_dict(
        {"model": {**MODEL, "architecture": "nemotron_h", "pattern": "M*-M", "rope": False,
                   "mlp_activation": "relu2", "remat": remat, "max_seq_len": 256, "mamba": mamba,
                   **model},
         "train": {"batch_size": 4, "seq_len": seq_len}}
    )  # fmt: skip


def test_the_tiny_hybrid_estimate_runs_and_names_the_scan_buffers(capsys):
    path = REPO / "examples" / "configs" / "tiny-hybrid.yaml"
    cfg = load_config(path, ["model.vocab_size=257"])
    estimate = estimate_memory(cfg, 1)
    assert estimate.activations > 0
    text = memory.format_estimate(estimate)
    assert "chunked SSD scans" in text and "decay and segment sums [B, C, G, R, Q, Q]" in text


def test_the_mamba_scan_buffers_grow_linearly_with_seq_len_and_chunk_size():
    def buffers(**kw):
        return dict(estimate_memory(hybrid(**kw), 1).scan_buffers)

    decay = "decay and segment sums [B, C, G, R, Q, Q]"
    states = "chunk states [B, chunks, H, P, N]"
    base = buffers()  # 4 sequences x 64 tokens, chunk 16, two Mamba blocks
    tokens, h, q, g, p, n = 4 * 64, 16, 16, 2, 8, 16
    assert base[decay] == 2 * tokens * 2 * h * q * 4  # 2 blocks x 2 H Q float32 per token
    assert base["scores C B^T [B, C, G, Q, Q]"] == 2 * tokens * g * q * 4
    assert base[states] == 2 * (tokens // q) * h * p * n * 4
    longer, wider = buffers(seq_len=128), buffers(chunk=32)
    assert longer[decay] == 2 * base[decay] and longer[states] == 2 * base[states]
    assert wider[decay] == 2 * base[decay] and wider[states] == base[states] // 2
    assert not dict(estimate_memory(hybrid("quantized"), 1).scan_buffers)
    kept = [
        estimate_memory(hybrid(r), 1).activations for r in ("none", "dots", "quantized", "full")
    ]
    assert kept == sorted(kept, reverse=True) and kept[-1] > 0


class _Device:
    """A stand-in for a jax device: its platform, kind and allocator limit (None: not reported)."""

    def __init__(self, platform="gpu", limit=None):
        self.platform, self.device_kind, self._limit = platform, f"fake {platform}", limit

    def memory_stats(self):
        return None if self._limit is None else {"bytes_limit": self._limit}


def test_what_a_device_holds_is_its_limit_or_its_share_of_the_host_ram():
    assert device_capacity(_Device(limit=80 * GIB), 8) == (80 * GIB, "fake gpu memory limit")
    ram, source = device_capacity(_Device("cpu"), 4)
    assert ram == host_ram() // 4 and source.endswith("over 4 CPU devices")
    assert device_capacity(_Device("tpu"), 1) is None  # reports nothing: not checked


def test_a_run_that_cannot_fit_its_device_is_refused_unless_told_to_try():
    check_memory_fits(_moe_cfg(), [_Device(limit=GIB)], 1)  # the tiny MoE fits 1 GiB
    huge = _moe_cfg(num_experts=4096)
    needed = estimate_memory(huge, 1, "naive").total
    with pytest.raises(ConfigError, match=r"per device .* but a device holds 1.0 GiB \(fake gpu "
                       r"memory limit\); .* set train.memory_check=false to try anyway"):  # fmt: skip
        check_memory_fits(huge, [_Device(limit=GIB)], 1)
    assert needed > GIB
    unchecked = dataclasses.replace(huge, train=dataclasses.replace(huge.train, memory_check=False))
    check_memory_fits(unchecked, [_Device(limit=GIB)], 1)
    assert memory_refusal(GIB, (GIB, "exactly")) is None
