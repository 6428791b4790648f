"""Real loaders of the exports, when installed: transformers + compressed-tensors, onnxruntime."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np


def missing(*modules: str) -> list[str]:
    """The modules of `modules` that are not importable."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def transformers_logits(export_dir: Path, tokens_BxL: np.ndarray) -> np.ndarray:
    """float32 logits of `AutoModelForCausalLM` on CPU, weights dequantized by compressed-tensors."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(export_dir),
        dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True),
    )
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(tokens_BxL), dtype=torch.long)).logits
    return out.float().numpy()


def onnxruntime_logits(onnx_file: Path, tokens_BxL: np.ndarray) -> np.ndarray:
    """float32 logits of the ONNX file on onnxruntime's CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    ids = np.asarray(tokens_BxL, dtype=np.int64)
    return session.run(["logits"], {"input_ids": ids})[0]
