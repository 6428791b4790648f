"""`precision.gather` (`model.weight_gather`): what FSDP gathers of each linear's kernel.

- On 8 fake CPU devices (one subprocess, `weight_gather_check.py`): a 3-block model (blocks 0 and
  2 BF16, block 1 NVFP4) on fsdp=8 under "compute" and "quantized", and a 4-block model whose
  NVFP4 blocks 1-2 are stacked and scanned on fsdp=4 x tensor=2 under "quantized" (the BF16
  blocks gather as under "compute"), give the loss, the logits and every parameter's gradient of
  "master" bit for bit, but for the final norm's scale gradient where XLA sums over the tokens in
  another order (module `weight_gather`'s docstring; in these small models XLA gathers the BF16
  kernels under "master" too: where it splits their contraction instead, BF16-policy linears
  differ more, docs/distributed.md); the compiled "quantized" step
  all-gathers exactly the NVFP4 linears' packed codes as uint8 (K * N / 2 bytes per kernel, over
  `tensor` split as the kernel is; once per kernel in the scan body), which "master" never does.
- Config: the allowed modes; a kernel slice that is not whole 16x16 tiles is refused with one
  line naming the kernel, the dimension and the mesh; which linears gather how.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import nvfp4_ops
from nvfp4_train.errors import ConfigError
from nvfp4_train.mesh_axes import AXES
from nvfp4_train.model.weight_gather import GatherPlan, check_tiles, mode_for
from nvfp4_train.precision.policy import PrecisionConfig

EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
D_MODEL, MLP, QKV = 128, 64, (4 + 2 * 2) * 32
NVFP4_KERNELS = [(D_MODEL, QKV), (D_MODEL, D_MODEL), (D_MODEL, 2 * MLP), (MLP, D_MODEL)]
"""An NVFP4 block's kernels [K, N] (qkv, o, gate_up, down) of weight_gather_check.CFG."""
REORDERED = "['final_norm']['scale']"
"""The one gradient whose float32 sum over the tokens XLA may order differently when the last
block's BF16 gather is explicit (the module doc)."""
REORDER_TOLERANCE = 1e-4
"""max |difference| / max |master's gradient| allowed there: a float32 sum of 128 terms in
another order moves it by a few 1e-6 of the largest term (measured 4.5e-6)."""


def test_every_mode_equals_master_and_quantized_gathers_codes_also_in_scanned_blocks():
    script = Path(__file__).with_name("weight_gather_check.py")
    cases = [{"fsdp": 8}, {"fsdp": 4, "tensor": 2, "scan": True, "modes": ["quantized"]}]
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], capture_output=True, text=True,
        env={**os.environ, **EIGHT}, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for result, case in zip(results, cases, strict=True):
        assert set(result["differ"]) == set(case.get("modes", ("compute", "quantized")))
        for mode, differ in result["differ"].items():
            others = {k: v for k, v in differ.items() if v and k != REORDERED}
            assert not others, (case, mode, others)
            assert result["scaled"][mode][REORDERED] <= REORDER_TOLERANCE, (case, mode)
        tensor = case.get("tensor", 1)
        codes = sum(k * n // 2 for k, n in NVFP4_KERNELS) // tensor
        assert result["collectives"]["quantized"].get("u8") == codes, result["collectives"]
        assert "u8" not in result["collectives"]["master"]


def test_gather_modes_are_checked():
    assert PrecisionConfig(gather="quantized").gather == "quantized"
    with pytest.raises(ValueError, match=r"precision.gather must be one of .*'fp4'"):
        PrecisionConfig(gather="fp4")
    with pytest.raises(ValueError, match=r"gather=quantized .* got precision.backend='te'"):
        PrecisionConfig(gather="quantized", backend="te")


def test_a_kernel_slice_that_is_not_whole_tiles_is_refused():
    mesh = jax.sharding.AbstractMesh((1, 8, 1, 1), AXES)
    plan = GatherPlan(mesh, ("fsdp", None), (None, None), 0)
    check_tiles(plan, (128, 48), "qkv")
    with pytest.raises(ConfigError, match=r"qkv \(64, 48\) dimension 0 \(64 split 8 ways"):
        check_tiles(plan, (64, 48), "qkv")
    with pytest.raises(ConfigError, match=r"dimension 1 \(40\) gives slices of 40"):
        check_tiles(plan, (128, 40), "qkv")


def test_which_linears_gather_how():
    nvfp4, bf16 = nvfp4_ops.get_recipe("nvfp4"), nvfp4_ops.get_recipe("bf16")
    assert mode_for("quantized", nvfp4) == "quantized"
    assert mode_for("quantized", nvfp4.with_bf16_fprop()) == "compute"
    assert mode_for("quantized", nvfp4_ops.get_recipe("nvfp4-no-2d")) == "compute"
    assert mode_for("compute", nvfp4) == "compute"
    modes = [mode_for(g, bf16) for g in ("master", "compute", "quantized")]
    assert modes == ["master", "compute", "compute"]  # BF16 linears: nothing to quantize


def test_show_config_estimates_the_gathers_of_each_mode():
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.comms import format_gathers, gathered_bytes

    model = {"vocab_size": 64, "d_model": 128, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "mlp_dim": 64, "max_seq_len": 16}  # fmt: skip
    precision = {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0}
    cfg = config_from_dict({"output_dir": "/tmp/unused", "model": model, "precision": precision,
                            "train": {"seq_len": 16}, "mesh": {"data": 1, "fsdp": 8}})  # fmt: skip
    totals = gathered_bytes(cfg, 8)
    elements = 2 * sum(k * n for k, n in NVFP4_KERNELS) * 7 / 8  # two blocks, 7/8 received
    assert totals == {"master": 4 * elements, "compute": 2 * elements,
                      "quantized": 0.5625 * elements}  # fmt: skip
    assert "master" in format_gathers(cfg, 8) and "<- precision.gather" in format_gathers(cfg, 8)


def test_a_run_whose_kernel_slices_are_not_whole_tiles_is_refused_at_start_up():
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.comms import check_gather_tiles

    model = {"vocab_size": 64, "d_model": 64, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "mlp_dim": 64, "max_seq_len": 16}  # fmt: skip
    sections = {"output_dir": "/tmp/unused", "model": model, "train": {"seq_len": 16},
                "mesh": {"data": 1, "fsdp": 8}}  # fmt: skip
    precision = {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 0}
    check_gather_tiles(config_from_dict({**sections, "precision": precision}), 8)  # master
    quantized = config_from_dict({**sections, "precision": {**precision, "gather": "quantized"}})
    with pytest.raises(
        ConfigError, match=r"layers.0.attn.o.kernel \(64, 64\) dimension 1 \(64 split 8"
    ):
        check_gather_tiles(quantized, 8)
