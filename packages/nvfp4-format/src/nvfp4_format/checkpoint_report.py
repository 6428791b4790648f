"""Inspect a whole checkpoint: one file, or a directory of shards with its index and configs.

Reads the safetensors headers, finds the NVFP4 / MXFP4 linears (see `inspection`), measures each,
and compares the layout the configs declare (`hf_quant_config.json`, `config.json`) with the one
found. Pure data in, frozen report out; rendering lives in `cli`.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nvfp4_format.inspection import (
    LAYOUT_CT_MXFP4,
    LAYOUT_CT_NVFP4,
    LAYOUT_MODELOPT_NVFP4,
    QuantizedTensorReport,
    inspect_module,
)
from nvfp4_format.layout_detection import detect_quantized_modules
from nvfp4_format.safetensors_file import read_tensor, read_tensor_bytes
from nvfp4_format.safetensors_header import SafetensorsHeader, TensorInfo, read_safetensors_header
from nvfp4_format.safetensors_index import SafetensorsIndex, read_safetensors_index

__all__ = ["CheckpointReport", "declared_layouts", "inspect_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class UnquantizedTensor:
    """A tensor that is not part of a quantized linear: name, safetensors dtype, shape, bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileSummary:
    """One safetensors file: path, size, tensor count and ``__metadata__``."""

    path: str
    file_bytes: int
    tensor_count: int
    metadata: dict[str, str]


@dataclass(frozen=True)
class Totals:
    """Checkpoint-wide sizes.

    Attributes:
        file_bytes: size of all files (headers included).
        tensor_bytes: stored bytes of all tensors.
        bf16_bytes: bytes of the same checkpoint with every quantized weight and every other
            tensor in BF16 (quantization-only tensors such as input scales dropped).
        size_ratio_vs_bf16: tensor_bytes / bf16_bytes (None for an empty checkpoint).
        quantized_params: logical elements of the quantized weights.
        total_params: quantized_params plus the elements of the unquantized tensors.
    """

    file_bytes: int
    tensor_bytes: int
    bf16_bytes: int
    size_ratio_vs_bf16: float | None
    quantized_params: int
    total_params: int


@dataclass(frozen=True)
class CheckpointReport:
    """Everything `inspect_checkpoint` found about one checkpoint (a file or a directory)."""

    path: str
    files: tuple[FileSummary, ...]
    declared_layouts: tuple[str, ...]
    declared_sources: tuple[str, ...]
    found_layouts: tuple[str, ...]
    quantized: tuple[QuantizedTensorReport, ...]
    unquantized: tuple[UnquantizedTensor, ...]
    totals: Totals
    warnings: tuple[str, ...]


def _modelopt_layouts(quant: Mapping) -> list[str]:
    algos = [quant.get("quant_algo")]
    layers = quant.get("quantized_layers")
    if isinstance(layers, dict):
        algos += [v.get("quant_algo") for v in layers.values() if isinstance(v, dict)]
    algos = [a for a in algos if isinstance(a, str) and a.upper() != "MIXED_PRECISION"]
    return [LAYOUT_MODELOPT_NVFP4 if "NVFP4" in a.upper() else f"modelopt:{a}" for a in algos]


_CT_FORMATS = {"nvfp4-pack-quantized": LAYOUT_CT_NVFP4, "mxfp4-pack-quantized": LAYOUT_CT_MXFP4}


def _compressed_tensors_layouts(qc: Mapping) -> list[str]:
    groups = qc.get("config_groups") if isinstance(qc.get("config_groups"), dict) else {}
    formats = [g.get("format") for g in groups.values() if isinstance(g, dict)]
    formats = [f for f in formats if isinstance(f, str)] or [qc.get("format")]
    return [_CT_FORMATS.get(f, f"compressed-tensors:{f}") for f in formats]


def declared_layouts(hf_quant_config: Mapping | None, config: Mapping | None) -> tuple[str, ...]:
    """The layouts a checkpoint's config files declare.

    Args:
        hf_quant_config: parsed ``hf_quant_config.json`` (ModelOpt), or None.
        config: parsed ``config.json``, or None (its ``quantization_config`` is read).

    Returns:
        Sorted layout names (``LAYOUT_*``; anything else as ``"<method>:<algo or format>"``).
    """
    found: list[str] = []
    if isinstance(hf_quant_config, Mapping) and isinstance(
        hf_quant_config.get("quantization"), dict
    ):
        found += _modelopt_layouts(hf_quant_config["quantization"])
    qc = config.get("quantization_config") if isinstance(config, Mapping) else None
    if isinstance(qc, dict):
        method = qc.get("quant_method")
        if method == "modelopt":  # flat, or nested like hf_quant_config.json
            nested = qc.get("quantization")
            found += _modelopt_layouts(nested if isinstance(nested, dict) else qc)
        elif method == "compressed-tensors":
            found += _compressed_tensors_layouts(qc)
        else:
            found.append(str(method))
    return tuple(sorted(set(found)))


