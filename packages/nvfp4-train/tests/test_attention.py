"""`model.attention`: every implementation that runs here agrees with "naive" (outputs and
dq/dk/dv, with and without document masking), document masking equals per-document attention,
the train step's memory grows linearly with length with "chunked", and the config key's choices
and errors."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import io
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from jax._src.ad_checkpoint import saved_residuals
from jax._src.cudnn import fused_attention_stablehlo
from jax.extend import core as jax_core
from jax.sharding import AbstractMesh
from run_steps import initial, train_step_of
from test_model import attention_reference

import nvfp4_ops.te_attention
import nvfp4_train.model.blocks.attention
import nvfp4_train.training.loop
import nvfp4_train.training.trusted
from nvfp4_ops.te_attention import GpuFacts
from nvfp4_train.config.loader import to_dict
from nvfp4_train.config.run_config import ConfigError, config_from_dict, upgraded
from nvfp4_train.data.packing import PackedSequences
from nvfp4_train.errors import RunError
from nvfp4_train.mesh.sharding import AXES, activation_constraint, attention_heads_note
from nvfp4_train.model.blocks.attention import (
    CUDNN_FORWARD,
    attention,
    attention_capability,
    cudnn_mask_is_dense,
    document_positions,
    documents_per_row,
    fused_attention,
    fused_kernels,
    resolve_attention,
    run_attention,
)
from nvfp4_train.model.config import REMAT_POLICIES
from nvfp4_train.precision import attention_check
from nvfp4_train.precision.attention_check import row_documents, verify_attention
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.run import run
from nvfp4_train.training.step import forward, forward_with_stats, model_graphdef, model_spec
from nvfp4_train.training.trusted import (
    _with_trusted_attention,
    attention_text,
    with_document_bound,
)

CPU_IMPLEMENTATIONS = ("chunked", "xla")
PLATFORM = jax.default_backend()


def _grads(implementation: str, block: int, q, k, v, seg, w):
    """(output, dq, dk, dv) of sum(attention * w)."""

    def loss(q, k, v):
        out = attention(q, k, v, seg, implementation=implementation, block=block)
        return jnp.sum(out * w), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, *grads)


def _relative_errors(got, want):
    """max |got - want| / max(max |want|, 1) per array (inputs are O(1), so are the grads)."""
    return [jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1.0) for a, b in
            zip(got, want, strict=True)]  # fmt: skip


@pytest.fixture(scope="module")
def agreement():
    """Jitted `(q, k, v, seg, w) -> {(implementation, masked): [err out, dq, dk, dv]}` vs
    naive, with `seg` and without segment ids; `block` and `implementations` are static."""

    @functools.partial(jax.jit, static_argnames=("block", "implementations"))
    def errors(q, k, v, seg, w, *, block, implementations):
        result = {}
        for masked in (False, True):
            ids = seg if masked else None
            want = _grads("naive", block, q, k, v, ids, w)
            for name in implementations:
                result[name, masked] = _relative_errors(_grads(name, block, q, k, v, ids, w), want)
        return result

    return errors


def _inputs(length: int, heads: int, kv_heads: int, seed: int = 0, head_dim: int = 16):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (1, length, heads, head_dim), jnp.float32)
    k = jax.random.normal(keys[1], (1, length, kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(keys[2], (1, length, kv_heads, head_dim), jnp.float32)
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    seg = jnp.cumsum(jax.random.bernoulli(keys[4], 0.08, (1, length)), axis=1, dtype=jnp.int32)
    return q, k, v, seg, w


@pytest.mark.parametrize(
    "length, block, heads, kv_heads, implementations",
    [
        (1, 4, 2, 2, ("chunked",)),
        (37, 8, 4, 2, CPU_IMPLEMENTATIONS),
        (2048, 384, 4, 1, ("chunked",)),
    ],
    ids=["L1-gqa1", "L37-block8-gqa2", "L2048-block384-gqa4"],
)  # xla (jax's own code) once: each implementation costs a compile of 2 forward + backward
def test_implementations_agree_with_naive_outputs_and_grads(
    agreement, length, block, heads, kv_heads, implementations
):
    q, k, v, seg, w = _inputs(length, heads, kv_heads)
    errors = agreement(q, k, v, seg, w, block=block, implementations=implementations)
    errors = jax.device_get(errors)
    worst = {key: max(float(e) for e in errs) for key, errs in errors.items()}
    assert all(e <= 1e-6 for e in worst.values()), worst


@pytest.mark.skipif(
    not attention_capability("cudnn", platform=PLATFORM)[0],
    reason=attention_capability("cudnn", platform=PLATFORM)[1] or "cudnn runs",
)
def test_cudnn_agrees_with_naive_in_bfloat16():  # pragma: no cover - NVIDIA GPUs only
    q, k, v, seg, w = (x.astype(jnp.bfloat16) for x in _inputs(256, 4, 2))
    for ids in (None, seg):
        got = _grads("cudnn", 64, q, k, v, ids, w)
        want = _grads("naive", 64, q, k, v, ids, w)
        errs = [float(e) for e in _relative_errors(got, want)]
        assert max(errs) <= 2e-2, errs


@pytest.mark.parametrize("implementation", ("naive", *CPU_IMPLEMENTATIONS))
def test_document_mask_is_attention_within_each_document(implementation):
    lengths = (5, 9, 1, 7)
    q, k, v, _, _ = _inputs(sum(lengths), 4, 2, seed=3)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    run = jax.jit(functools.partial(attention, implementation=implementation, block=4))
    packed = np.asarray(run(q, k, v, seg))
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = _numpy_causal_gqa(q[:, part], k[:, part], v[:, part])
        np.testing.assert_allclose(packed[:, part], alone, rtol=1e-5, atol=1e-6)
        start += n


def _numpy_causal_gqa(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK):
    """float64 NumPy causal GQA of one document (the reference of the document mask): the
    multi-head reference of test_model with each kv head repeated for its query heads."""
    group = q_BxLxHxK.shape[2] // k_BxLxGxK.shape[2]
    return attention_reference(
        q_BxLxHxK, np.repeat(k_BxLxGxK, group, axis=2), np.repeat(v_BxLxGxK, group, axis=2)
    )


def test_document_positions_restart_at_each_document():
    seg = jnp.array([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 4, 4]], jnp.int32)
    assert document_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def _step_temp_bytes(implementation: str, length: int) -> int:
    """Temp memory XLA plans for the whole train step (forward, backward, AdamW) of a 1-block,
    32-wide model on one packed row of `length` tokens (compiled, not run)."""
    cfg = _model_config(implementation, max_seq_len=length, attention_block=256)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seq_len=length,
                                                             batch_size=1))  # fmt: skip
    graphdef, state = abstract_state(cfg)
    tokens = jax.ShapeDtypeStruct((1, length), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens, "positions": tokens}
    compiled = jax.jit(train_step_of(cfg, graphdef)).lower(state, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_train_step_memory_grows_linearly_with_chunked_quadratically_with_naive():
    chunked = [_step_temp_bytes("chunked", n) for n in (4096, 8192)]
    naive = [_step_temp_bytes("naive", n) for n in (4096, 8192)]
    assert chunked[1] <= 2.2 * chunked[0], chunked
    assert naive[1] >= 3.5 * naive[0], naive
    assert chunked[1] * 20 < naive[1], (chunked, naive)


def _model_config(attention_name: str, **model):
    return config_from_dict(
        {
            "model": {
                "vocab_size": 64, "d_model": 32, "num_layers": 1, "num_heads": 4,
                "num_kv_heads": 2, "mlp_dim": 64, "max_seq_len": 24, "dtype": "float32",
                "attention": attention_name, "attention_block": 8, **model,
            },
            "precision": {"recipe": "bf16"},
            "optimizer": {"learning_rate": 1e-2, "schedule": "constant", "warmup_steps": 0},
            "train": {"steps": 20, "seed": 7, "batch_size": 2, "seq_len": 20},
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model():
    """(graphdef of `attention` -> ..., the step-0 state shared by all of them)."""
    _, state = initial(_model_config("naive"))
    graphdefs = {name: model_graphdef(model_spec(_model_config(name))) for name in
                 ("naive", "chunked")}  # fmt: skip
    return graphdefs, state


def test_chunked_trains_with_the_losses_of_naive_on_packed_documents(tiny_model):
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 64, dtype=jnp.int32)
    seg = jnp.asarray([[0] * 7 + [1] * 13, [0] * 20], jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": document_positions(seg)}  # fmt: skip
    losses = {}
    graphdefs, state0 = tiny_model
    for name in ("naive", "chunked"):
        state = jax.tree.map(jnp.copy, state0)
        step = jax.jit(train_step_of(_model_config(name), graphdefs[name]))
        losses[name] = []
        for _ in range(20):
            state, metrics = step(state, batch)
            losses[name].append(float(metrics["loss"]))
    np.testing.assert_allclose(losses["chunked"], losses["naive"], rtol=1e-5)
    assert losses["naive"][-1] < losses["naive"][0]


def test_model_on_packed_documents_equals_each_document_alone(tiny_model):
    graphdefs, state = tiny_model
    run = jax.jit(functools.partial(forward, graphdefs["chunked"]))
    tokens = jax.random.randint(jax.random.key(2), (1, 12), 0, 64, dtype=jnp.int32)
    seg = jnp.asarray([[0] * 5 + [1] * 7], jnp.int32)
    packed = run(state.params, tokens, None, (seg, document_positions(seg)))
    for part in (slice(0, 5), slice(5, 12)):
        alone = run(state.params, tokens[:, part])
        np.testing.assert_allclose(packed[:, part], alone, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "mesh_shape, kv_heads, heads_spec",
    [((2, 1, 1, 2), 2, "tensor"), ((1, 2, 1, 4), 2, None), ((1, 1, 1, 1), 2, None)],
    ids=["tensor-divides-both", "tensor-divides-q-only", "one-device"],
)
def test_fused_attention_splits_heads_over_tensor_only_when_it_divides_both(
    mesh_shape, kv_heads, heads_spec
):
    mesh = AbstractMesh(mesh_shape, AXES)
    q, kv = jnp.ones((4, 8, 4, 16)), jnp.ones((4, 8, kv_heads, 16))
    ids = jnp.zeros((4, 8), jnp.int32)
    constrain = activation_constraint(mesh)
    jaxpr = jax.make_jaxpr(lambda *x: constrain("attention", x))(q, kv, kv, ids).jaxpr
    specs = [tuple(e.params["sharding"].spec) for e in jaxpr.eqns]
    rows = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
    rows = rows[0] if rows and len(rows) == 1 else rows
    assert specs == [(rows, None, heads_spec, None)] * 3 + [(rows, None)]
    note = attention_heads_note(dict(mesh.shape), 4, kv_heads)
    assert (note is None) == (heads_spec is not None or mesh.shape["tensor"] == 1)


def test_the_model_hands_fused_attention_its_operands_through_the_runs_constraint(
    tiny_model, monkeypatch
):
    # "chunked" plays a fused kernel; the model must pass q, k, v, the segment ids and the
    # output through constrain("attention", ...) in every block
    monkeypatch.setattr(
        nvfp4_train.model.blocks.attention, "FUSED_KERNELS", ("te", "cudnn", "chunked")
    )
    graphdefs, state = tiny_model
    seen = []

    def constrain(kind, x):
        seen.append((kind, [None if a is None else a.shape for a in x]))
        return x

    seg = jnp.zeros((2, 12), jnp.int32)
    jax.make_jaxpr(
        lambda p: forward_with_stats(graphdefs["chunked"], p, seg, None, (seg, seg), constrain)
    )(state.params)
    q, kv = (2, 12, 4, 8), (2, 12, 2, 8)
    assert seen == [("attention", [q, kv, kv, (2, 12)]), ("attention", [q, kv, kv, None])]


def _forward_calls(policy, attend, name: str, *args) -> int:
    """Equations named `name` in the jaxpr of the gradient of `attend` under `policy`."""

    def count(jaxpr) -> int:
        found = sum(e.primitive.name == name for e in jaxpr.eqns)
        return found + sum(
            count(j) for e in jaxpr.eqns for j in jax_core.jaxprs_in_params(e.params)
        )

    loss = lambda *a: jnp.sum(attend(*a).astype(jnp.float32))  # noqa: E731
    grad = jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2))
    return count(jax.make_jaxpr(grad)(*args).jaxpr)


def test_the_dots_policies_keep_fused_attention_instead_of_running_it_twice(monkeypatch):
    q = jnp.ones((1, 16, 4, 16), jnp.bfloat16)
    kv = jnp.ones((1, 16, 2, 16), jnp.bfloat16)
    seg = jnp.zeros((1, 16), jnp.int32)
    chunked = functools.partial(attention, segment_ids_BxL=seg, implementation="chunked", block=8)
    scans = {
        p: _forward_calls(REMAT_POLICIES[p], chunked, "scan", q, kv, kv)
        for p in REMAT_POLICIES
        if p != "none"
    }
    assert scans["dots"] == scans["dots_no_batch"] == scans["full"] - 1  # no second forward
    assert scans["quantized"] == scans["full"]  # recomputes attention, as it says
    # cudnn: jax's forward primitive (traced here with cuDNN's version check stood in)
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda cc: True)
    cudnn = functools.partial(fused_attention, segment_ids_BxL=seg, implementation="cudnn")
    calls = {
        p: _forward_calls(REMAT_POLICIES[p], cudnn, CUDNN_FORWARD, q, kv, kv)
        for p in ("dots", "dots_no_batch", "quantized")
    }
    assert calls == {"dots": 1, "dots_no_batch": 1, "quantized": 2}
    loss = lambda *a: jnp.sum(cudnn(*a).astype(jnp.float32))  # noqa: E731
    kept = saved_residuals(jax.checkpoint(loss, policy=REMAT_POLICIES["dots"]), q, kv, kv)
    assert not [aval for aval, _ in kept if aval.shape[-2:] == (16, 16)]  # the mask: recomputed


def test_auto_resolves_to_naive_for_short_sequences_off_gpu():
    assert resolve_attention("auto", seq_len=128, platform="cpu") == "naive"
    assert resolve_attention("auto", seq_len=4096, platform="cpu") == "chunked"
    assert resolve_attention("auto", seq_len=128, platform="gpu") == "cudnn"
    assert resolve_attention("auto", seq_len=128, platform="gpu", dtype=jnp.float32) == "naive"
    assert resolve_attention("xla", seq_len=8, platform="cpu") == "xla"


H100, A100 = GpuFacts((9, 0), 90800), GpuFacts((8, 0), 90800)


def test_fused_kernels_are_offered_only_where_the_gpu_runs_them(monkeypatch):
    monkeypatch.setattr(nvfp4_ops.te_attention, "_import_problem", lambda: None)  # TE "installed"
    gqa = {"platform": "gpu", "head_dim": 128, "num_heads": 32, "num_kv_heads": 8}
    assert fused_kernels(seq_len=4096, gpu=H100, **gqa) == ("te", "cudnn")
    # an A100: THD needs sm_90, so auto takes cudnn (before: te, which failed its check, and the
    # run fell back to chunked without trying cudnn)
    assert fused_kernels(seq_len=4096, gpu=A100, **gqa) == ("cudnn",)
    assert "sm_90 or newer, this GPU is sm_80" in attention_capability("te", gpu=A100, **gqa)[1]
    old_cudnn = dataclasses.replace(H100, cudnn_version=90500)
    assert resolve_attention("auto", seq_len=4096, gpu=old_cudnn, **gqa) == "cudnn"
    assert not attention_capability("te", **{**gqa, "head_dim": 72})[0]  # 72 % 16 != 0
    assert attention_capability("cudnn", **{**gqa, "head_dim": 72})[0]
    wide = {**gqa, "head_dim": 256}
    assert attention_capability("cudnn", gpu=H100, **wide)[0]
    assert "<= 128 here" in attention_capability("cudnn", gpu=A100, **wide)[1]
    volta = GpuFacts((7, 0), 90800)
    assert not any(attention_capability(k, gpu=volta, **gqa)[0] for k in ("te", "cudnn"))
    assert resolve_attention("auto", seq_len=4096, gpu=volta, **gqa) == "chunked"


def test_auto_prefers_chunked_to_a_dense_cudnn_mask_for_long_masked_rows():
    assert cudnn_mask_is_dense("0.10.2") and cudnn_mask_is_dense("0.9.1")
    assert not cudnn_mask_is_dense("0.10.3") and not cudnn_mask_is_dense("0.11.0")
    gpu = {"platform": "gpu", "head_dim": 128}
    long_masked = resolve_attention("auto", seq_len=4096, masked=True, **gpu)
    assert long_masked == ("chunked" if cudnn_mask_is_dense() else "cudnn")
    assert resolve_attention("auto", seq_len=4096, masked=False, **gpu) == "cudnn"
    assert resolve_attention("auto", seq_len=1024, masked=True, **gpu) == "cudnn"
    cfg = config_from_dict({"train": {"seq_len": 4096}, "model": {"max_seq_len": 4096}})
    assert run_attention(cfg, "gpu") == long_masked  # data.document_mask: auto counts as masked
    unmasked = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask=False))
    assert run_attention(unmasked, "gpu") == "cudnn"


def test_attention_config_key_choices_and_errors():
    assert config_from_dict({}).model.attention == "auto"
    with pytest.raises(ConfigError, match=r"^model\.attention: expected one of 'auto'"):
        config_from_dict({"model": {"attention": "flash"}})
    with pytest.raises(ConfigError, match=r"model\.attention_block must be > 0, got 0"):
        config_from_dict({"model": {"attention_block": 0}})
    with pytest.raises(ConfigError, match="attentoin"):
        config_from_dict({"model": {"attentoin": "naive"}})


def test_an_old_saved_config_without_the_key_computes_naive_attention():
    saved = to_dict(config_from_dict({}))
    del saved["model"]["attention"]
    assert config_from_dict(upgraded(saved)).model.attention == "naive"
    current = to_dict(config_from_dict({"model": {"attention": "chunked"}}))
    assert config_from_dict(upgraded(current)).model.attention == "chunked"


def test_ops_backend_line_names_attention_and_cudnn_off_gpu_is_one_line_error():
    cfg = config_from_dict({"train": {"seq_len": 128}})
    assert attention_text(cfg, "cpu") == "model.attention=auto -> naive"
    chunked = config_from_dict({"model": {"attention": "chunked", "attention_block": 64}})
    assert (
        attention_text(chunked, "cpu") == "model.attention=chunked -> chunked (attention_block=64)"
    )
    cudnn = config_from_dict({"model": {"attention": "cudnn"}})
    with pytest.raises(
        ConfigError, match=r"^model\.attention='cudnn' is not available here: .*cpu"
    ):
        attention_text(cudnn, "cpu")
    te = config_from_dict({"model": {"attention": "te"}})
    with pytest.raises(ConfigError, match=r"^model\.attention='te' is not available here: .*cpu"):
        attention_text(te, "cpu")
    if importlib.util.find_spec("transformer_engine") is None:  # a GPU without TE: one line
        with pytest.raises(ConfigError, match=r"transformer_engine\.jax\.attention does not imp"):
            attention_text(te, "gpu")
    if PLATFORM != "gpu":
        q = jnp.ones((1, 4, 2, 16), jnp.bfloat16)
        with pytest.raises(ValueError, match=r"model\.attention='cudnn' cannot run here"):
            attention(q, q, q, implementation="cudnn")


# ------------------------------------------------------------------ a fused kernel, checked first


def _across_documents(q, k, v, segment_ids, implementation):
    """A fused kernel that ignores the document mask (what the check must catch)."""
    del segment_ids
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _first_row_documents(q, k, v, segment_ids, implementation):
    """A fused kernel that reads row 0's documents for every row (a cross-row mix-up)."""
    first = jnp.broadcast_to(segment_ids[:1], segment_ids.shape)
    return fused_attention(q, k, v, first, implementation)


