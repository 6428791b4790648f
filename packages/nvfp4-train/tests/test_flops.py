"""Model FLOPs and MFU (`nvfp4_train.model.flops`): N against the model's parameter tree, the whole
count against XLA's cost analysis of the forward pass, the peak table, and the row fields."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.model.flops import (
    Peak,
    Throughput,
    device_peak,
    matmul_params,
    train_flops_per_token,
)
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.step import forward
from nvfp4_train.tree_paths import flat_paths

MODEL = {"d_model": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 256,
         "max_seq_len": 128, "vocab_size": 96}  # fmt: skip


def run_config(**model):
    return config_from_dict(
        {"model": MODEL | model, "precision": {"recipe": "bf16"}, "train": {"seq_len": 128}}
    )


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matmul_params_are_the_kernels_of_the_parameter_tree(tied):
    cfg = run_config(tie_embeddings=tied, architecture="qwen2", qkv_bias=True)  # biases: not N
    _, state = abstract_state(cfg)
    leaves = flat_paths(state.params)
    kernels = sum(x.size for p, x in leaves.items() if p.endswith("kernel"))
    embedding = leaves["embed.embedding"].size
    assert embedding == 96 * 128
    assert matmul_params(cfg.model) == kernels + (embedding if tied else 0)


def test_the_count_matches_xlas_cost_of_the_forward_pass():
    """XLA counts the forward's dots (2 FLOPs per multiply-add) with the whole L x L score
    matrix (the causal mask is elementwise): 2 N + 4 H K L per token and layer. The formula's
    training count is 3x the forward with half the scores (causal)."""
    cfg = run_config()
    graphdef, state = abstract_state(cfg)
    b, l, m = 2, 128, cfg.model
    tokens = jax.ShapeDtypeStruct((b, l), jnp.int32)
    cost = jax.jit(lambda p, t: forward(graphdef, p, t)).lower(state.params, tokens).cost_analysis()
    forward_full = b * l * (2 * matmul_params(m) + 4 * m.num_layers * m.num_heads * 64 * l)
    assert forward_full <= cost["flops"] <= 1.05 * forward_full  # + norms, softmax, RoPE
    causal_training = 3 * (forward_full - b * l * 2 * m.num_layers * m.num_heads * 64 * l)
    assert train_flops_per_token(m, seq_len=l) * b * l == causal_training


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA B200", "B200"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", "H200 NVL"),
    ],
)
def test_device_peaks(kind, name):
    assert device_peak(kind).name == name


def test_row_fields_per_device_and_mfu_only_where_the_peak_is_known():
    assert device_peak("cpu") is None and device_peak("NVIDIA RTX A6000") is None
    cpu = Throughput(flops_per_token=10**9, devices=1, peak=None, quantized=True)
    assert cpu.fields(2000.0) == {"model_tflops_per_device": 2.0}
    gpu = Throughput(10**9, 8, Peak("B200", 2250.0, 9000.0), quantized=True)
    row = gpu.fields(9e6)  # 9e15 FLOP/s over 8 devices
    np.testing.assert_allclose(
        [row["model_tflops_per_device"], row["mfu"], row["mfu_fp4"]], [1125.0, 0.5, 0.125]
    )
    bf16 = Throughput(10**9, 8, Peak("H100 SXM", 989.5, None), quantized=False)
    assert set(bf16.fields(1e6)) == {"model_tflops_per_device", "mfu"}


def test_a_hybrid_pattern_counts_each_block_by_its_kind():
    """Hand count of "M*-E": Mamba (in_proj, out_proj, conv, SSD), attention, relu2 MLP, MoE."""
    mamba = {"num_heads": 16, "head_dim": 16, "state_dim": 32, "n_groups": 2, "chunk_size": 64,
             "conv_kernel": 4}  # fmt: skip
    moe = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 64}
    cfg = run_config(architecture="nemotron_h", pattern="M*-E", num_layers=4, rope=False,
                     mlp_activation="relu2", mamba=mamba, moe=moe).model  # fmt: skip
    d, f, v, length = 128, 256, 96, 128
    h, p, n, g, q, k = 16, 16, 32, 2, 64, 4
    inner, conv = h * p, h * p + 2 * g * n
    in_proj = 2 * inner + 2 * g * n + h
    attention = d * (2 + 2 * 1) * 64 + 2 * 64 * d
    n_matmul = (d * in_proj + inner * d) + attention + 2 * d * f + (3 * d * 2 * 64 + d * 4)
    assert matmul_params(cfg) == n_matmul + d * v
    ssd = 2 * conv * k + 2 * q * (g * n + h * p) + 2 * h * p * n + 2 * h * p * n / q + 2 * h * p * n
    expected = 6 * (n_matmul + d * v) + 6 * 2 * 64 * length + 3 * ssd
    assert train_flops_per_token(cfg, seq_len=length) == int(expected)
    _, state = abstract_state(
        run_config(
            architecture="nemotron_h",
            pattern="M*-",
            num_layers=3,
            rope=False,
            mlp_activation="relu2",
            mamba=mamba,
        )
    )
    kernels = sum(x.size for p_, x in flat_paths(state.params).items()
                  if p_.endswith("kernel") and "conv1d" not in p_)  # fmt: skip
    dense = run_config(architecture="nemotron_h", pattern="M*-", num_layers=3, rope=False,
                       mlp_activation="relu2", mamba=mamba).model  # fmt: skip
    assert matmul_params(dense) == kernels  # untied: the head's kernel is the D * V
