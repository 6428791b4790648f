"""Where each parameter of a Nemotron-H run is in a `NemotronHForCausalLM` checkpoint, and the
checks of its tensors against the config before any is read.

Two layouts, told apart by the embedding's name: the Hub's (`backbone.embeddings.weight`,
`backbone.layers.{i}.mixer.*`, `backbone.norm_f.weight`, as NVIDIA publishes checkpoints and
transformers 5's `save_pretrained` writes them) and transformers 5's in-library one
(`model.*`, `save_pretrained(save_original_format=False)`); `lm_head.weight` in both. Each block
kind has its own table (`BLOCK_SOURCES`):

    M  mixer.in_proj.weight [W, D]        -> mamba.in_proj.kernel [D, W]
       mixer.conv1d.weight [C, 1, K]      -> mamba.conv1d.kernel [K, C]   (and conv1d.bias [C])
       mixer.dt_bias, A_log, D [H]; mixer.norm.weight [d_inner]; mixer.out_proj.weight [D, d_inner]
    *  mixer.{q,k,v}_proj.weight          -> attn.qkv.kernel (fused), mixer.o_proj -> attn.o
    -  mixer.up_proj.weight, down_proj    -> mlp.up.kernel, mlp.down.kernel
    E  mixer.gate.*, experts.*, shared_experts.*, fc{1,2}_latent_proj  -> mlp.*  (Nemotron 3's
       MoE, `hf.nemotron_h_moe`: experts per expert as the Hub holds them, or stacked)
and every block's `norm.weight` -> `norm.scale`. Multi-token-prediction layers (`mtp.layers.{j}.*`,
at the top level as NVIDIA's checkpoints hold them) are read into `mtp.layers.{j}` when the run's
MTP is on: a block of its kind (`norm.weight`, `mixer.*` as above), with `enorm.weight`,
`hnorm.weight` and `eh_proj.weight` [D, 2D] (-> `eh_proj.kernel` [2D, D]) on a module's first
layer and `final_layernorm.weight` on its last. With MTP off they come back unused, and
`weights.unused_lines` says they are dropped.

Example:
    >>> layout_prefix(["backbone.embeddings.weight", "lm_head.weight"])
    'backbone.'
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

from nvfp4_train.model.hf.errors import HFImportError
from nvfp4_train.model.hf.moe import check_block_experts
from nvfp4_train.model.hf.nemotron_h_moe import nemotron_moe_sources, stacked_expert_tensor
from nvfp4_train.model.hf.sources import Source
from nvfp4_train.model.pattern import LETTERS
from nvfp4_train.model.structure import block_kinds, mtp_layer_count, mtp_layer_kind

LAYOUTS = {"backbone.": "the Hub's layout", "model.": "transformers' in-library layout"}
"""The prefix of the backbone's tensors -> which layout it is."""
MTP_TENSOR = re.compile(r"^(?:backbone\.|model\.)?mtp\.")
"""A multi-token-prediction tensor (what transformers' NemotronH ignores on load: `mtp.*`)."""
_BLOCK_TENSOR = re.compile(r"^(backbone|model)\.layers\.(\d+)\.mixer\.([^.]+)")
_EXPERT_TENSOR = re.compile(r"^(.*\.)experts\.(\d+)\.")
MIXER_TENSORS = {
    "mamba": ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj"),
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("up_proj", "down_proj"),
    "moe": ("gate", "experts", "shared_experts", "fc1_latent_proj", "fc2_latent_proj"),
}
"""A block kind -> the names under `layers.{i}.mixer.` that only that kind's mixer has."""
_LETTER = {kind: letter for letter, kind in LETTERS.items()}


def layout_prefix(names: Collection[str]) -> str:
    """ "backbone." (the Hub's layout) or "model." (transformers'), by the embedding present.

    Raises:
        HFImportError: neither embedding is there.
    """
    for prefix in LAYOUTS:
        if prefix + "embeddings.weight" in names:
            return prefix
    raise HFImportError(
        "model.init_from: the checkpoint has neither 'backbone.embeddings.weight' (the Hub's "
        "Nemotron-H layout) nor 'model.embeddings.weight' (transformers')"
    )