def _crashing(*args, **kwargs):
    raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED in the backward")


def test_the_check_gives_every_row_its_own_documents_up_to_the_bound():
    ids = row_documents(4, 64, 5)
    counts = documents_per_row(ids).tolist()
    assert counts == [5, 4, 3, 2] and len({tuple(r) for r in ids}) == 4
    assert documents_per_row(row_documents(2, 3, 9)).tolist() == [3, 2]  # capped at the length


def test_attention_check_passes_ours_and_catches_a_wrong_or_crashing_kernel(monkeypatch):
    shape = {"dtype": jnp.bfloat16, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
             "seq_len": 48, "max_documents": 6}  # fmt: skip
    for name, remat in (("chunked", "dots"), ("xla", "none")):
        report = verify_attention(name, remat=remat, **shape)
        assert report.ok and max(report.errors.values()) < 1e-2, report.summary()
        assert report.summary().startswith("agrees with naive attention")
        assert (
            f"2 rows of 48 tokens, 1 to 6 documents each{', remat dots' * (remat == 'dots')})"
            in report.summary()
        )
    for kernel in (_across_documents, _first_row_documents):
        monkeypatch.setattr(nvfp4_train.model.blocks.attention, "fused_attention", kernel)
        report = verify_attention("xla", **shape)
        assert not report.ok and report.summary().startswith("DISAGREES with naive attention")
        assert report.errors["out"] > 0.1, kernel  # a mask or row error is O(1), not rounding
    monkeypatch.setattr(nvfp4_train.model.blocks.attention, "fused_attention", _crashing)
    report = verify_attention("xla", **shape)
    assert not report.ok and "CUDNN_STATUS_EXECUTION_FAILED" in report.summary()


