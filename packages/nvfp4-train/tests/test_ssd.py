"""`ssd_scan` and `causal_conv1d`: equal to a float64 token-by-token recurrence (outputs, final
state and gradients), documents equal to running each document alone, PyTorch's Conv1d and
transformers' `mamba2_chunk_scan` agree, memory grows linearly in L, and the argument errors.

Tolerances: float32 against float64, stated as max |error| / max |reference| per tensor:
outputs and states < 1e-5, gradients < 2e-5 (the backward sums over L and chunks; seen: < 3e-6)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nvfp4_train.model.blocks.causal_conv import causal_conv1d
from nvfp4_train.model.blocks.ssd import ssd_scan

Y_RTOL = 1e-5
GRAD_RTOL = 2e-5
DT_RANGES = ((1e-4, 1e-3), (0.01, 0.1), (0.3, 2.0), (5.0, 20.0))
"""dt of head i in DT_RANGES[i % 4]: from a state that barely decays to one gone each step."""


def _rel_err(actual, expected) -> float:
    expected = np.asarray(expected, np.float64)
    return float(
        np.max(np.abs(np.asarray(actual, np.float64) - expected)) / np.max(np.abs(expected))
    )


def _inputs(seed: int, b: int, l: int, h: int, g: int, p: int = 8, n: int = 16):
    """float32 (x, dt, A, B, C): dt of head i in DT_RANGES[i % 4] (log-uniform), A = -exp(U)."""
    rng = np.random.default_rng(seed)
    lo, hi = np.log(np.array([DT_RANGES[i % 4] for i in range(h)])).T
    dt = np.exp(lo + (hi - lo) * rng.random((b, l, h)))
    a = -np.exp(rng.uniform(-1.0, 1.5, h))
    arrays = (rng.standard_normal((b, l, h, p)), dt, a,
              rng.standard_normal((b, l, g, n)), rng.standard_normal((b, l, g, n)))  # fmt: skip
    return tuple(jnp.asarray(x, jnp.float32) for x in arrays)


def _new_document(segment_ids_BxL) -> np.ndarray:
    seg = np.asarray(segment_ids_BxL)
    return np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)


def reference_scan(x, dt, a, b_, c_, segment_ids=None):
    """float64 NumPy recurrence, token by token: (y [B, L, H, P], final state [B, H, P, N])."""
    x, dt, a, b_, c_ = (np.asarray(v, np.float64) for v in (x, dt, a, b_, c_))
    bsz, l, h, p = x.shape
    rep = h // b_.shape[2]
    b_, c_ = np.repeat(b_, rep, axis=2), np.repeat(c_, rep, axis=2)
    new = np.zeros((bsz, l), bool) if segment_ids is None else _new_document(segment_ids)
    state = np.zeros((bsz, h, p, b_.shape[-1]))
    y = np.zeros_like(x)
    for t in range(l):
        state = np.where(new[:, t, None, None, None], 0.0, state)
        decay = np.exp(dt[:, t] * a)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * b_[:, t, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", state, c_[:, t])
    return y, state


def _reference_loss64(w, x, dt, a, b_, c_):
    """float64 jax recurrence (a plain `lax.scan` over tokens) of sum(y * w), for gradients."""
    rep = x.shape[2] // b_.shape[2]
    b_, c_ = jnp.repeat(b_, rep, axis=2), jnp.repeat(c_, rep, axis=2)

    def step(state, inputs):
        x_t, dt_t, b_t, c_t = inputs
        state = jnp.exp(dt_t * a)[..., None, None] * state + jnp.einsum(
            "bhp,bhn->bhpn", dt_t[..., None] * x_t, b_t
        )
        return state, jnp.einsum("bhpn,bhn->bhp", state, c_t)

    state0 = jnp.zeros((x.shape[0], x.shape[2], x.shape[3], b_.shape[-1]), x.dtype)
    _, y = jax.lax.scan(step, state0, tuple(jnp.moveaxis(v, 1, 0) for v in (x, dt, b_, c_)))
    return jnp.sum(jnp.moveaxis(y, 0, 1) * w)


@pytest.fixture(scope="module")
def scan():
    """`scan(chunk)`: jitted ssd_scan with the final state, segment ids optional."""

    @functools.cache
    def jitted(chunk: int):
        return jax.jit(lambda *args, seg=None: ssd_scan(*args, chunk_size=chunk, segment_ids_BxL=seg,
                                                        return_final_state=True))  # fmt: skip

    return jitted


@pytest.fixture(scope="module")
def scan_grad():
    """`scan_grad(chunk)`: jitted grad of sum(ssd_scan(...) * w) w.r.t. x, dt, A, B, C."""

    @functools.cache
    def jitted(chunk: int):
        def loss(w, x, dt, a, b_, c_, seg):
            return jnp.sum(ssd_scan(x, dt, a, b_, c_, chunk_size=chunk, segment_ids_BxL=seg) * w)

        return jax.jit(jax.grad(loss, argnums=(1, 2, 3, 4, 5)))

    return jitted


CASES = [  # (seed, B, L, H, G, chunk)
    pytest.param(1, 2, 50, 4, 2, 16, id="L50-not-dividing-chunk16-G2"),
    pytest.param(2, 1, 11, 4, 1, 32, id="L11-shorter-than-chunk32"),
    pytest.param(3, 1, 64, 4, 4, 16, id="L64-four-chunks-G4"),
    pytest.param(4, 1, 33, 4, 2, 1, id="chunk1"),
]


@pytest.mark.parametrize(("seed", "b", "l", "h", "g", "chunk"), CASES)
def test_scan_equals_float64_recurrence(scan, seed, b, l, h, g, chunk):
    args = _inputs(seed, b, l, h, g)
    y, final = scan(chunk)(*args)
    y_ref, final_ref = reference_scan(*args)
    assert y.dtype == final.dtype == jnp.float32
    assert y.shape == (b, l, h, 8) and final.shape == (b, h, 8, 16)
    assert _rel_err(y, y_ref) < Y_RTOL
    assert _rel_err(final, final_ref) < Y_RTOL
    for head in range(h):  # each dt range on its own, not hidden by a larger head
        assert _rel_err(y[:, :, head], y_ref[:, :, head]) < Y_RTOL


@pytest.mark.parametrize(("seed", "b", "l", "h", "g", "chunk"), CASES[:2])
def test_gradients_equal_float64_recurrence(scan_grad, seed, b, l, h, g, chunk):
    args = _inputs(seed + 10, b, l, h, g)
    w = jnp.asarray(np.random.default_rng(seed).standard_normal((b, l, h, 8)), jnp.float32)
    grads = scan_grad(chunk)(w, *args, None)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(v), jnp.float64) for v in (w, *args)]
        grads64 = jax.grad(_reference_loss64, argnums=(1, 2, 3, 4, 5))(*args64)
        grads64 = [np.asarray(gr) for gr in grads64]
    for name, got, want in zip(("x", "dt", "A", "B", "C"), grads, grads64, strict=True):
        assert got.dtype == jnp.float32
        assert _rel_err(got, want) < GRAD_RTOL, name


def _packed(lengths_per_row: list[list[int]], ids_per_row: list[list[int]]) -> np.ndarray:
    """int32 [B, L] segment ids: row i holds documents of lengths_per_row[i] with ids_per_row[i]."""
    return np.array([np.repeat(ids, lengths) for lengths, ids in
                     zip(lengths_per_row, ids_per_row, strict=True)], np.int32)  # fmt: skip


DOCUMENTS = (  # chunk 16, L = 45 (padded to 48): boundaries at 5, 16 (a chunk start) and 36; the
    [[5, 11, 20, 9], [16, 29]],  # 20-token document crosses 32; row 1: a boundary at 16 and a
    [[0, 1, 2, 3], [7, 9]],  # document over two chunks and the padding
)


def _document_slices(seg_row: np.ndarray) -> list[slice]:
    starts = np.flatnonzero(_new_document(seg_row[None])[0])
    return [slice(s, e) for s, e in zip(starts, [*starts[1:], len(seg_row)], strict=True)]


def test_documents_equal_each_document_alone(scan):
    args = _inputs(20, 2, 45, 4, 2)
    seg = _packed(*DOCUMENTS)
    y, final = scan(16)(*args, seg=jnp.asarray(seg))
    y_ref, final_ref = reference_scan(*args, segment_ids=seg)
    assert _rel_err(y, y_ref) < Y_RTOL and _rel_err(final, final_ref) < Y_RTOL
    x, dt, a, b_, c_ = (np.asarray(v) for v in args)
    for row in range(2):
        pieces = []
        for sl in _document_slices(seg[row]):
            one = (x[row : row + 1, sl], dt[row : row + 1, sl], a, b_[row : row + 1, sl],
                   c_[row : row + 1, sl])  # fmt: skip
            y_doc, final_doc = reference_scan(*one)
            pieces.append(y_doc[0])
        assert _rel_err(y[row], np.concatenate(pieces)) < Y_RTOL
        assert _rel_err(final[row], final_doc[0]) < Y_RTOL  # the last document's own state


def test_document_gradients_equal_each_document_alone(scan_grad):
    """Packed gradients = those of each document alone: the documents are stacked as rows,
    zero-padded at the end to one length (x = dt = w = 0 there changes no real token's gradient)."""
    args = [np.asarray(v) for v in _inputs(21, 2, 45, 4, 2)]
    seg = _packed(*DOCUMENTS)
    w = np.random.default_rng(21).standard_normal((2, 45, 4, 8)).astype(np.float32)
    grads = scan_grad(16)(jnp.asarray(w), *map(jnp.asarray, args), jnp.asarray(seg))
    docs = [(row, sl) for row in range(2) for sl in _document_slices(seg[row])]

    def stacked(v):  # [documents, 32, ...], each document from its row, zero-padded
        out = np.zeros((len(docs), 32, *v.shape[2:]), v.dtype)
        for i, (row, sl) in enumerate(docs):
            out[i, : sl.stop - sl.start] = v[row, sl]
        return jnp.asarray(out)

    x, dt, a, b_, c_ = args
    alone = scan_grad(16)(stacked(w), stacked(x), stacked(dt), jnp.asarray(a), stacked(b_),
                          stacked(c_), None)  # fmt: skip
    for name, got, want in zip(("x", "dt", "A", "B", "C"), grads, alone, strict=True):
        if name == "A":  # shared by every document
            assert _rel_err(got, want) < Y_RTOL, name
            continue
        for i, (row, sl) in enumerate(docs):
            assert _rel_err(got[row, sl], want[i, : sl.stop - sl.start]) < Y_RTOL, (name, row, sl)


def test_any_change_of_id_starts_a_document(scan):
    """Ids need not increase: [0, 0, 1, 1, 0, 0] is three documents, the last one alone."""
    args = _inputs(22, 1, 6, 2, 1)
    y, _ = scan(4)(*args, seg=jnp.asarray([[0, 0, 1, 1, 0, 0]]))
    tail = reference_scan(*(v[:, 4:] if v.ndim > 1 else v for v in args))[0]
    assert _rel_err(y[:, 4:], tail) < Y_RTOL


def test_checkpoint_and_input_dtypes(scan_grad):
    args = _inputs(23, 1, 40, 4, 2)
    w = jnp.ones((1, 40, 4, 8), jnp.float32)

    def loss(x, dt, a, b_, c_):
        return jnp.sum(
            jax.checkpoint(functools.partial(ssd_scan, chunk_size=16))(x, dt, a, b_, c_) * w
        )

    remat = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args)
    plain = scan_grad(16)(w, *args, None)
    for got, want in zip(remat, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    y16 = jax.eval_shape(functools.partial(ssd_scan, chunk_size=16),
                         *(v.astype(jnp.bfloat16) for v in args))  # fmt: skip
    assert y16.dtype == jnp.float32


def test_memory_grows_linearly_with_length():
    """XLA's temporary memory of the jitted forward + backward: O(L x chunk), not O(L^2)."""

    def temp_bytes(length: int) -> int:
        x, dt, a, b_, c_ = _inputs(24, 1, length, 2, 1, p=16, n=16)
        grad = jax.grad(lambda *v: jnp.sum(ssd_scan(*v, chunk_size=64)), argnums=(0, 1, 3, 4))
        return jax.jit(grad).lower(x, dt, a, b_, c_).compile().memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(1024), temp_bytes(2048)
    assert long < 2.5 * short, (short, long)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"chunk_size": 0}, "chunk_size must be an int >= 1"),
        ({"A_H": jnp.ones(3)}, "A_H must have shape"),
        ({"dt_BxLxH": jnp.ones((1, 4, 3))}, "dt_BxLxH must have shape"),
        ({"B_BxLxGxN": jnp.ones((1, 5, 3, 2)), "C_BxLxGxN": jnp.ones((1, 5, 3, 2))}, "G=3"),
        ({"C_BxLxGxN": jnp.ones((1, 5, 2, 3))}, "C_BxLxGxN must match"),
        ({"segment_ids_BxL": jnp.ones((1, 4), jnp.int32)}, "segment_ids_BxL must have shape"),
        ({"x_BxLxHxP": jnp.ones((5, 4, 8))}, "x_BxLxHxP must be"),
    ],
)
def test_scan_argument_errors(change, message):
    kwargs = {"x_BxLxHxP": jnp.ones((1, 5, 4, 8)), "dt_BxLxH": jnp.ones((1, 5, 4)),
              "A_H": -jnp.ones(4), "B_BxLxGxN": jnp.ones((1, 5, 2, 2)),
              "C_BxLxGxN": jnp.ones((1, 5, 2, 2)), **change}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        ssd_scan(**kwargs)