def _mamba_sources(cfg, mixer: str) -> dict[str, Source]:
    m = cfg.mamba
    out = {
        "mamba.in_proj.kernel": Source(((mixer + "in_proj.weight", m.in_proj_width),), True),
        "mamba.conv1d.kernel": Source(
            ((mixer + "conv1d.weight", m.conv_dim),), True, depthwise_conv=True
        ),  # fmt: skip
        "mamba.dt_bias": Source(((mixer + "dt_bias", m.num_heads),)),
        "mamba.A_log": Source(((mixer + "A_log", m.num_heads),)),
        "mamba.D": Source(((mixer + "D", m.num_heads),)),
        "mamba.norm.scale": Source(((mixer + "norm.weight", m.inner),)),
        "mamba.out_proj.kernel": Source(((mixer + "out_proj.weight", cfg.d_model),), True),
    }
    if m.conv_bias:
        out["mamba.conv1d.bias"] = Source(((mixer + "conv1d.bias", m.conv_dim),))
    if m.proj_bias:
        out["mamba.in_proj.bias"] = Source(((mixer + "in_proj.bias", m.in_proj_width),))
        out["mamba.out_proj.bias"] = Source(((mixer + "out_proj.bias", cfg.d_model),))
    return out


def _attention_sources(cfg, mixer: str) -> dict[str, Source]:
    q, kv = cfg.num_heads * cfg.resolved_head_dim, cfg.num_kv_heads * cfg.resolved_head_dim
    qkv = ((mixer + "q_proj.weight", q), (mixer + "k_proj.weight", kv),
           (mixer + "v_proj.weight", kv))  # fmt: skip
    return {
        "attn.qkv.kernel": Source(qkv, True),
        "attn.o.kernel": Source(((mixer + "o_proj.weight", cfg.d_model),), True),
    }


def _mlp_sources(cfg, mixer: str) -> dict[str, Source]:
    return {
        "mlp.up.kernel": Source(((mixer + "up_proj.weight", cfg.mlp_dim),), True),
        "mlp.down.kernel": Source(((mixer + "down_proj.weight", cfg.d_model),), True),
    }


BLOCK_SOURCES: dict[str, Callable[..., dict[str, Source]]] = {
    "mamba": _mamba_sources,
    "attention": _attention_sources,
    "mlp": _mlp_sources,
}
"""A block kind -> its mixer's table (relative to `layers.{i}.`), given the mixer's HF prefix
(an MoE block's: `hf.nemotron_h_moe.nemotron_moe_sources`, which reads the layout too)."""


def _block_sources(cfg, kind: str, block: str, names: Collection[str]) -> dict:
    """The table of one block (relative to it) of `kind` whose HF tensors are under `block`."""
    mixer = block + "mixer."
    out = {"norm.scale": Source(((block + "norm.weight", cfg.d_model),))}
    if kind == "moe":
        return out | nemotron_moe_sources(cfg, mixer, names)
    return out | BLOCK_SOURCES[kind](cfg, mixer)


def mtp_prefix(names: Collection[str]) -> str:
    """Where a checkpoint's MTP layers are: `mtp.` (NVIDIA's checkpoints), or under the
    backbone's prefix (`backbone.mtp.`, `model.mtp.`) if that is where they are."""
    for prefix in ("mtp.", *(p + "mtp." for p in LAYOUTS)):
        if any(name.startswith(prefix + "layers.") for name in names):
            return prefix
    return "mtp."


def _mtp_sources(cfg, names: Collection[str]) -> dict:
    """The table of the run's MTP layers (`mtp.layers.{j}.*`; none with MTP off)."""
    p, d, size, out = mtp_prefix(names), cfg.d_model, len(cfg.mtp.pattern), {}
    for j in range(mtp_layer_count(cfg)):
        hf = f"{p}layers.{j}."
        layer = _block_sources(cfg, mtp_layer_kind(cfg, j), hf, names)
        if j % size == 0:
            layer["enorm.scale"] = Source(((hf + "enorm.weight", d),))
            layer["hnorm.scale"] = Source(((hf + "hnorm.weight", d),))
            layer["eh_proj.kernel"] = Source(((hf + "eh_proj.weight", d),), True)
        if j % size == size - 1:
            layer["final_layernorm.scale"] = Source(((hf + "final_layernorm.weight", d),))
        out.update({f"mtp.layers.{j}.{k}": v for k, v in layer.items()})
    return out