def _check_report(implementation, ok):
    errors = {"out": 1e-3 if ok else 0.5}
    return attention_check.AttentionReport(implementation, errors, None, "naive", "layout")


def test_a_failed_fused_kernel_gives_way_to_the_next_fused_one_then_the_unfused(monkeypatch):
    monkeypatch.setattr(nvfp4_ops.te_attention, "_import_problem", lambda: None)  # TE "installed"
    passing = set()
    checked = []

    def verify(implementation, **shape):
        checked.append((implementation, shape["seq_len"], shape["max_documents"], shape["remat"]))
        return _check_report(implementation, implementation in passing)

    monkeypatch.setattr(attention_check, "verify_attention", verify)
    model = {"max_seq_len": 512, "attention_max_documents": 7, "remat": "dots"}
    cfg = config_from_dict({"model": model, "train": {"seq_len": 512}})
    said = []
    passing.add("cudnn")
    chosen = _with_trusted_attention(cfg, "gpu", said.append)
    assert chosen.model.attention == "cudnn"
    assert checked == [("te", 512, 7, "dots"), ("cudnn", 512, 7, "dots")]  # the run's shape
    assert "WARNING: attention 'te' is NOT used (it failed its check); checking 'cudnn'" in said[1]
    passing.clear()
    said.clear()
    assert _with_trusted_attention(cfg, "gpu", said.append).model.attention == "naive"
    assert said[-1].startswith("WARNING: attention 'cudnn' is NOT used (it failed its check); "
                               "this run uses 'naive'")  # fmt: skip
    strict = dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision,
                                                                    verify_backend="strict"))  # fmt: skip
    checked.clear()
    with pytest.raises(RunError, match=r"attention 'te' failed its check .*strict"):
        _with_trusted_attention(strict, "gpu", said.append)
    assert [c[0] for c in checked] == ["te"]