def reference_conv(x_LxC, kernel_KxC) -> np.ndarray:
    """float64 NumPy: out[t] = sum_k kernel[k] x[t - (K-1) + k], x = 0 before the start."""
    k = kernel_KxC.shape[0]
    x = np.pad(np.asarray(x_LxC, np.float64), ((k - 1, 0), (0, 0)))
    return sum(np.asarray(kernel_KxC[j], np.float64) * x[j : j + len(x_LxC)] for j in range(k))


@pytest.mark.parametrize(("k", "l"), [(4, 13), (1, 7), (4, 2), (3, 9)])
def test_causal_conv_equals_torch_conv1d(k, l):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(k * 100 + l)
    x = rng.standard_normal((2, l, 6)).astype(np.float32)
    kernel = rng.standard_normal((k, 6)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    conv = torch.nn.Conv1d(6, 6, k, groups=6, padding=k - 1)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(kernel.T[:, None, :]))  # weight[c, 0, k] = kernel[k, c]
        conv.bias.copy_(torch.from_numpy(bias))
        want = conv(torch.from_numpy(x).transpose(1, 2))[..., :l].transpose(1, 2).numpy()
    got = causal_conv1d(jnp.asarray(x), jnp.asarray(kernel), jnp.asarray(bias))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], reference_conv(x[1], kernel) + bias, rtol=1e-6, atol=1e-6)


