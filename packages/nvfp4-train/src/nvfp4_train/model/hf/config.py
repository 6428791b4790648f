"""A Hugging Face model's `config.json` as the run's `model:` section (`model.init_from`).

`fill_model_section` reads `<init_from>/config.json` (plain JSON: no code, no network, no
`trust_remote_code`) and returns the `model:` mapping with every key the checkpoint fixes
filled in. A key the user also wrote must agree, or the error names both values; options this
decoder cannot compute (another activation, MLP biases, a sliding window shorter than
`max_seq_len`, a RoPE type other than default / linear / llama3) are refused by name. A
Nemotron-H config (`nemotron_h`) is read by `hf.nemotron_h` (its pattern and `model.mamba`).

Example:
    >>> section = model_section({"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
    ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048})
    >>> section["architecture"], section["qk_norm"], section["head_dim"]
    ('qwen3', True, 16)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nvfp4_train.model.config import ARCHITECTURES, ROPE_TYPES, RopeScaling
from nvfp4_train.model.hf.errors import HFConfigError
from nvfp4_train.model.hf.moe import (
    MOE_MODEL_TYPES,
    merge_moe,
    moe_section,
    unsupported_model_type,
)
from nvfp4_train.model.hf.nemotron_h import (
    NEMOTRON_H,
    merge_nemotron_h,
    nemotron_h_section,
    unsupported_relative,
)
from nvfp4_train.model.hf.values import whole_number as _int
from nvfp4_train.model.pattern import pattern_kinds

DENSE_BASE = {"qwen3_moe": "qwen3", "mixtral": "mistral", "qwen2_moe": "qwen2"}
"""An MoE `model_type` -> the dense one whose attention it has (biases, q/k norms, windows)."""
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
_NOT_LLAMA_OPTIONS = {
    "hidden_act": "silu",
    "mlp_bias": False,
}
"""Hugging Face options whose only supported value is the one given (a different one is refused)."""

IMPORTED_ARCHITECTURES = ARCHITECTURES
"""The `model_type`s `model.init_from` imports (nemotron_h: `hf.nemotron_h`, Nemotron-H and
Nemotron 3 with its MoE blocks and MTP layers)."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of `model_dir`.

    Raises:
        HFConfigError: no such directory or file, or not a JSON object.
    """
    file = Path(model_dir) / CONFIG_FILE
    if not Path(model_dir).is_dir():
        raise HFConfigError(f"model.init_from: {str(model_dir)!r} is not a directory")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise HFConfigError(f"model.init_from: cannot read {str(file)!r}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFConfigError(f"model.init_from: {str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"model.init_from: {str(file)!r} must hold a JSON object")
    return config


def _rope(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the `rope_scaling` section) from either spelling: transformers >= 5
    `rope_parameters` (theta inside) or the older `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    scaling = params if isinstance(params, Mapping) else hf.get("rope_scaling")
    theta = hf.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    if not scaling:
        return float(theta), {"rope_type": "default"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(
            f"model.init_from: rope type {rope_type!r} is not supported (supported: {ROPE_TYPES})"
        )
    section: dict[str, Any] = {"rope_type": rope_type}
    if rope_type != "default":
        section["factor"] = float(scaling["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            section[key] = float(scaling[key])
        section["original_max_position_embeddings"] = int(
            scaling["original_max_position_embeddings"]
        )
    return float(theta), section


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """The attention window some layers use, or None when every layer attends to all tokens."""
    window = hf.get("sliding_window")
    if window is None:
        return None
    if hf.get("model_type") in ("mistral", "mixtral"):
        return int(window)
    layer_types = hf.get("layer_types")
    if layer_types is None:  # qwen2/3 before `layer_types`: `use_sliding_window` from a layer on
        layers = int(hf.get("num_hidden_layers", 0))
        first = int(hf.get("max_window_layers", layers))
        sliding = bool(hf.get("use_sliding_window")) and first < layers
    else:
        sliding = "sliding_attention" in layer_types
    return int(window) if sliding else None


def model_section(hf: Mapping[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
    """The `model:` keys a Hugging Face `config.json` fixes.

    Args:
        hf: the parsed config.json.
        max_seq_len: the user's `model.max_seq_len`, if set (else the checkpoint's
            `max_position_embeddings`, cut to a sliding window if there is one).

    Raises:
        HFConfigError: an unknown `model_type`, an option this decoder does not compute, a
            quantized checkpoint, or a missing key.
    """
    kind = hf.get("model_type")
    _check_supported(kind, hf)
    if kind == NEMOTRON_H:
        section, limit = nemotron_h_section(hf)
    else:
        section, limit = _dimensions(kind, hf)
        section.update(_attention_options(kind, hf))
    if kind in MOE_MODEL_TYPES:
        section["moe"] = moe_section(hf)
    window = None if kind == NEMOTRON_H else _sliding_window(hf)
    if max_seq_len is None:
        section["max_seq_len"] = min(limit, window) if window else limit
    else:
        _check_max_seq_len(max_seq_len, window, limit)
    return section


def _check_supported(kind: Any, hf: Mapping[str, Any]) -> None:
    """HFConfigError unless `model_type` is one this decoder builds, the checkpoint is not
    quantized and every `_NOT_LLAMA_OPTIONS` option has its supported value."""
    variant = unsupported_model_type(kind) or unsupported_relative(kind)
    if variant is not None:
        raise HFConfigError(f"model.init_from: {variant}")
    if kind not in IMPORTED_ARCHITECTURES:
        raise HFConfigError(
            f"model.init_from: model_type {kind!r} is not supported (supported: "
            f"{IMPORTED_ARCHITECTURES})"
        )
    if hf.get("quantization_config"):
        raise HFConfigError(
            "model.init_from: the checkpoint is already quantized (config.json has a "
            "quantization_config); start from its high-precision weights"
        )
    for key, supported in _NOT_LLAMA_OPTIONS.items():
        if hf.get(key, supported) != supported:
            raise HFConfigError(
                f"model.init_from: {key}={hf[key]!r} is not supported (only {supported!r})"
            )


def _dimensions(kind: str, hf: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(the section's architecture, sizes, RoPE, norm and tying keys, max_position_embeddings);
    a missing or malformed value is an HFConfigError naming it."""
    try:
        heads = _int(hf, "num_attention_heads")
        d_model = _int(hf, "hidden_size")
        theta, scaling = _rope(hf)
        limit = _int(hf, "max_position_embeddings", 2048)
        section: dict[str, Any] = {
            "architecture": kind,
            "vocab_size": _int(hf, "vocab_size"),
            "d_model": d_model,
            "num_layers": _int(hf, "num_hidden_layers"),
            "num_heads": heads,
            "num_kv_heads": _int(hf, "num_key_value_heads", heads),
            "head_dim": _int(hf, "head_dim", d_model // heads),
            "mlp_dim": _int(hf, "intermediate_size"),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise HFConfigError(f"model.init_from: config.json lacks {e}") from None
    except (TypeError, ValueError) as e:
        raise HFConfigError(f"model.init_from: config.json has a malformed value: {e}") from None
    return section, limit


def _attention_options(kind: str, hf: Mapping[str, Any]) -> dict[str, bool]:
    """qkv_bias, o_bias and qk_norm as the Hugging Face class of `kind` (of its dense base for
    an MoE type) builds them from `attention_bias`."""
    bias = bool(hf.get("attention_bias", False))
    base = DENSE_BASE.get(kind, kind)
    return {
        "qkv_bias": True if base == "qwen2" else bias and base != "mistral",
        "o_bias": bias and base in ("llama", "qwen3"),
        "qk_norm": base == "qwen3",
    }


def _check_max_seq_len(max_seq_len: int, window: int | None, limit: int) -> None:
    """HFConfigError when the user's `model.max_seq_len` exceeds the checkpoint's sliding window
    or its `max_position_embeddings` (`limit`)."""
    if window is not None and max_seq_len > window:
        raise HFConfigError(
            f"model.init_from: the checkpoint attends within a sliding window of {window} tokens, "
            f"which full attention honours only for model.max_seq_len <= {window}, got "
            f"{max_seq_len}"
        )
    if max_seq_len > limit:
        raise HFConfigError(
            f"model.max_seq_len={max_seq_len} exceeds the checkpoint's max_position_embeddings"
            f"={limit}"
        )


def _agrees(key: str, mine: Any, theirs: Any, section: Mapping[str, Any]) -> bool:
    if key == "head_dim" and mine == 0:
        return theirs == section["d_model"] // section["num_heads"]
    if key == "vocab_size" and mine == 0:
        return True
    if key == "pattern":
        try:
            return pattern_kinds(mine) == pattern_kinds(theirs)
        except (TypeError, ValueError):
            return False
    if key == "rope_scaling" and isinstance(mine, Mapping):
        defaults = dataclasses.asdict(RopeScaling())
        mine, theirs = {**defaults, **mine}, {**defaults, **theirs}
        if mine["rope_type"] == "default" == theirs["rope_type"]:
            return True
    return mine == theirs


def fill_model_section(model: Mapping[str, Any]) -> dict[str, Any]:
    """`model` (a user's `model:` mapping naming `init_from`) with the checkpoint's keys filled in.

    A directory that is gone is accepted when the section already holds every key (a run
    directory's saved config.yaml, read again to evaluate or export): weights are read only when
    a run starts fresh, and then a missing directory is an error.

    Raises:
        HFConfigError: the directory cannot be read, or a key the user wrote disagrees.
    """
    model_dir = model["init_from"]
    try:
        hf = read_hf_config(model_dir)
    except HFConfigError:
        keys = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "mlp_dim")
        if all(k in model for k in keys):
            return dict(model)
        raise
    user_len = model.get("max_seq_len")
    section = model_section(hf, user_len if isinstance(user_len, int) else None)
    disagree = [
        f"model.{k}={model[k]!r} but {model_dir}/{CONFIG_FILE} gives {v!r}"
        for k, v in section.items()
        if k in model and k not in ("moe", "mamba", "mtp") and not _agrees(k, model[k], v, section)
    ]
    if disagree:
        raise HFConfigError("model.init_from: " + "; ".join(disagree))
    if section["architecture"] == NEMOTRON_H:
        section = merge_nemotron_h(model, section, str(model_dir))
    if "moe" in section:
        section["moe"] = merge_moe(model.get("moe"), section["moe"], str(model_dir))
    elif (model.get("moe") or {}).get("num_experts"):
        raise HFConfigError(
            f"model.init_from: {model_dir}/{CONFIG_FILE} is a dense {section['architecture']} "
            "model; model.moe.num_experts must be 0 (absent) to start from it"
        )
    return {**model, **section}


def _eos_token(hf: Mapping[str, Any], tokenizer_file: Path) -> str | None:
    """The content of config.json's `eos_token_id` (the first one of a list) in tokenizer.json."""
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int):
        return None
    try:
        tokenizer = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("id") == eos:
            return added.get("content")
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        return next((token for token, i in vocab.items() if i == eos), None)
    return None


