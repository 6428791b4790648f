"""Nemotron-H (`NemotronHForCausalLM`, model_type `nemotron_h`): config.json -> the `model:`
section of a hybrid (`model.pattern`, `model.mamba`, `rope: false`, `mlp_activation: relu2`).

Both forms of the config are read: transformers 5's (`layers_block_type`: `linear_attention` /
`mamba`, `full_attention` / `attention`, `mlp`, `moe`; `n_groups`, `conv_kernel`, `chunk_size`,
`time_step_limit`, ...) and the legacy one of NVIDIA's remote code (`hybrid_override_pattern`
letters with `num_hidden_layers`, and the `mamba_*` aliases of `LEGACY_KEYS`); a key written both
ways must agree. A key absent takes the default of transformers' `NemotronHConfig` (the tensors'
shapes are checked against the result).
Options the trainer does not compute are refused by name, and so are the hybrid relatives
(`HYBRID_RELATIVES`: Mamba-1, Jamba, Falcon-H1, Zamba, ...). Nemotron 3's MoE blocks (`E`) give
`model.moe` (`hf.nemotron_h_moe`); its multi-token prediction layers (`num_nextn_predict_layers`,
`mtp_layers_block_type`) give `model.mtp` when the run turns MTP on (`merge_mtp`).

Example:
    >>> section, _ = nemotron_h_section({"model_type": "nemotron_h", "vocab_size": 256,
    ...     "hidden_size": 64, "hybrid_override_pattern": "M-M*", "num_hidden_layers": 4,
    ...     "mamba_num_heads": 16, "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 16})
    >>> section["pattern"], section["mamba"]["num_heads"], section["mamba"]["time_step_limit"]
    ('M-M*', 16, [])
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nvfp4_train.model.blocks.mamba_config import MambaConfig
from nvfp4_train.model.hf.errors import HFConfigError
from nvfp4_train.model.hf.nemotron_h_moe import nemotron_moe_section
from nvfp4_train.model.hf.values import json_float, whole_number
from nvfp4_train.model.pattern import LETTERS

NEMOTRON_H = "nemotron_h"
LEGACY_KEYS = {
    "mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size",
    "hybrid_override_pattern": "layers_block_type", "layer_types": "layers_block_type",
    "attention_head_dim": "head_dim", "mtp_hybrid_override_pattern": "mtp_layers_block_type",
    "num_local_experts": "n_routed_experts",
}  # fmt: skip
"""A legacy config.json key -> transformers 5's name (`NemotronHConfig.__post_init__` and its
`attribute_map`; `attention_head_dim` as vLLM reads NVIDIA's remote-code configs)."""
BLOCK_TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*",
               "mlp": "-", "moe": "E"}  # fmt: skip
"""`layers_block_type` names (transformers 5's and the legacy ones) -> the pattern's letters."""
HYBRID_RELATIVES = {
    "mamba": ("MambaForCausalLM", "Mamba-1 mixers (a selective scan with x_proj/dt_proj, not "
              "Mamba-2's SSD heads)"),
    "falcon_mamba": ("FalconMambaForCausalLM", "Mamba-1 mixers with normalised B, C and dt"),
    "mamba2": ("Mamba2ForCausalLM", "a Mamba-2-only model whose config (Mamba2Config) this "
               "import does not map"),
    "jamba": ("JambaForCausalLM", "Mamba-1 mixers, and attention or Mamba followed by an MLP or "
              "MoE in every block"),
    "falcon_h1": ("FalconH1ForCausalLM", "attention and Mamba-2 side by side in every block, "
                  "with muP multipliers"),
    "zamba": ("ZambaForCausalLM", "Mamba-1 mixers and a shared attention block"),
    "zamba2": ("Zamba2ForCausalLM", "a shared attention block with LoRA adapters between "
               "Mamba-2 blocks"),
    "bamba": ("BambaForCausalLM", "a SwiGLU MLP after the mixer in every block and attention "
              "with RoPE"),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "an MoE after the mixer in every block, "
                         "with muP multipliers"),
}  # fmt: skip
"""Hybrid Mamba models met on the Hub that this import refuses: their class and why."""
_ONLY = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "mlp_bias": False,
         "attention_bias": False, "tie_word_embeddings": False}  # fmt: skip
"""Options whose only supported value is the one given (transformers' defaults). Its
NemotronHForCausalLM ties no weights whatever `tie_word_embeddings` says, and builds attention
without biases whatever `attention_bias` says: a checkpoint saying otherwise is ambiguous."""
MAMBA_STRUCTURE_KEYS = ("num_heads", "head_dim", "state_dim", "n_groups", "conv_kernel",
                        "conv_bias", "proj_bias", "time_step_limit")  # fmt: skip
"""`model.mamba` keys the checkpoint fixes (a value the user wrote must agree); the others
(`chunk_size`, the `dt_bias` init) are the run's to choose."""