def test_causal_conv_restarts_at_each_document():
    rng = np.random.default_rng(30)
    x = jnp.asarray(rng.standard_normal((2, 12, 5)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    seg = np.array([[0] * 2 + [1] * 6 + [2] * 1 + [3] * 3, [4] * 5 + [2] * 4 + [4] * 3], np.int32)
    got = causal_conv1d(x, kernel, segment_ids_BxL=jnp.asarray(seg))
    for row in range(2):
        want = np.concatenate(
            [reference_conv(x[row, sl], kernel) for sl in _document_slices(seg[row])]
        )
        np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((jnp.ones((1, 4)), jnp.ones((4, 3))), "x_BxLxC must be"),
        ((jnp.ones((1, 4, 3)), jnp.ones((0, 3))), "K >= 1"),
        ((jnp.ones((1, 4, 3)), jnp.ones((4, 2))), "kernel_KxC must be"),
        ((jnp.ones((1, 4, 3)), jnp.ones((4, 3)), jnp.ones(2)), "bias_C must have shape"),
    ],
)
def test_causal_conv_argument_errors(args, message):
    with pytest.raises(ValueError, match=message):
        causal_conv1d(*args)


def test_scan_equals_transformers_mamba2_chunk_scan(scan):
    torch = pytest.importorskip("torch")
    nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    rng = np.random.default_rng(40)
    b, l, h, g, p, n = 2, 100, 4, 2, 8, 16
    x, b_, c_ = (rng.standard_normal(s).astype(np.float32)
                 for s in ((b, l, h, p), (b, l, g, n), (b, l, g, n)))  # fmt: skip
    dt_raw = rng.standard_normal((b, l, h)).astype(np.float32)
    dt_bias = rng.uniform(-4.0, 1.0, h).astype(np.float32)
    a = -np.exp(rng.uniform(0.0, np.log(16.0), h)).astype(np.float32)
    t = {k: torch.from_numpy(v) for k, v in
         {"x": x, "dt": dt_raw, "A": a, "B": b_, "C": c_, "bias": dt_bias}.items()}  # fmt: skip
    want, want_final = nemotron_h.mamba2_chunk_scan(
        t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=32, dt_bias=t["bias"],
        dt_softplus=True, return_final_states=True,
    )  # fmt: skip
    dt = torch.nn.functional.softplus(t["dt"] + t["bias"]).numpy()
    y, final = scan(32)(*(jnp.asarray(v) for v in (x, dt, a, b_, c_)))
    assert _rel_err(y, want.numpy()) < Y_RTOL
    assert _rel_err(final, want_final.numpy()) < Y_RTOL
