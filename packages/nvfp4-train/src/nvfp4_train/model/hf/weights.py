"""A Hugging Face model's safetensors weights read into the run's parameter tree (`model.init_from`).

Each parameter is built with `jax.make_array_from_callback` in its final sharding: every device's
shard is a float32 buffer filled straight from the memory-mapped safetensors files in chunks of at
most `CHUNK_BYTES`, so a process holds only the slices its devices own plus one chunk, and the
checkpoint is never in memory twice. The files are read with `nvfp4_format`'s strict safetensors
reader (headers validated: offsets tile the data, shapes match sizes; memory-mapped, bfloat16
through ml_dtypes): the `safetensors` library's NumPy API cannot return bfloat16, and its JAX API
copies every slice through a device buffer (measured: +1.8 GiB of transient memory importing a
1.2B-parameter checkpoint). The
fused layouts are assembled slice by slice: `attn.qkv.kernel` [D, q|k|v] from `q_proj`, `k_proj`,
`v_proj` (HF weights are [out, in], kernels [in, out]), `mlp.gate_up.kernel` from `gate_proj` and
`up_proj`; stacked blocks (`layers.{a}-{b}`) read one layer per index of their leading axis.
Values become float32 master weights whatever the stored float type.

Example (`abstract` the run's params as ShapeDtypeStructs, `shardings` theirs):
    params, unused = load_hf_params(model_dir, cfg.model, abstract, shardings)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nvfp4_format.safetensors_file import read_tensor
from nvfp4_format.safetensors_header import SafetensorsHeader, read_safetensors_header
from nvfp4_format.safetensors_index import read_safetensors_index
from nvfp4_train.model.config import ModelConfig
from nvfp4_train.model.hf.errors import HFImportError
from nvfp4_train.model.hf.moe import check_experts, moe_sources
from nvfp4_train.model.hf.nemotron_h import NEMOTRON_H
from nvfp4_train.model.hf.nemotron_h_weights import (
    check_nemotron_h,
    mtp_tensors,
    nemotron_h_sources,
)
from nvfp4_train.model.hf.sources import ExpertSources, Source
from nvfp4_train.model.moe.config import is_moe_layer
from nvfp4_train.model.stacking import is_stacked, layer_paths
from nvfp4_train.tree_paths import key_names

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_TYPES = ("F32", "BF16", "F16", "F64")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Tensors of old checkpoints that are buffers, not weights (recomputed from the config)."""