def fill_data_section(data: Mapping[str, Any], model_dir: str | Path) -> dict[str, Any]:
    """`data` with the model directory's tokenizer: `tokenizer_path` (unless the user set one)
    and, unless set, `eos_token` = config.json's `eos_token_id` (documents are separated by the
    token the model was trained to end text with).

    Raises:
        HFConfigError: the directory has no tokenizer.json and the user gave no
            `data.tokenizer_path`: the model's embedding would be trained on another
            tokenizer's ids (the byte tokenizer's, say) without a word.
    """
    data = dict(data)
    tokenizer_file = Path(model_dir) / TOKENIZER_FILE
    if "tokenizer_path" in data:
        return data
    if not tokenizer_file.is_file():
        if not Path(model_dir).is_dir():  # a saved run config of a moved model: nothing to fill
            return data
        raise HFConfigError(
            f"model.init_from: {str(model_dir)!r} has no {TOKENIZER_FILE}, so the data's token "
            "ids would not be the ones the model learnt; set data.tokenizer_path to the model's "
            "tokenizer"
        )
    data["tokenizer_path"] = str(model_dir)
    if "eos_token" not in data:
        try:
            eos = _eos_token(read_hf_config(model_dir), tokenizer_file)
        except HFConfigError:
            eos = None
        if eos is not None:
            data["eos_token"] = eos
    return data
