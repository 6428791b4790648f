"""Real loaders of the exports, when installed: transformers + compressed-tensors, onnxruntime."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from nvfp4_export.mixed_precision import MIXED_CT_FORMAT


def missing(*modules: str) -> list[str]:
    """The modules of `modules` that are not importable."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


MOE_KEYS = ("num_experts", "num_local_experts")
"""config.json keys that mark a Mixture-of-Experts class."""


def transformers_logits(export_dir: Path, tokens_BxL: np.ndarray) -> np.ndarray:
    """float32 logits of `AutoModelForCausalLM` on CPU, weights dequantized by compressed-tensors.

    An export without `quantization_config` (the bf16 layout) is loaded as it is. A dense export is loaded as it is (`CompressedTensorsConfig(dequantize=True)`). An MoE export
    cannot be: transformers 5's loader dequantizes experts without their `weight_global_scale`
    (transformers/integrations/compressed_tensors.py, `CompressedTensorsDequantize.convert`
    builds each expert from `weight_packed`, `weight_scale` and `weight_shape` only) and drops
    BF16 experts. Its modules are dequantized by compressed-tensors' own NVFP4 compressor
    instead (`moe_dense_copy`) and transformers loads that BF16 copy under the same names and
    config. So is a mixed-format export (NVFP4 and MXFP8 groups): transformers picks one group
    for every dense module (transformers/integrations/compressed_tensors.py, `get_dense_scheme`).
    """
    import json
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = json.loads((Path(export_dir) / "config.json").read_text("utf-8"))
    with tempfile.TemporaryDirectory() as tmp:
        if "quantization_config" not in config:
            model = AutoModelForCausalLM.from_pretrained(str(export_dir), dtype=torch.float32)
        elif any(config.get(k) for k in MOE_KEYS) or (
            config["quantization_config"].get("format") == MIXED_CT_FORMAT
        ):
            moe_dense_copy(Path(export_dir), Path(tmp))
            model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(export_dir),
                dtype=torch.float32,
                quantization_config=CompressedTensorsConfig(dequantize=True),
            )
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens_BxL), dtype=torch.long)).logits
    return out.float().numpy()


def moe_dense_copy(export_dir: Path, out_dir: Path) -> None:
    """A BF16 copy of a compressed-tensors export in `out_dir`: every `weight_packed` module
    dequantized by compressed-tensors (`NVFP4PackedCompressor.decompress` with its
    `weight_global_scale`), every MXFP8 module (an E4M3 `weight` with E8M0 `weight_scale`) by
    `MXFP8QuantizationCompressor.decompress`, every other tensor as stored, config.json without
    its `quantization_config`."""
    import json

    import torch
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((export_dir / "config.json").read_text("utf-8"))
    schemes = {
        group["format"]: QuantizationScheme(targets=group["targets"],
                                            weights=QuantizationArgs(**group["weights"]))
        for group in config.pop("quantization_config")["config_groups"].values()
    }  # fmt: skip
    tensors = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    mxfp8 = {n.rpartition(".")[0] for n, t in tensors.items()
             if n.endswith(".weight") and t.dtype == torch.float8_e4m3fn}  # fmt: skip
    dense = {}
    for name in sorted(tensors):
        module, _, suffix = name.rpartition(".")
        if suffix == "weight_packed":
            local = {k: tensors[f"{module}.{k}"] for k in ("weight_packed", "weight_scale",
                     "weight_global_scale") if f"{module}.{k}" in tensors}  # fmt: skip
            weight = NVFP4PackedCompressor.decompress(local, schemes["nvfp4-pack-quantized"])
            dense[f"{module}.weight"] = weight["weight"].to(torch.bfloat16).contiguous()
        elif module in mxfp8 and suffix == "weight":
            local = {k: tensors[f"{module}.{k}"] for k in ("weight", "weight_scale")}
            weight = MXFP8QuantizationCompressor.decompress(local, schemes["mxfp8-quantized"])
            dense[name] = weight["weight"].to(torch.bfloat16).contiguous()
        elif suffix not in ("weight_scale", "weight_global_scale", "input_global_scale"):
            dense[name] = tensors[name]
    save_file(dense, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config))


def onnxruntime_logits(onnx_file: Path, tokens_BxL: np.ndarray) -> np.ndarray:
    """float32 logits of the ONNX file on onnxruntime's CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    ids = np.asarray(tokens_BxL, dtype=np.int64)
    return session.run(["logits"], {"input_ids": ids})[0]