def _checked_run_config(tmp_path, tiny_config, **precision):
    return config_from_dict(
        tiny_config(
            tmp_path / "r", model={"attention": "xla"}, precision={"recipe": "bf16", **precision},
            train={"steps": 2, "log_every": 1, "eval_every": 2},
            checkpoint={"every_steps": 2}, logging={"tensorboard": False},
        )
    )  # fmt: skip


def test_a_run_leaves_out_a_kernel_that_fails_its_check_or_stops_if_strict(
    tmp_path, tiny_config, monkeypatch
):
    monkeypatch.setattr(attention_check, "CHECKED", ("xla",))  # as cudnn and te are on a GPU
    monkeypatch.setattr(nvfp4_train.model.blocks.attention, "fused_attention", _across_documents)
    with pytest.raises(RunError, match=r"attention 'xla' failed its check .*strict"):
        run(_checked_run_config(tmp_path / "s", tiny_config, verify_backend="strict"),
            stream=io.StringIO())  # fmt: skip
    out = io.StringIO()
    summary = run(_checked_run_config(tmp_path, tiny_config), stream=out)
    lines = out.getvalue().splitlines()
    assert any(line.startswith("attention check: xla DISAGREES with naive") for line in lines)
    warning = "WARNING: attention 'xla' is NOT used (it failed its check); this run uses 'naive'"
    assert any(line.startswith(warning) for line in lines)
    assert "ops backend: model.attention=naive -> naive" in lines
    assert summary.final_step == 2
    saved = config_from_dict(
        upgraded(yaml.safe_load((summary.run_dir / "config.yaml").read_text()))
    )
    assert saved.model.attention == "xla"  # the run directory keeps what the user asked for