def _read_configs(directory: str) -> tuple[dict, dict, list[str], list[str]]:
    """Reads hf_quant_config.json / config.json: (hf_quant, config, sources, warnings)."""
    parsed, sources, warnings = {}, [], []
    for name in ("hf_quant_config.json", "config.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                parsed[name] = json.load(f)
            sources.append(name)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            warnings.append(f"could not read {path}: {e}")
    return parsed.get("hf_quant_config.json"), parsed.get("config.json"), sources, warnings


def _resolve(path: str) -> tuple[list[str], SafetensorsIndex | None, str]:
    """A file or checkpoint directory -> (safetensors files, index or None, config directory)."""
    if os.path.isfile(path):
        return [path], None, os.path.dirname(path) or "."
    if not os.path.isdir(path):
        try:
            os.stat(path)
        except OSError as e:  # ELOOP: a symbolic link loop; ENOENT; EACCES
            if e.errno == errno.ELOOP:
                raise ValueError(f"{path}: a loop of symbolic links") from None
            raise ValueError(f"{path}: {e.strerror.lower()}") from None
        raise ValueError(f"{path}: neither a file nor a directory")
    index_path = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index_path):
        index = read_safetensors_index(index_path)
        missing = [f for f in index.shard_files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{index_path}: names shard(s) that do not exist: {missing}")
        return list(index.shard_files), index, path
    files = sorted(glob.glob(os.path.join(glob.escape(path), "model*.safetensors")))
    if not files:
        raise ValueError(f"{path}: directory has no {INDEX_NAME} and no model*.safetensors")
    return files, None, path


def _merge(headers: Sequence[SafetensorsHeader]) -> dict[str, tuple[SafetensorsHeader, TensorInfo]]:
    merged = {}
    for header in headers:
        for name, info in header.tensors.items():
            if name in merged:
                raise ValueError(
                    f"{header.path}: tensor {name!r} is also in {merged[name][0].path}"
                )
            merged[name] = (header, info)
    return merged


def _index_warnings(index: SafetensorsIndex, merged: Mapping) -> list[str]:
    warnings = []
    wrong = [
        n
        for n, f in index.weight_map.items()
        if n not in merged or os.path.basename(merged[n][0].path) != f
    ]
    unlisted = [n for n in merged if n not in index.weight_map]
    if wrong:
        warnings.append(f"{len(wrong)} index entries not found in their shard, e.g. {wrong[:3]}")
    if unlisted:
        warnings.append(f"{len(unlisted)} tensors missing from the index, e.g. {unlisted[:3]}")
    actual = sum(info.nbytes for _, info in merged.values())
    if index.total_size is not None and index.total_size != actual:
        warnings.append(f"index total_size {index.total_size} != tensor bytes {actual}")
    return warnings


def _layout_warning(declared: tuple[str, ...], found: tuple[str, ...]) -> list[str]:
    """A warning when the FP4 layouts the config declares are not the ones found.

    Declared non-FP4 schemes (e.g. the FP8 layers of a mixed-precision ModelOpt config) are not
    detected in the tensors, so only the FP4 part of the declaration is compared.
    """
    fp4_declared = set(declared) & {LAYOUT_MODELOPT_NVFP4, LAYOUT_CT_NVFP4, LAYOUT_CT_MXFP4}
    if not declared or fp4_declared == set(found):
        return []
    return [f"config declares {list(declared)} but the FP4 tensors are {list(found) or 'none'}"]


def _totals(
    headers: Sequence[SafetensorsHeader],
    quantized: Sequence[QuantizedTensorReport],
    unquantized: Sequence[UnquantizedTensor],
    merged: Mapping[str, tuple[SafetensorsHeader, TensorInfo]],
) -> Totals:
    tensor_bytes = sum(info.nbytes for _, info in merged.values())
    bf16 = sum(q.bf16_bytes for q in quantized) + sum(2 * math.prod(u.shape) for u in unquantized)
    quantized_params = sum(math.prod(q.shape) for q in quantized)
    return Totals(
        file_bytes=sum(h.file_bytes for h in headers),
        tensor_bytes=tensor_bytes,
        bf16_bytes=bf16,
        size_ratio_vs_bf16=tensor_bytes / bf16 if bf16 else None,
        quantized_params=quantized_params,
        total_params=quantized_params + sum(math.prod(u.shape) for u in unquantized),
    )


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointReport:
    """Inspects a safetensors file or a (sharded) checkpoint directory.

    Args:
        path: a ``.safetensors`` file, or a directory with a ``model.safetensors.index.json``
            or ``model*.safetensors`` files (all shards form one checkpoint).

    Returns:
        The `CheckpointReport` (consistency problems are listed in it, never raised).

    Raises:
        ValueError: the path does not exist, a file is not valid safetensors, the index is
            invalid or names missing shards, or two shards hold the same tensor.
    """
    path = os.fspath(path)
    files, index, config_dir = _resolve(path)
    headers = [read_safetensors_header(f) for f in files]
    merged = _merge(headers)
    tensors = {name: info for name, (_, info) in merged.items()}

    def read(name: str) -> np.ndarray:
        return read_tensor(merged[name][0], name)

    def read_bytes(name: str):
        return read_tensor_bytes(merged[name][0], name)

    modules = detect_quantized_modules(tensors)
    quantized = tuple(inspect_module(q, tensors, read, read_bytes) for q in modules)
    claimed = {n for q in modules for n in q.tensor_names}
    unquantized = tuple(
        UnquantizedTensor(n, i.dtype, i.shape, i.nbytes)
        for n, i in sorted(tensors.items())
        if n not in claimed
    )
    hf_quant, config, sources, warnings = _read_configs(config_dir)
    declared = declared_layouts(hf_quant, config)
    found = tuple(sorted({q.layout for q in quantized}))
    warnings += _layout_warning(declared, found)
    warnings += _index_warnings(index, merged) if index is not None else []
    return CheckpointReport(
        path=path,
        files=tuple(
            FileSummary(h.path, h.file_bytes, len(h.tensors), dict(h.metadata)) for h in headers
        ),
        declared_layouts=declared,
        declared_sources=tuple(sources) if declared else (),
        found_layouts=found,
        quantized=quantized,
        unquantized=unquantized,
        totals=_totals(headers, quantized, unquantized, merged),
        warnings=tuple(warnings),
    )
