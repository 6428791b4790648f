"""Streaming export: the same bytes as the in-memory export it replaced, in bounded memory.

`golden_export_sha256.json` holds the SHA-256 of every file (but the provenance, which names the
temporary source path) that the in-memory export (read the whole params tree, build every tensor,
`safetensors.numpy.save_file`) wrote for these cases, computed before the streaming export
replaced it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import SMALL_MODEL, model_config, write_run

from nvfp4_export import export_hf
from nvfp4_export.bfloat16 import bfloat16_values_transposed, to_bfloat16, transposed
from nvfp4_export.params_reader import CheckpointParams
from nvfp4_export.shard_writer import ShardWriter, TensorSlot

GOLDEN = json.loads((Path(__file__).parent / "golden_export_sha256.json").read_text())
CASES = {
    "tiny-w4a4": (None, {}),
    "tiny-wo-shard": (None, {"weight_only": True, "max_shard_bytes": 20000}),
    "tied-bias": ({**SMALL_MODEL, "qkv_bias": True, "o_bias": True, "tie_embeddings": True}, {}),
    "qwen3": (
        {**SMALL_MODEL, "architecture": "qwen3", "qk_norm": True, "qkv_bias": True,
         "o_bias": True},
        {"max_shard_bytes": 3000, "allow_dropped_tensors": True},
    ),
}  # fmt: skip


def _hashes(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.name != "nvfp4_export.json"
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_streaming_export_is_byte_identical_to_the_in_memory_export(case, tmp_path):
    overrides, kwargs = CASES[case]
    run = write_run(tmp_path / case, model=model_config(**overrides) if overrides else None)
    for layout in ("modelopt", "compressed-tensors"):
        out = tmp_path / f"{case}-{layout}"
        export_hf(run, out, layout=layout, **kwargs)
        assert _hashes(out) == GOLDEN[f"{case}/{layout}"], f"{case}/{layout}"


def test_shard_writer_matches_safetensors_save_file_in_any_write_order(tmp_path):
    import safetensors.numpy

    rng = np.random.default_rng(3)
    tensors = {
        "z.weight": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
        "a.scale": rng.standard_normal((3, 2)).astype(ml_dtypes.float8_e4m3fn),
        "m.packed": rng.integers(0, 256, (4, 9), dtype=np.uint8),
        "b.global": np.array(rng.standard_normal(), np.float32),
        "c.half": rng.standard_normal(3).astype(np.float16),
    }
    slots = [TensorSlot(n, a.dtype, a.shape) for n, a in tensors.items()]
    with ShardWriter(tmp_path, slots, 1 << 30) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, tensors[name])
    want = safetensors.numpy.save(tensors, {"format": "pt"})
    assert (tmp_path / "model.safetensors").read_bytes() == want


def test_shard_writer_refuses_a_tensor_of_another_shape(tmp_path):
    from nvfp4_export.errors import ExportError

    slots = [TensorSlot("w", np.dtype(np.float32), (2, 2))]
    want = r"tensor 'w' must be float32 \(2, 2\), got float32 \(2, 3\)"
    with pytest.raises(ExportError, match=want), ShardWriter(tmp_path, slots, 1 << 30) as writer:
        writer.write("w", np.zeros((2, 3), np.float32))


def test_bfloat16_rounding_and_transpose_match_ml_dtypes():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 1100)) * np.exp(rng.uniform(-90, 87, (300, 1100)))).astype(
        np.float32
    )
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3.4e38, 1.00390625])
    x.reshape(-1)[: special.size] = special
    want = x.astype(ml_dtypes.bfloat16)
    assert np.array_equal(to_bfloat16(x).view(np.uint16), want.view(np.uint16))
    assert np.array_equal(transposed(x).view(np.uint32), x.T.view(np.uint32))
    finite = np.where(np.isfinite(x), x, 1.0).astype(np.float32)
    got = bfloat16_values_transposed(finite)
    assert np.array_equal(got, finite.astype(ml_dtypes.bfloat16).astype(np.float32).T)


class _CountingParams(CheckpointParams):
    """Ten 1 KiB tensors that count how many are read and not yet handed out."""

    def __init__(self) -> None:
        self._shapes = {f"t{i}": (256,) for i in range(10)}
        self.read, self.handed, self.most_ahead = 0, 0, 0

    def __getitem__(self, name: str) -> np.ndarray:
        self.read += 1
        self.most_ahead = max(self.most_ahead, self.read - self.handed)
        return np.full(256, int(name[1:]), np.float32)


@pytest.mark.parametrize(
    ("depth", "budget", "most"), [(8, 3 * 1024, 3), (2, 1 << 20, 2), (8, 1, 1)]
)
def test_read_ahead_keeps_to_its_depth_and_byte_budget(depth, budget, most):
    params = _CountingParams()
    for k, (name, value) in enumerate(params.read_ahead(params, depth=depth, budget_bytes=budget)):
        assert name == f"t{k}" and value[0] == k
        time.sleep(0.005)  # the reader runs ahead as far as it may
        params.handed += 1
    assert params.read == 10 and 1 <= params.most_ahead <= most  # never beyond the bounds


PEAK_SCRIPT = textwrap.dedent(
    """
    import sys
    from nvfp4_export import export_hf
    export_hf(sys.argv[1], sys.argv[2], layout="compressed-tensors", weight_only=True)
    status = open("/proc/self/status").read()
    print(next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM")) * 1024)
    """
)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_export_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    # 30 blocks of d 512 / mlp 2048 + a 4096-vocab embedding and head: ~470 MB of float32
    # masters whose largest tensor (gate_up) is 8 MB. An export holding the model would peak
    # above 470 MB; streaming holds a few tensors plus the interpreter and libraries.
    model = model_config(vocab_size=4096, d_model=512, num_layers=30, num_heads=8,
                         num_kv_heads=2, mlp_dim=2048, max_seq_len=64)  # fmt: skip
    run = write_run(tmp_path / "run", model=model, quant_stats=None)
    ckpt_bytes = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
    assert ckpt_bytes > 400e6
    baseline = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT.split("export_hf(")[0] + "import orbax.checkpoint, jax\n"
         + PEAK_SCRIPT.split("\n", 4)[-1]],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    peak = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(run), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    libraries, export = int(baseline.stdout.split()[-1]), int(peak.stdout.split()[-1])
    bound = 200e6  # 25x the largest tensor, half the model
    assert export - libraries < bound, (export - libraries, libraries, ckpt_bytes)
