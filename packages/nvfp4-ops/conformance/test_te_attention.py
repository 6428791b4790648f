"""`nvfp4_ops.te_attention` against the released TransformerEngine: every name and keyword it
uses exists (parsed from TE's sources), and TE reads the documents it is given as the documents
nvfp4-train packed (TE's own pure-JAX derivation of cuDNN's sequence lengths and offsets, run on
CPU). The fused kernel itself needs a GPU: `nvfp4-train run` checks it against the reference
attention there before a run uses it."""

from __future__ import annotations

import importlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import te_api

import nvfp4_ops.te_attention as te_attention

SOURCE = Path(te_attention.__file__).read_text()
ROWS = [[3, 1, 4], [8], [2, 2, 2, 2]]
"""Document lengths of three packed rows of 8 tokens."""


def test_every_use_exists_in_the_release(te_root):
    uses = te_api.uses(SOURCE)
    assert {str(u).partition("(")[0] for u in uses} >= {
        "transformer_engine.jax.attention.fused_attn",
        "transformer_engine.jax.attention.SequenceDescriptor.from_segment_ids_and_pos",
        "transformer_engine.jax.attention.QKVLayout.THD_THD_THD",
        "transformer_engine.jax.attention.AttnMaskType.PADDING_CAUSAL_MASK",
    }
    assert te_api.missing(te_root, uses) == []


def test_a_wrong_mask_name_would_be_caught(te_root):
    wrong = SOURCE.replace("PADDING_CAUSAL_MASK", "CAUSAL_PADDING_MASK")
    assert any("CAUSAL_PADDING_MASK" in p for p in te_api.missing(te_root, te_api.uses(wrong)))


def _packed(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """nvfp4-train's segment ids (0, 1, ... per row) and positions for documents of `rows`."""
    ids = [np.repeat(np.arange(len(r)), r) for r in rows]
    pos = [np.concatenate([np.arange(n) for n in r]) for r in rows]
    return np.stack(ids).astype(np.int32), np.stack(pos).astype(np.int32)


def _seqlens_offsets(te_jax, rows, max_documents):
    del te_jax  # imported: TE's attention module is importable now
    attn = importlib.import_module("transformer_engine.jax.attention")
    document, position = _packed(rows)
    ids, pos = te_attention.te_segments(jnp.asarray(document), jnp.asarray(position),
                                        document.shape)  # fmt: skip
    descriptor = attn.SequenceDescriptor.from_segment_ids_and_pos(ids, pos)
    (q_len, kv_len), (q_off, kv_off) = descriptor.get_seqlens_and_offsets(
        attn.AttnMaskType.PADDING_CAUSAL_MASK, attn.QKVLayout.THD_THD_THD, None, max_documents
    )
    return [np.asarray(a) for a in (q_len, kv_len, q_off, kv_off)]


def test_te_reads_each_packed_document_as_one_sequence(te_jax):
    q_len, kv_len, q_off, kv_off = _seqlens_offsets(te_jax, ROWS, max_documents=4)
    for row, lengths in enumerate(ROWS):
        n = len(lengths)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        for seqlens, offsets in ((q_len, q_off), (kv_len, kv_off)):
            assert seqlens[row, :n].tolist() == lengths and not seqlens[row, n:].any()
            assert offsets[row, :n].tolist() == starts.tolist()


def test_documents_beyond_the_bound_are_not_attended(te_jax):
    # why nvfp4-train checks every batch against model.attention_max_documents on the host
    q_len, *_ = _seqlens_offsets(te_jax, ROWS, max_documents=2)
    assert q_len[2].tolist() == [2, 2]  # the third and fourth document of row 2 are dropped


def test_support_names_the_reason_off_a_gpu():
    ok, why = te_attention.te_attention_support(platform="cpu", dtype=jnp.bfloat16, head_dim=64)
    assert not ok and "NVIDIA GPU" in why
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.float32, head_dim=64)
    assert not ok and "bfloat16 or float16" in why
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.bfloat16, head_dim=12)
    assert not ok and "head_dim" in why
