"""An export loaded back by transformers, and its loss on a run's held-out batches.

transformers loads neither a ModelOpt export nor an MoE compressed-tensors one on CPU, so both
are first written as BF16 copies under the same names and config: the compressed-tensors export
through compressed-tensors' own dequantization (`nvfp4_export.clients.moe_dense_copy`), the
ModelOpt export through this file's reading of the ModelOpt tensors (`modelopt_dense_copy`: the
decode conventions of docs/spec/export-formats.md, NVFP4 and FP8 per tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
SCALES = ("weight_scale", "weight_scale_2", "input_scale")


def val_loss(run: Path, step: int) -> float:
    """The run's own `val_loss` at `step` (metrics.jsonl)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_loss"] for r in rows if r.get("step") == step and "val_loss" in r][-1]


def validation_batches(run: Path) -> list[dict]:
    """The held-out batches the run evaluated on."""
    from nvfp4_train.training.session import load_run_config, with_data

    _, datasets = with_data(load_run_config(run))
    return datasets.validation_batches()


def _decoded(tensors: dict, module: str, value: np.ndarray) -> np.ndarray:
    """A ModelOpt module's weight in float32: NVFP4 (packed E2M1 codes, low nibble first, x its
    E4M3 per-16 block scale x `weight_scale_2`) or FP8 (E4M3 x the per-tensor `weight_scale`)."""
    if value.dtype == np.uint8:
        codes = np.stack([value & 0x0F, value >> 4], axis=-1).reshape(value.shape[0], -1)
        blocks = np.repeat(tensors[f"{module}.weight_scale"].astype(np.float32), 16, axis=1)
        return E2M1[codes] * blocks * tensors[f"{module}.weight_scale_2"].astype(np.float32)
    return value.astype(np.float32) * tensors[f"{module}.weight_scale"].astype(np.float32)


def modelopt_dense_copy(export: Path, out: Path) -> None:
    """A BF16 copy of a ModelOpt export in `out`: each quantized module's weight decoded, the
    other tensors as stored, config.json without its quantization_config."""
    import ml_dtypes
    import torch
    from safetensors.torch import save_file

    from nvfp4_format.safetensors_file import load_safetensors

    tensors = dict(load_safetensors(export / "model.safetensors")[0])
    dense = {}
    for name, value in tensors.items():
        module, _, suffix = name.rpartition(".")
        if suffix in SCALES:
            continue
        array = np.array(value)  # a writable copy for torch
        if suffix == "weight" and f"{module}.weight_scale" in tensors:
            array = _decoded(tensors, module, array).astype(ml_dtypes.bfloat16)
        if array.dtype == ml_dtypes.bfloat16:
            dense[name] = torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
        else:
            dense[name] = torch.from_numpy(array)
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((export / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))


def dense_copy(export: Path, layout: str, out: Path) -> None:
    """The BF16 copy transformers loads of an export in `layout`."""
    from nvfp4_export.clients import moe_dense_copy

    (modelopt_dense_copy if layout == "modelopt" else moe_dense_copy)(export, out)


def reloaded_loss(model_dir: Path, batches: list[dict], class_name: str) -> float:
    """The mean token cross-entropy of transformers' model in `model_dir` (float32), which must
    load as `class_name`, on `batches`."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert type(model).__name__ == class_name
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(torch.tensor(np.asarray(batch["inputs"]), dtype=torch.long)).logits
            targets = torch.tensor(np.asarray(batch["targets"]), dtype=torch.long)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
            )
            total, count = total + float(loss), count + targets.numel()
    return total / count