@pytest.mark.parametrize("validation_batches", (0, 1), ids=("training", "validation"))
def test_te_is_bounded_by_documents_per_row_and_every_batch_is_checked(
    tmp_path, tiny_config, monkeypatch, validation_batches
):
    assert documents_per_row(np.array([[0, 0, 1, 2], [4, 4, 4, 5]])).tolist() == [3, 2]
    with pytest.raises(ConfigError, match=r"model\.attention_max_documents must be >= 0"):
        config_from_dict({"model": {"attention_max_documents": -1}})
    corpus = tmp_path / "documents"
    corpus.mkdir()
    for i in range(200):
        (corpus / f"{i:03d}.txt").write_text("x" * (1 + i % 7), encoding="utf-8")
    data = {"source": "text", "path": str(corpus), "validation_batches": validation_batches,
            "validation_fraction": 0.5}  # fmt: skip
    cfg = config_from_dict(tiny_config(tmp_path / "r", data=data))
    monkeypatch.setattr(
        nvfp4_train.training.loop, "document_bound", lambda cfg, platform: 2
    )  # as te
    # validation rows reach te too: they are checked before the first step (a row over the
    # bound would give a wrong validation loss, silently)
    batch = "validation batch 0" if validation_batches else "a batch"
    with pytest.raises(RunError, match=rf"^{batch} row holds \d+ documents, more than model\."
                       r"attention_max_documents=2 that attention 'te' is compiled for"):  # fmt: skip
        run(cfg, stream=io.StringIO())


