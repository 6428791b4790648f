"""The Mamba-2 mixer's numerics: the chunked SSD scan against a float64 token-by-token recurrence
(outputs, final state, every gradient), for lengths that do not divide the chunk, several groups
and heads of very different dt; packed documents equal to each document alone; linear memory;
the causal conv with its document restart; and both against PyTorch / transformers' own path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_train.model.blocks.causal_conv import causal_conv1d
from nvfp4_train.model.blocks.ssd import ssd_scan


def recurrence_f64(x, dt, a, b, c, segment_ids=None):
    """The definition, token by token in float64 NumPy: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t,
    y_t = h_t C_t, the state zeroed where a new document starts. Returns (y, final state)."""
    x, dt, a, b, c = (np.asarray(t, np.float64) for t in (x, dt, a, b, c))
    bsz, length, heads, p = x.shape
    groups, n = b.shape[2:]
    group = np.arange(heads) // (heads // groups)
    y = np.zeros_like(x)
    h = np.zeros((bsz, heads, p, n))
    for t in range(length):
        if segment_ids is not None and t > 0:
            h *= (np.asarray(segment_ids)[:, t] == np.asarray(segment_ids)[:, t - 1])[
                :, None, None, None
            ]
        decay = np.exp(dt[:, t] * a)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, group][:, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", h, c[:, t, group])
    return y, h


def recurrence_jax(x, dt, a, b, c):
    """The same recurrence as a `jax.lax.scan` over tokens (run in float64 for reference
    gradients)."""
    rep = x.shape[2] // b.shape[2]
    bh, ch = jnp.repeat(b, rep, axis=2), jnp.repeat(c, rep, axis=2)

    def step(h, inputs):
        xt, dtt, bt, ct = inputs
        h = (
            jnp.exp(dtt * a)[..., None, None] * h
            + (dtt[..., None] * xt)[..., None] * bt[:, :, None]
        )
        return h, jnp.einsum("bhpn,bhn->bhp", h, ct)

    h0 = jnp.zeros((x.shape[0], x.shape[2], x.shape[3], b.shape[3]), x.dtype)
    _, ys = jax.lax.scan(step, h0, tuple(jnp.moveaxis(t, 1, 0) for t in (x, dt, bh, ch)))
    return jnp.moveaxis(ys, 0, 1)


def inputs(seed: int, bsz=2, length=37, heads=4, p=3, groups=2, n=5):
    """Fresh random inputs; head 0 with tiny dt, head 3 with dt large enough that exp(dt A) ~ 0."""
    k = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(k[0], (bsz, length, heads, p))
    dt = jnp.exp(jax.random.normal(k[1], (bsz, length, heads)) - 1.0)
    dt = dt * jnp.array([1e-3, 1.0, 0.3, 30.0])[:heads]
    a = -jnp.exp(jax.random.normal(k[2], (heads,)))
    b = jax.random.normal(k[3], (bsz, length, groups, n))
    c = jax.random.normal(k[4], (bsz, length, groups, n))
    return x, dt, a, b, c


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("length, chunk", [(37, 8), (5, 16), (32, 8), (37, 1), (37, 64)])
def test_chunked_scan_equals_the_float64_recurrence(length, chunk):
    args = inputs(length, length=length)
    y, state = ssd_scan(*args, chunk_size=chunk, return_final_state=True)
    want_y, want_state = recurrence_f64(*args)
    assert y.dtype == jnp.float32 and y.shape == args[0].shape
    assert _rel(y, want_y) < 2e-6
    assert _rel(state, want_state) < 2e-6


def test_gradients_equal_the_float64_recurrence():
    args = inputs(7, length=21)
    w = jax.random.normal(jax.random.key(9), args[0].shape)

    def loss(fn, *a):
        return jnp.sum(fn(*a) * w.astype(a[0].dtype))

    got = jax.grad(lambda *a: loss(lambda *t: ssd_scan(*t, chunk_size=8), *a), range(5))(*args)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(t), jnp.float64) for t in args]
        want = jax.grad(lambda *a: loss(recurrence_jax, *a), range(5))(*args64)
        want = [np.asarray(t) for t in want]
    for name, g, r in zip(("x", "dt", "A", "B", "C"), got, want, strict=True):
        assert _rel(g, r) < 1e-5, name


DOCUMENTS = np.repeat([1, 2, 3, 4], [9, 8, 1, 19])  # 37 tokens; chunk 8: 2 starts at 9 ... 3 at 17
CHUNK_START = np.repeat([1, 2], [16, 21])  # a document starting exactly at a chunk boundary


def _piece(args, start: int, stop: int) -> tuple:
    """The inputs of tokens [start, stop) (A has no token axis)."""
    x, dt, a, b, c = args
    return x[:, start:stop], dt[:, start:stop], a, b[:, start:stop], c[:, start:stop]


@pytest.mark.parametrize("segments", [DOCUMENTS, CHUNK_START], ids=["inside", "at-boundary"])
def test_packed_documents_equal_each_document_alone(segments):
    args = inputs(3)
    seg = jnp.asarray(np.broadcast_to(segments, (2, 37)), jnp.int32)
    y, state = ssd_scan(*args, chunk_size=8, segment_ids_BxL=seg, return_final_state=True)
    starts = np.flatnonzero(np.diff(np.r_[-1, segments]))
    ends = np.r_[starts[1:], 37]
    pieces = [
        ssd_scan(*_piece(args, s, e), chunk_size=8, return_final_state=True)
        for s, e in zip(starts, ends, strict=True)
    ]
    np.testing.assert_allclose(y, jnp.concatenate([p[0] for p in pieces], 1), atol=2e-6, rtol=0)
    np.testing.assert_allclose(state, pieces[-1][1], atol=2e-6, rtol=0)
    assert _rel(y, recurrence_f64(*args, segment_ids=seg)[0]) < 2e-6

    def alone(*a):
        return sum(
            jnp.sum(ssd_scan(*_piece(a, s, e), chunk_size=8) ** 2)
            for s, e in zip(starts, ends, strict=True)
        )

    packed = jax.grad(lambda *a: jnp.sum(ssd_scan(*a, chunk_size=8, segment_ids_BxL=seg) ** 2),
                      range(5))(*args)  # fmt: skip
    for g, r in zip(packed, jax.grad(alone, range(5))(*args), strict=True):
        assert _rel(g, r) < 1e-5


def test_memory_grows_linearly_in_length():
    def temp_bytes(length: int) -> int:
        args = inputs(0, bsz=1, length=length, heads=2, p=16, groups=1, n=16)
        grad = jax.jit(jax.grad(lambda x, *r: jnp.sum(ssd_scan(x, *r, chunk_size=64))))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(4096)
    assert large < 4.5 * small  # 4x the tokens; an L x L buffer would be 16x


def test_bad_arguments_are_named():
    x, dt, a, b, c = inputs(0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        ssd_scan(x, dt, a, b, c, chunk_size=0)
    with pytest.raises(ValueError, match="multiple of the B/C groups=3"):
        ssd_scan(x, dt, a, b[:, :, :1].repeat(3, 2), c[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="kernel_KxC must be"):
        causal_conv1d(jnp.ones((1, 4, 3)), jnp.ones((0, 3)))


def conv_reference(x, kernel, bias, segments=None):
    """out[t] = bias + sum_k kernel[k] x[t - (K-1) + k] in float64, x from before t's document
    (or before the row) zero."""
    x, kernel = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
    width, out = kernel.shape[0], np.zeros_like(x) + np.asarray(bias, np.float64)
    for t in range(x.shape[1]):
        for k in range(width):
            s = t - (width - 1) + k
            if s < 0:
                continue
            same = 1.0 if segments is None else (segments[:, s] == segments[:, t])[:, None]
            out[:, t] += kernel[k] * x[:, s] * same
    return out


def test_causal_conv_and_its_document_restart():
    k = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k[0], (2, 37, 6))
    kernel, bias = jax.random.normal(k[1], (4, 6)), jax.random.normal(k[2], (6,))
    np.testing.assert_allclose(causal_conv1d(x, kernel, bias), conv_reference(x, kernel, bias),
                               atol=1e-5)  # fmt: skip
    seg = np.broadcast_to(DOCUMENTS, (2, 37))
    got = causal_conv1d(x, kernel, bias, segment_ids_BxL=jnp.asarray(seg))
    np.testing.assert_allclose(got, conv_reference(x, kernel, bias, seg), atol=1e-5)


def test_against_pytorch_and_transformers():
    torch = pytest.importorskip("torch")
    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x, dt, a, b, c = inputs(5)
    t = {
        name: torch.from_numpy(np.asarray(v))
        for name, v in zip(["x", "dt", "a", "b", "c"], (x, dt, a, b, c), strict=True)
    }
    want = nemotron.mamba2_chunk_scan(t["x"], t["dt"], t["a"], t["b"], t["c"], chunk_size=8)
    assert _rel(ssd_scan(x, dt, a, b, c, chunk_size=8), want.numpy()) < 2e-6
    xc = jax.random.normal(jax.random.key(6), (2, 37, 6))
    kernel, bias = (
        jax.random.normal(jax.random.key(7), (4, 6)),
        jax.random.normal(jax.random.key(8), (6,)),
    )
    conv = torch.nn.Conv1d(6, 6, 4, groups=6, padding=3)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(np.asarray(kernel).T[:, None, :]))
        conv.bias.copy_(torch.from_numpy(np.asarray(bias)))
        want_conv = conv(torch.from_numpy(np.asarray(xc)).transpose(1, 2))[..., :37].transpose(1, 2)
    np.testing.assert_allclose(causal_conv1d(xc, kernel, bias), want_conv.numpy(), atol=1e-5)