def nemotron_h_sources(cfg, names: Collection[str]) -> dict[str, Source]:
    """Canonical parameter path -> where its values are, in the layout `names` holds."""
    p = layout_prefix(names)
    out = {
        "embed.embedding": Source(((p + "embeddings.weight", cfg.d_model),)),
        "final_norm.scale": Source(((p + "norm_f.weight", cfg.d_model),)),
        "lm_head.kernel": Source((("lm_head.weight", cfg.vocab_size),), True),
    }
    for i, kind in enumerate(block_kinds(cfg)):
        block = _block_sources(cfg, kind, f"{p}layers.{i}.", names)
        out.update({f"layers.{i}.{k}": v for k, v in block.items()})
    return out | _mtp_sources(cfg, names)


def _mixer_names(names: Collection[str], prefix: str) -> dict[int, set[str]]:
    """Block index -> the names under its `mixer.` in the checkpoint's layout."""
    found: dict[int, set[str]] = {}
    for name in names:
        match = _BLOCK_TENSOR.match(name)
        if match and match.group(1) + "." == prefix:
            found.setdefault(int(match.group(2)), set()).add(match.group(3))
    return found


def check_nemotron_h(cfg, names: Collection[str], shape_of: Callable[[str], tuple]) -> None:
    """One-line errors, before any weight is read, for a checkpoint whose blocks disagree with
    the config's pattern (a block of another kind, missing, or past the pattern's end) or whose
    conv1d does not have the config's [conv_dim, 1, conv_kernel] (other shapes and missing
    tensors are named by the reader's check).

    Raises:
        HFImportError: naming the block, its tensors and what the config says.
    """
    prefix = layout_prefix(names)
    found, kinds = _mixer_names(names, prefix), block_kinds(cfg)
    past = sorted(i for i in found if i >= len(kinds))
    if past:
        raise HFImportError(
            f"model.init_from: the checkpoint holds block {past[-1]} ({prefix}layers.{past[-1]}"
            f".mixer.*) but config.json's pattern {cfg.pattern!r} has {len(kinds)} blocks"
        )
    for i, kind in enumerate(kinds):
        have = found.get(i, set())
        held = [k for k, marks in MIXER_TENSORS.items() if have & set(marks)]
        if held != [kind]:
            holds = (
                f"{sorted(have)} ({' and '.join(held) or 'no mixer'} tensors)"
                if have
                else "nothing"
            )
            raise HFImportError(
                f"model.init_from: config.json's pattern {cfg.pattern!r} makes block {i} "
                f"{kind} ({_LETTER[kind]!r}) but {prefix}layers.{i}.mixer holds {holds}"
            )
    _check_experts(cfg, names, shape_of, prefix)
    m = cfg.mamba
    for i in (i for i, kind in enumerate(kinds) if kind == "mamba"):
        name = f"{prefix}layers.{i}.mixer.conv1d.weight"
        if name in names and tuple(shape_of(name)) != (m.conv_dim, 1, m.conv_kernel):
            raise HFImportError(
                f"model.init_from: {name} has shape {tuple(shape_of(name))}, but config.json "
                f"implies ({m.conv_dim}, 1, {m.conv_kernel}) (conv_dim = mamba_num_heads * "
                f"mamba_head_dim + 2 * n_groups * ssm_state_size, conv_kernel={m.conv_kernel})"
            )


def _check_experts(cfg, names: Collection[str], shape_of: Callable, prefix: str) -> None:
    """`moe.check_block_experts` for every MoE block and MTP layer the run reads."""
    found: dict[str, set[int]] = {}
    for name in names:
        match = _EXPERT_TENSOR.match(name)
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    mixers = [f"{prefix}layers.{i}.mixer." for i, k in enumerate(block_kinds(cfg)) if k == "moe"]
    mixers += [
        f"{mtp_prefix(names)}layers.{j}.mixer." for j in range(mtp_layer_count(cfg))
        if mtp_layer_kind(cfg, j) == "moe"
    ]  # fmt: skip
    for mixer in mixers:
        stacked = stacked_expert_tensor(mixer)
        check_block_experts(mixer.removesuffix("."), mixer + "gate.weight", found.get(mixer, ()),
                            cfg.moe.num_experts, names, shape_of,
                            stacked=stacked if stacked in names else None,
                            key="n_routed_experts")  # fmt: skip


def mtp_tensors(names: Collection[str]) -> list[str]:
    """The multi-token-prediction tensors among `names`, sorted."""
    return sorted(n for n in names if MTP_TENSOR.match(n))