def test_the_document_bound_is_counted_from_the_data(monkeypatch):
    tokens = np.array([5, 0, 0, 5, 0, 5, 5, 0, 5, 5, 5, 5, 0, 0, 0, 5, 5], np.uint16)
    sequences = PackedSequences(tokens, 0, tokens.size, seq_len=4, vocab_size=6, eos_id=0)
    rows = np.stack([sequences[i]["segment_ids"] for i in range(len(sequences))])
    assert sequences.max_documents_per_row() == documents_per_row(rows).max() == 4
    plain = PackedSequences(tokens, 0, tokens.size, seq_len=4, vocab_size=6)
    assert plain.max_documents_per_row() is None
    said = []
    cfg = config_from_dict({})
    data = SimpleNamespace(max_documents_per_row=lambda: 4)
    assert with_document_bound(cfg, data, said.append) is cfg  # not te here: nothing to bound
    monkeypatch.setattr(nvfp4_train.training.trusted, "run_attention", lambda cfg, p: "te")
    assert with_document_bound(cfg, data, said.append).model.attention_max_documents == 4
    assert said == [
        "attention te: compiled for 4 document(s) per row, the most a row of the data holds "
        "(model.attention_max_documents=0; a smaller bound compiles faster and uses less memory)"
    ]
    none = SimpleNamespace(max_documents_per_row=lambda: None)  # no documents: one per row
    assert with_document_bound(cfg, none, said.append).model.attention_max_documents == 1
    fixed = config_from_dict({"model": {"attention_max_documents": 9}})
    assert with_document_bound(fixed, data, said.append) is fixed