def _fail(message: str) -> HFConfigError:
    return HFConfigError(f"model.init_from: {message}")


def unsupported_relative(kind: Any) -> str | None:
    """Why `kind` (a hybrid Mamba `model_type` other than Nemotron-H) is refused, or None."""
    if kind not in HYBRID_RELATIVES:
        return None
    cls, why = HYBRID_RELATIVES[kind]
    return (
        f"{cls} (model_type {kind!r}) is not imported: {why}; of the hybrid Mamba models only "
        f"NemotronHForCausalLM ({NEMOTRON_H!r}) is"
    )


def current_keys(hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json with every legacy key (`LEGACY_KEYS`) under its transformers 5 name.

    Raises:
        HFConfigError: a key written both ways with different values.
    """
    out = dict(hf)
    for old, new in LEGACY_KEYS.items():
        if old not in hf:
            continue
        value = out.pop(old)
        if new in hf and _pattern_of(hf[new], new) != _pattern_of(value, old):
            raise _fail(f"config.json gives {old}={value!r} and {new}={hf[new]!r}, which disagree")
        out[new] = value
    return out


def _pattern_of(value: Any, key: str) -> Any:
    """A block list or pattern string as letters (other values as they are), for comparison."""
    if key.endswith(("layers_block_type", "override_pattern", "layer_types")) and value:
        return block_letters(value, key)
    return value


def block_letters(blocks: Any, key: str) -> str:
    """`layers_block_type` (a list of names) or `hybrid_override_pattern` (letters) as letters.

    Raises:
        HFConfigError: an unknown letter or name, naming its block.
    """
    known = {**BLOCK_TYPES, **{letter: letter for letter in LETTERS}}
    if not isinstance(blocks, (str, list)) or not blocks:
        raise _fail(f"config.json's {key} must be a non-empty list or string, got {blocks!r}")
    for i, block in enumerate(blocks):
        if block not in known or (isinstance(blocks, list) and len(block) == 1):
            allowed = "letters M * - E" if isinstance(blocks, str) else sorted(BLOCK_TYPES)
            raise _fail(f"config.json's {key} has {block!r} at block {i} (allowed: {allowed})")
    return "".join(known[block] for block in blocks)


def _pattern(hf: Mapping[str, Any]) -> str:
    """The checkpoint's blocks as letters; a declared `num_hidden_layers` must count them."""
    if "layers_block_type" not in hf:
        raise _fail(
            "config.json lacks 'layers_block_type' (or the legacy 'hybrid_override_pattern')"
        )
    letters = block_letters(hf["layers_block_type"], "layers_block_type")
    declared = hf.get("num_hidden_layers")
    if declared is not None and declared != len(letters):
        raise _fail(
            f"config.json's num_hidden_layers={declared!r} but its pattern {letters!r} has "
            f"{len(letters)} blocks"
        )
    return letters


def _mtp(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's MTP layers as `model.mtp` keys (None without any): `num_layers` from
    `num_nextn_predict_layers`, `pattern` from `mtp_layers_block_type` (default "*E")."""
    layers = whole_number(hf, "num_nextn_predict_layers", 0)
    if not layers:
        return None
    blocks = hf.get("mtp_layers_block_type") or ["full_attention", "moe"]
    return {"num_layers": layers, "pattern": block_letters(blocks, "mtp_layers_block_type")}


def _time_step_limit(hf: Mapping[str, Any]) -> list[float]:
    """`time_step_limit` as `model.mamba.time_step_limit`: [] for transformers' default
    (0, inf), which clips nothing, else [low, high]."""
    limit = hf.get("time_step_limit", (0.0, math.inf))
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise _fail(f"config.json's time_step_limit must be [low, high], got {limit!r}")
    low, high = (json_float(v, "time_step_limit") for v in limit)
    return [] if low <= 0.0 and high == math.inf else [low, high]


def _mamba(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The `model.mamba` section (transformers' defaults for absent keys)."""
    d = MambaConfig()
    return {
        "num_heads": whole_number(hf, "mamba_num_heads", d.num_heads),
        "head_dim": whole_number(hf, "mamba_head_dim", d.head_dim),
        "state_dim": whole_number(hf, "ssm_state_size", d.state_dim),
        "n_groups": whole_number(hf, "n_groups", d.n_groups),
        "conv_kernel": whole_number(hf, "conv_kernel", d.conv_kernel),
        "conv_bias": bool(hf.get("use_conv_bias", True)),
        "proj_bias": bool(hf.get("use_bias", False)),
        "chunk_size": whole_number(hf, "chunk_size", d.chunk_size),
        "time_step_limit": _time_step_limit(hf),
        "time_step_min": float(hf.get("time_step_min", d.time_step_min)),
        "time_step_max": float(hf.get("time_step_max", d.time_step_max)),
        "time_step_floor": float(hf.get("time_step_floor", d.time_step_floor)),
    }


def nemotron_h_section(hf: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(the `model:` keys a Nemotron-H config.json fixes, its max_position_embeddings): with
    `moe` when a block or an MTP layer is MoE (`E`), with `mtp` when it has MTP layers (the run
    keeps them only if it asks for MTP: `merge_nemotron_h`).

    Raises:
        HFConfigError: a missing or malformed key, a refused option.
    """
    hf = current_keys(hf)
    for key, supported in _ONLY.items():
        if hf.get(key, supported) != supported:
            raise _fail(f"{key}={hf[key]!r} is not supported for {NEMOTRON_H} (only {supported!r})")
    try:
        pattern = _pattern(hf)
        d_model, heads = (
            whole_number(hf, "hidden_size"),
            whole_number(hf, "num_attention_heads", 32),
        )
        kv_heads = whole_number(hf, "num_key_value_heads", 8)  # null: as many as the q heads
        section: dict[str, Any] = {
            "architecture": NEMOTRON_H, "vocab_size": whole_number(hf, "vocab_size"),
            "d_model": d_model, "num_layers": len(pattern), "pattern": pattern,
            "num_heads": heads,
            "num_kv_heads": heads if hf.get("num_key_value_heads", 8) is None else kv_heads,
            "head_dim": whole_number(hf, "head_dim", 128),
            "mlp_dim": whole_number(hf, "intermediate_size", 21504),
            "rms_norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "tie_embeddings": False, "qkv_bias": False, "o_bias": False, "qk_norm": False,
            "rope": False, "mlp_activation": "relu2", "mamba": _mamba(hf),
        }  # fmt: skip
        mtp = _mtp(hf)
        if mtp is not None:
            section["mtp"] = mtp
        if "E" in pattern + (mtp or {}).get("pattern", ""):
            section["moe"] = nemotron_moe_section(hf)
        limit = whole_number(hf, "max_position_embeddings", 4096)
    except HFConfigError:
        raise
    except KeyError as e:
        raise _fail(f"config.json lacks {e}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise _fail(f"config.json has a malformed value: {e}") from None
    return section, limit


def merge_mamba(user: Any, checkpoint: Mapping[str, Any], model_dir: str) -> dict[str, Any]:
    """The user's `model.mamba` over the checkpoint's.

    Raises:
        HFConfigError: a structural key (`MAMBA_STRUCTURE_KEYS`) the user wrote disagrees.
    """
    user = dict(user or {})
    listed = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731
    disagree = [
        f"model.mamba.{k}={user[k]!r} but {model_dir}/config.json gives {checkpoint[k]!r}"
        for k in MAMBA_STRUCTURE_KEYS
        if k in user and listed(user[k]) != listed(checkpoint[k])
    ]
    if disagree:
        raise _fail("; ".join(disagree))
    return {**checkpoint, **user}


def merge_mtp(user: Any, checkpoint: Mapping[str, Any] | None, model_dir: str) -> dict | None:
    """The run's `model.mtp`: off (the user's keys, or None) unless the user asks for MTP layers
    (`model.mtp.num_layers > 0`); then the checkpoint's layers and pattern, with the user's
    training keys (`depths`, `loss_scaling_factor`).

    Raises:
        HFConfigError: MTP asked of a checkpoint without MTP layers, or a `num_layers` /
            `pattern` the user wrote that disagrees with the checkpoint's.
    """
    user = dict(user or {})
    if not user.get("num_layers"):
        return user or None
    if checkpoint is None:
        raise _fail(
            f"model.mtp.num_layers={user['num_layers']!r} but {model_dir}/config.json has no MTP "
            "layers (num_nextn_predict_layers=0); the import loads MTP layers, it does not add new "
            "ones: leave model.mtp out"
        )
    disagree = [
        f"model.mtp.{k}={user[k]!r} but {model_dir}/config.json gives {checkpoint[k]!r}"
        for k in ("num_layers", "pattern")
        if k in user and user[k] != checkpoint[k]
    ]
    if disagree:
        raise _fail("; ".join(disagree))
    return {**checkpoint, **user}


def merge_nemotron_h(model: Mapping[str, Any], section: dict[str, Any], model_dir: str) -> dict:
    """`section` (`nemotron_h_section`'s) with the user's `model.mamba` and `model.mtp` merged
    (`merge_mamba`, `merge_mtp`), and without `moe` when only the MTP layers were MoE and the
    run leaves MTP off."""
    section = dict(section)
    section["mamba"] = merge_mamba(model.get("mamba"), section["mamba"], model_dir)
    mtp = merge_mtp(model.get("mtp"), section.pop("mtp", None), model_dir)
    if mtp is not None:
        section["mtp"] = mtp
    on = mtp is not None and mtp.get("num_layers")
    if "E" not in section["pattern"] + (mtp["pattern"] if on else ""):
        section.pop("moe", None)
    return section