def sources(cfg: ModelConfig, names: Collection[str] = ()) -> dict[str, Source | ExpertSources]:
    """Canonical parameter path (`layers.{i}.attn.qkv.kernel`, ...) -> where its values are;
    `names` (the checkpoint's tensor names) tells which layout an MoE block's experts are in
    (`hf_moe.moe_sources`), and for Nemotron-H which of its two layouts it is."""
    if cfg.architecture == NEMOTRON_H:
        return dict(nemotron_h_sources(cfg, names))
    hd = cfg.resolved_head_dim
    q, kv, f = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.mlp_dim
    out = {
        "embed.embedding": Source((("model.embed_tokens.weight", cfg.d_model),)),
        "final_norm.scale": Source((("model.norm.weight", cfg.d_model),)),
    }
    if not cfg.tie_embeddings:
        out["lm_head.kernel"] = Source((("lm_head.weight", cfg.vocab_size),), transposed=True)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        qkv = ((attn + "q_proj", q), (attn + "k_proj", kv), (attn + "v_proj", kv))
        block = {
            "attn_norm.scale": Source(((hf + "input_layernorm.weight", cfg.d_model),)),
            "mlp_norm.scale": Source(((hf + "post_attention_layernorm.weight", cfg.d_model),)),
            "attn.qkv.kernel": Source(tuple((n + ".weight", r) for n, r in qkv), transposed=True),
            "attn.o.kernel": Source(((attn + "o_proj.weight", cfg.d_model),), transposed=True),
            "mlp.gate_up.kernel": Source(
                ((mlp + "gate_proj.weight", f), (mlp + "up_proj.weight", f)), transposed=True
            ),
            "mlp.down.kernel": Source(((mlp + "down_proj.weight", cfg.d_model),), transposed=True),
        }
        if cfg.qkv_bias:
            block["attn.qkv.bias"] = Source(tuple((n + ".bias", r) for n, r in qkv))
        if cfg.o_bias:
            block["attn.o.bias"] = Source(((attn + "o_proj.bias", cfg.d_model),))
        if cfg.qk_norm:
            block["attn.q_norm.scale"] = Source(((attn + "q_norm.weight", hd),))
            block["attn.k_norm.scale"] = Source(((attn + "k_norm.weight", hd),))
        if is_moe_layer(cfg.moe, i):
            del block["mlp.gate_up.kernel"], block["mlp.down.kernel"]
            block.update(moe_sources(cfg, i, names))
        out.update({ours + k: v for k, v in block.items()})
    return out


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (one file, or a sharded index).

    Raises:
        HFImportError: no weights, an unreadable index, or shards it names that are missing.
    """
    root = Path(model_dir)
    if (root / INDEX_FILE).is_file():
        try:
            index = read_safetensors_index(root / INDEX_FILE)
        except (OSError, ValueError) as e:
            raise HFImportError(f"model.init_from: cannot read {root / INDEX_FILE}: {e}") from None
        files = {name: root / file for name, file in index.weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise HFImportError(
                f"model.init_from: {INDEX_FILE} names shards that are missing: {missing}"
            )
        return files
    if (root / SINGLE_FILE).is_file():
        return dict.fromkeys(_header(root / SINGLE_FILE).tensors, root / SINGLE_FILE)
    pickled = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = f" (found {pickled}: pickled weights are never loaded; convert them)" if pickled else ""
    raise HFImportError(
        f"model.init_from: {str(root)!r} holds no {SINGLE_FILE} or {INDEX_FILE}{hint}"
    )


def _header(path: Path) -> SafetensorsHeader:
    try:
        return read_safetensors_header(path)
    except (OSError, ValueError) as e:
        raise HFImportError(f"model.init_from: cannot read {path}: {e}") from None


class _Reader:
    """Checked reads of HF tensors into float32 buffers, in chunks of at most `CHUNK_BYTES`.

    Each chunk is copied (and cast) from its own memory map of the tensor, which is closed right
    after, so the pages it touched never pile up in the process (they would count as its memory).
    """

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.headers = {path: _header(path) for path in sorted(set(files.values()))}

    def check(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Raises HFImportError unless every tensor of `expected` exists with that shape and a
        float dtype (headers only; no data is read)."""
        for name, shape in expected.items():
            if name not in self.files:
                raise HFImportError(f"model.init_from: the checkpoint has no tensor {name!r}")
            info = self.headers[self.files[name]].tensors.get(name)
            if info is None:
                raise HFImportError(
                    f"model.init_from: {self.files[name].name} does not hold {name!r} "
                    f"(its index says it does)"
                )
            if info.dtype not in FLOAT_TYPES:
                raise HFImportError(
                    f"model.init_from: tensor {name!r} is {info.dtype}, expected one of "
                    f"{FLOAT_TYPES} (a quantized or integer checkpoint?)"
                )
            if tuple(info.shape) != shape:
                raise HFImportError(
                    f"model.init_from: tensor {name!r} has shape {tuple(info.shape)}, the "
                    f"config implies {shape}"
                )

    def copy(self, out: np.ndarray, name: str, index: tuple[slice, ...], source: Source) -> None:
        """out[...] = tensor[index] (its transpose when `source.transposed`), `index` slices of
        the stored tensor (of its entry `source.entry` along a leading stacked axis, when given;
        a depthwise conv's [C, 1, K] read as [C, K])."""
        first = index[0]
        row_bytes = 4 * max(1, out.size // max(1, first.stop - first.start))
        step = max(1, CHUNK_BYTES // row_bytes)
        header = self.headers[self.files[name]]
        for lo in range(first.start, first.stop, step):
            hi = min(lo + step, first.stop)
            stored = read_tensor(header, name)
            stored = stored if source.entry is None else stored[source.entry]
            stored = stored[:, 0] if source.depthwise_conv else stored
            chunk = stored[(slice(lo, hi), *index[1:])]
            rows = slice(lo - first.start, hi - first.start)
            region = out[..., rows] if source.transposed else out[rows]
            region[...] = chunk.T if source.transposed else chunk
            del chunk, stored  # unmaps the tensor
            if not np.isfinite(region).all():
                raise HFImportError(
                    f"model.init_from: tensor {name!r} holds NaN or Inf values; a run cannot "
                    "start from it"
                )


CHUNK_BYTES = 64 * 2**20
"""Most bytes of float32 values one read holds besides the parameter being filled."""


def _hf_shape(source: Source, rows: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    if source.depthwise_conv:  # [K, C] from [C, 1, K]
        return (rows, 1, shape[0])
    if source.transposed:
        return (rows, shape[0])
    return (rows, *shape[1:]) if len(shape) == 1 else shape


def _expected_shapes(table: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape the config implies (a stacked tensor with its expert axis)."""
    expected = {}
    for path, entry in table.items():
        shape = shapes[path]
        if isinstance(entry, ExpertSources):
            items = [(source, shape[1:], len(entry.experts)) for source in entry.experts]
        else:
            items = [(entry, shape, None)]
        for source, one, count in items:
            for name, rows in source.parts:
                hf = _hf_shape(source, rows, one)
                expected[name] = hf if source.entry is None else (count, *hf)
    return expected


def _fill(reader: _Reader, out: np.ndarray, source: Source, index: tuple[slice, ...]) -> None:
    """out[...] = the values of `source` at `index` (step-1 slices over the parameter's shape),
    concatenated from its parts along the last axis."""
    last, offset = index[-1], 0
    for name, rows in source.parts:
        lo, hi = max(last.start, offset), min(last.stop, offset + rows)
        if lo < hi:
            part_rows = slice(lo - offset, hi - offset)
            dst = out[..., lo - last.start : hi - last.start]
            if source.transposed:  # stored [out, in]: its rows are our last axis
                reader.copy(dst, name, (part_rows, index[0]), source)
            elif len(index) == 1:
                reader.copy(dst, name, (part_rows,), source)
            else:  # one part (embedding): stored as the parameter
                reader.copy(dst, name, (*index[:-1], part_rows), source)
        offset += rows


def _fill_entry(reader: _Reader, out: np.ndarray, entry, index: tuple[slice, ...]) -> None:
    """`_fill` for a table entry: a `Source` (no parts: zeros), or `ExpertSources` (one source
    per index of the leading axis)."""
    if isinstance(entry, ExpertSources):
        for j, expert in enumerate(range(index[0].start, index[0].stop)):
            _fill_entry(reader, out[j], entry.experts[expert], index[1:])
    elif not entry.parts:
        out[...] = 0
    else:
        _fill(reader, out, entry, index)


def _aligned_empty(shape: tuple[int, ...], alignment: int = 64) -> np.ndarray:
    """An uninitialised float32 array whose data starts on an `alignment`-byte boundary.

    XLA's CPU client adopts such a host buffer as the device buffer without copying it; a plain
    `np.empty` (16-byte aligned) is copied, which doubled the peak memory of a large stacked leaf.
    """
    count = int(np.prod(shape))
    raw = np.empty(count * 4 + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + count * 4].view(np.float32).reshape(shape)


def _leaf_reader(
    reader: _Reader, table: dict[str, Source], path: tuple[str, ...], shape: tuple[int, ...]
) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback of one parameter leaf: a float32 buffer of the requested shard, filled in
    place (a stacked leaf layer by layer along its leading axis)."""
    stacked, layers = is_stacked(path), layer_paths(path)

    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, shape, strict=True))
        out = _aligned_empty(tuple(s.stop - s.start for s in index))
        if not stacked:
            _fill_entry(reader, out, table[layers[0]], index)
            return out
        for j, layer in enumerate(range(index[0].start, index[0].stop)):
            _fill_entry(reader, out[j], table[layers[layer]], index[1:])
        return out

    return read


def load_hf_params(
    model_dir: str | Path, cfg: ModelConfig, abstract_params: Any, shardings: Any
) -> tuple[Any, list[str]]:
    """(params in the tree of `abstract_params`, float32 with `shardings`; the names of the
    checkpoint's tensors the model does not use).

    Raises:
        HFImportError: missing tensors or shards, wrong shapes, non-float tensors, NaN or Inf
            values.
    """
    files = tensor_files(model_dir)
    table = sources(cfg, files)
    reader = _Reader(files)
    shape_of = lambda n: tuple(reader.headers[files[n]].tensors[n].shape)  # noqa: E731
    check_experts(cfg, files, shape_of)
    if cfg.architecture == NEMOTRON_H:
        check_nemotron_h(cfg, files, shape_of)
    canonical_shapes = _canonical_shapes(abstract_params)
    if set(canonical_shapes) != set(table):
        raise HFImportError(
            "model.init_from: the model's parameters do not match the import table: "
            f"{sorted(set(canonical_shapes) ^ set(table))[:6]}"
        )
    reader.check(_expected_shapes(table, canonical_shapes))
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    leaves = []
    for (key_path, leaf), sharding in zip(flat, jax.tree.leaves(shardings), strict=True):
        shape = tuple(leaf.shape)
        read = _leaf_reader(reader, table, key_names(key_path), shape)
        leaves.append(jax.make_array_from_callback(shape, sharding, read))
    params = jax.tree_util.tree_unflatten(treedef, leaves)
    used = set(_expected_shapes(table, canonical_shapes))
    unused = sorted(
        n for n in files if n not in used and not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and n == "lm_head.weight")
    )  # fmt: skip
    return params, unused


def unused_lines(unused: Collection[str]) -> list[str]:
    """What a run says of the checkpoint's tensors it does not use (`load_hf_params`): the
    multi-token-prediction ones dropped (the trainer's MTP is off), then the others listed.

    Example:
        >>> unused_lines(["mtp.layers.0.norm.weight", "mtp.layers.0.eh_proj.weight"])[0]
        'model.init_from: dropping the 2 multi-token-prediction (MTP) tensors (mtp.*): the run trains without MTP'
    """
    mtp = mtp_tensors(unused)
    rest = sorted(n for n in unused if n not in set(mtp))
    lines = []
    if mtp:
        roots = sorted({n.split("mtp.")[0] + "mtp.*" for n in mtp})
        lines.append(
            f"model.init_from: dropping the {len(mtp)} multi-token-prediction (MTP) tensors "
            f"({', '.join(roots)}): the run trains without MTP"
        )
    if rest:
        lines.append(f"warning: {len(rest)} tensors of the checkpoint are not used: {rest[:8]}")
    return lines


def _canonical_shapes(abstract_params: Any) -> dict[str, tuple[int, ...]]:
    """Canonical dotted path -> shape of one layer's parameter."""
    shapes = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        path = key_names(key_path)
        shape = tuple(leaf.shape[1:] if is_stacked(path) else leaf.shape)
        shapes.update(dict.fromkeys(layer_paths(path), shape))
    return shapes
