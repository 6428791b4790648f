"""`nvfp4_ops.te_attention` against the released TransformerEngine: every name and keyword it
uses exists (parsed from TE's sources), TE reads the documents it is given as the documents
nvfp4-train packed (TE's own pure-JAX derivation of cuDNN's sequence lengths and offsets, run on
CPU), its forward's residuals carry the name remat policies keep, and, with a CPU stand-in for
the cuDNN kernel (te_attention_standin.py), TE partitions it over fake devices as nvfp4-train
lays it out (sharded_te_attention.py). The kernel itself needs a GPU: `nvfp4-train run` checks
it against the reference attention there before a run uses it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
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


def test_support_names_the_reason_off_a_gpu_or_on_one_that_cannot_run_it():
    ok, why = te_attention.te_attention_support(platform="cpu", dtype=jnp.bfloat16, head_dim=64)
    assert not ok and "NVIDIA GPU" in why
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.float32, head_dim=64)
    assert not ok and "bfloat16 or float16" in why
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.bfloat16, head_dim=24)
    assert not ok and "head_dim % 16 == 0" in why  # 24 % 8 == 0: cuDNN's dQ-accumulator path
    a100 = te_attention.GpuFacts((8, 0), 90800)
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.bfloat16, head_dim=64,
                                                gpu=a100)  # fmt: skip
    assert not ok and "sm_90 or newer, this GPU is sm_80" in why
    old_cudnn = te_attention.GpuFacts((9, 0), 90500)
    ok, why = te_attention.te_attention_support(platform="gpu", dtype=jnp.bfloat16, head_dim=64,
                                                num_heads=8, num_kv_heads=2, gpu=old_cudnn)  # fmt: skip
    assert not ok and "cuDNN >= 9.6 (grouped-query heads need it" in why and "9.5.0" in why


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` in `jaxpr` and every jaxpr inside it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _count(sub, name)
    return count


def test_a_policy_that_keeps_the_residual_name_runs_the_forward_once(te_jax):
    del te_jax  # TE's JAX package imported over the stand-in extension
    documents = jnp.asarray(_packed(ROWS)[0])
    positions = jnp.asarray(_packed(ROWS)[1])
    q = jnp.ones((3, 8, 4, 16), jnp.bfloat16)
    kv = jnp.ones((3, 8, 2, 16), jnp.bfloat16)

    def forwards(policy) -> int:
        def attend(q, k, v):
            out = te_attention.te_attention(q, k, v, documents, positions, max_documents=4,
                                            residual_name="kept")  # fmt: skip
            return jnp.sum(out.astype(jnp.float32))

        grad = jax.grad(jax.checkpoint(attend, policy=policy), argnums=(0, 1, 2))
        return _count(jax.make_jaxpr(grad)(q, kv, kv).jaxpr, "te_fused_attn_forward_ffi_wrapper")

    assert forwards(jax.checkpoint_policies.save_only_these_names("kept")) == 1
    assert forwards(jax.checkpoint_policies.dots_saveable) == 2  # a custom call is not a dot


def test_te_partitions_attention_over_fake_devices_as_nvfp4_train_lays_it_out(te_root, te_version):
    # Both releases: 2.14's backward takes the output gradient's sharding as it comes (2.20's
    # does not), which only this run shows. ~15 s per release.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    script = Path(__file__).with_name("sharded_te_attention.py")
    done = subprocess.run(
        [sys.executable, str(script), str(Path(te_root).resolve()), te_version],
        env=env, cwd=script.parent, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "sharded te attention ok" in done.stdout, done.stdout
