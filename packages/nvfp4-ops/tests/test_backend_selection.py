"""Which backend runs a call: the "auto" fallback matrix, named backends, capability detection.

TransformerEngine cannot run here, so the host capabilities are replaced by fakes; what is tested
is the selection logic that `dot_general` runs on every call.
"""

from __future__ import annotations

import logging
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nvfp4_ops
from nvfp4_ops import backends, dispatch, probe, te_backend
from nvfp4_ops.backends import Call, select_backend
from nvfp4_ops.recipe import Recipe, TensorQuant, get_recipe

BF16 = np.dtype(jnp.bfloat16)
ALL_AVAILABLE = {name: (True, f"{name} (fake)") for name in nvfp4_ops.BACKENDS}


@pytest.fixture
def host(monkeypatch):
    """Set this host's capabilities, platform and verified backends: host(te=..., gpu=...)."""

    def set_host(
        *, te: bool = True, xla: bool = True, gpu: bool = False, verified=("te", "xla")
    ) -> None:
        caps = dict(ALL_AVAILABLE)
        caps["te"] = (te, "te (fake)" if te else "no sm_100+ GPU (fake)")
        caps["xla"] = (xla, "xla (fake)" if xla else "does not compile (fake)")
        monkeypatch.setattr(backends, "backend_capability", caps.__getitem__)
        order = ("te", "xla", "emulated") if gpu else ("te", "emulated")
        monkeypatch.setattr(backends, "auto_order", lambda: order)
        monkeypatch.setattr(backends, "_VERIFIED", {n: (True, "passed (fake)") for n in verified})
        backends._note.cache_clear()

    return set_host


SR_WEIGHT = Recipe(fprop_weight=TensorQuant("nvfp4", (16, 16), "stochastic"), name="sr-weight")


@pytest.mark.parametrize(
    "call, gpu, expected",
    [
        (Call(get_recipe("nvfp4")), False, "te"),
        (Call(get_recipe("nvfp4-no-sr")), True, "te"),
        (Call(get_recipe("nvfp4-no-2d")), True, "te"),
        (Call(get_recipe("nvfp4").with_bf16_fprop()), False, "emulated"),
        (Call(get_recipe("nvfp4").with_bf16_fprop()), True, "xla"),
        (Call(get_recipe("nvfp4"), batch=4), True, "xla"),
        (Call(get_recipe("nvfp4"), compute_dtype=np.dtype(np.float32)), False, "emulated"),
        (Call(get_recipe("nvfp4"), compute_dtype=np.dtype(np.float16)), True, "xla"),
        (Call(get_recipe("mxfp4")), True, "xla"),
        (Call(get_recipe("fp8")), False, "emulated"),
        (Call(get_recipe("nvfp4-naive")), True, "te"),
        (Call(SR_WEIGHT), True, "xla"),
        (Call(Recipe(hadamard_size=32, name="rht32")), False, "emulated"),
    ],
)
def test_auto_never_gives_a_call_to_a_backend_that_cannot_run_it(host, call, gpu, expected):
    host(gpu=gpu)
    assert select_backend("auto", call) == expected


def test_auto_without_te_or_on_cpu(host):
    host(te=False, gpu=True)
    assert select_backend("auto", Call(get_recipe("nvfp4"))) == "xla"
    host(te=False, xla=False, gpu=True)
    assert select_backend("auto", Call(get_recipe("nvfp4"))) == "emulated"
    host(te=False, gpu=False)
    assert select_backend("auto", Call(get_recipe("nvfp4"))) == "emulated"


def test_a_named_backend_that_cannot_run_the_call_says_why(host):
    host()
    with pytest.raises(ValueError, match=r"backend='te' cannot run this call: .*batch of 2"):
        select_backend("te", Call(get_recipe("nvfp4"), batch=2))
    with pytest.raises(ValueError, match="rounds them stochastically"):
        select_backend("te", Call(SR_WEIGHT))
    with pytest.raises(ValueError, match="take BF16 operands, these compute in float32"):
        select_backend("te", Call(get_recipe("nvfp4"), compute_dtype=np.dtype(np.float32)))
    host(xla=False)
    with pytest.raises(ValueError, match=r"backend='xla' cannot run this call: not available"):
        select_backend("xla", Call(get_recipe("nvfp4")))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        select_backend("cuda", Call(get_recipe("nvfp4")))


def test_an_order_is_tried_left_to_right(host):
    host()
    call = Call(get_recipe("nvfp4"), batch=3)
    assert select_backend(("te", "emulated"), call) == "emulated"
    assert select_backend(("xla", "te"), Call(get_recipe("nvfp4"))) == "xla"
    host(xla=False)
    with pytest.raises(ValueError, match=r"no backend of \('te', 'xla'\) can run this call"):
        select_backend(("te", "xla"), call)


def test_each_fallback_reason_is_logged_once(host, caplog):
    host()
    batched = Call(get_recipe("nvfp4"), batch=2)
    with caplog.at_level(logging.INFO, logger="nvfp4_ops"):
        for _ in range(3):
            select_backend("auto", batched)
        select_backend("auto", Call(get_recipe("nvfp4")))  # te: no fallback, no message
        select_backend("auto", Call(get_recipe("fp8")))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "uses 'emulated'" in messages[0] and "batch of 2" in messages[0]
    assert "every role to NVFP4" in messages[1]
    assert {r.levelno for r in caplog.records} == {logging.INFO}  # expected on a CPU


def test_fallback_on_a_gpu_is_a_warning(host, caplog, monkeypatch):
    host(gpu=True)
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.INFO, logger="nvfp4_ops"):
        select_backend("auto", Call(get_recipe("nvfp4"), batch=2))
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


def test_dot_general_falls_back_per_call(host):
    # TE "available" (fake) but a batched call: auto must not hand it to TE (which would fail
    # to import here), and the result is the emulated one.
    host(gpu=False)
    x = jnp.ones((2, 16, 32), jnp.bfloat16)
    w = jnp.ones((2, 32, 16), jnp.bfloat16)
    dn = (((2,), (1,)), ((0,), (0,)))
    y = nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4-no-sr")
    want = nvfp4_ops.dot_general(x, w, dn, recipe="nvfp4-no-sr", backend="emulated")
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))


class _Device:
    def __init__(self, platform, kind, cc):
        self.platform, self.device_kind, self.compute_capability = platform, kind, cc


def test_capability_detection_survives_rocm_and_odd_devices(monkeypatch):
    devices = [
        _Device("gpu", "AMD Instinct MI300X", "gfx942"),
        _Device("gpu", "NVIDIA H200", "9.0"),
        _Device("gpu", "NVIDIA B200", "10.0"),
        _Device("cpu", "cpu", None),
    ]
    monkeypatch.setattr(backends.jax, "local_devices", lambda: devices)
    assert [backends.compute_capability(d) for d in devices] == [None, (9, 0), (10, 0), None]
    assert backends.blackwell_devices() == ["NVIDIA B200 (sm_100)"]


@pytest.fixture
def fake_te(monkeypatch):
    """A `transformer_engine` module of a chosen version whose NVFP4 check says `supported`."""

    def install(version: str, supported=(True, "")):
        te = types.ModuleType("transformer_engine")
        te.__version__ = version
        quantize = types.SimpleNamespace(
            ScalingMode=types.SimpleNamespace(NVFP4_1D_SCALING="1d", NVFP4_2D_SCALING="2d"),
            is_scaling_mode_supported=lambda mode: supported,
        )
        monkeypatch.setitem(sys.modules, "transformer_engine", te)
        monkeypatch.setattr(te_backend, "_te_quantize", lambda: quantize)

    return install


def test_te_host_support_checks_version_environment_and_te_own_check(fake_te):
    fake_te("2.9.0")
    ok, why = te_backend.te_host_support({})
    assert not ok and "2.9.0 is older than 2.14" in why
    fake_te("2.20.2")
    assert te_backend.te_host_support({}) == (True, "TransformerEngine 2.20.2 runs NVFP4 here")
    ok, why = te_backend.te_host_support({"NVTE_NVFP4_DISABLE_RHT": "1", "PATH": "/bin"})
    assert not ok and "NVTE_NVFP4_DISABLE_RHT=1 would change TE's recipe" in why
    ok, why = te_backend.te_host_support({"NVTE_JAX_CUSTOM_CALLS": "false"})
    assert not ok and "NVTE_JAX_CUSTOM_CALLS=false" in why
    fake_te("2.20.2", (False, "CublasLt version 12.8.0 or higher required for NVFP4 execution."))
    ok, why = te_backend.te_host_support({})
    assert not ok and "CublasLt version 12.8.0" in why


def test_te_alignment_covers_cublas_and_the_rht_kernels():
    assert te_backend.te_alignment(get_recipe("nvfp4")) == (64, 128, 128)
    assert te_backend.te_alignment(get_recipe("nvfp4-no-rht")) == (32, 32, 32)


@pytest.mark.parametrize(
    ("devices", "offered"),
    [
        ([("NVIDIA B200", "10.0")], True),
        ([("NVIDIA GB300", "10.3"), ("NVIDIA GB300", "10.3")], True),
        ([("NVIDIA GeForce RTX 5090", "12.0")], False),
        ([("NVIDIA DGX Spark GB10", "12.1")], False),
        ([("NVIDIA B200", "10.0"), ("NVIDIA RTX PRO 6000", "12.0")], False),
    ],
)
def test_te_is_offered_on_data_center_blackwell_only(fake_te, monkeypatch, devices, offered):
    fake_te("2.20.2")  # TE's own check passes on sm_120 (it asks for compute capability >= 10.0)
    monkeypatch.setattr(backends, "_probe", lambda name: None)  # its real path "runs"
    monkeypatch.setitem(sys.modules, "transformer_engine.jax", types.ModuleType("te_jax"))
    local = [_Device("gpu", kind, cc) for kind, cc in devices]
    monkeypatch.setattr(backends.jax, "local_devices", lambda: local)
    ok, why = backends._te_available()
    assert ok == offered, why
    if not offered:
        assert "sm_100/sm_103 only" in why and "sm_12" in why


def test_auto_takes_a_native_backend_only_once_it_passed_verification(host, caplog):
    host(gpu=True, verified=())
    call = Call(get_recipe("nvfp4"))
    with caplog.at_level(logging.INFO, logger="nvfp4_ops"):
        assert select_backend("auto", call) == "emulated"
    assert "not verified in this process: nvfp4_ops.verify_backend('te')" in caplog.text
    assert select_backend("te", call) == "te"  # named: the caller vouches for it
    assert select_backend(("xla", "emulated"), call) == "xla"  # an order too
    backends.record_verification("xla", True, "agrees (fake)")
    assert select_backend("auto", call) == "xla"
    backends.record_verification("te", False, "crashed while verified: RuntimeError (fake)")
    assert select_backend("auto", call) == "xla"
    backends.record_verification("te", True, "agrees (fake)")
    assert select_backend("auto", call) == "te"
    assert nvfp4_ops.auto_backend()[0] == "te"


def test_auto_on_cpu_asks_nothing_of_xla(monkeypatch):
    asked = []
    capability = backends.backend_capability
    monkeypatch.setattr(backends, "backend_capability", lambda n: asked.append(n) or capability(n))
    monkeypatch.setattr(backends, "auto_order", lambda: ("te", "emulated"))  # what a CPU has
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    nvfp4_ops.dot_general(x, w, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr")
    assert "xla" not in asked and "te" in asked  # the xla probe (a compile) is never paid


@pytest.mark.parametrize("out", [np.float16, np.float64, jnp.float8_e4m3fn])
def test_te_is_not_given_an_output_dtype_it_cannot_write(host, out):
    host(gpu=True)
    call = Call(get_recipe("nvfp4"), out_dtype=np.dtype(out))
    assert select_backend("auto", call) == "xla"
    with pytest.raises(
        ValueError, match=f"writes bfloat16 or float32, this call asks for {np.dtype(out)}"
    ):
        select_backend("te", call)
    for ok in (jnp.bfloat16, np.float32):
        assert select_backend("te", Call(get_recipe("nvfp4"), out_dtype=np.dtype(ok))) == "te"


def test_dot_general_passes_the_output_dtype_to_the_choice(host):
    # TE "available" and verified (fake): an FP16 output must not reach te_dot (TE is not
    # installed here, so reaching it would fail), and the result is the emulated one.
    host()
    x, w = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 16), jnp.bfloat16)
    dn = (((1,), (0,)), ((), ()))
    y = nvfp4_ops.dot_general(x, w, dn, preferred_element_type=jnp.float16, recipe="nvfp4-no-sr")
    want = nvfp4_ops.dot_general(
        x, w, dn, preferred_element_type=jnp.float16, recipe="nvfp4-no-sr", backend="emulated"
    )
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


def test_calls_that_may_span_several_devices_are_kept_off_te(host, caplog):
    host(gpu=True)
    sharded = Call(get_recipe("nvfp4"), devices=8)
    with caplog.at_level(logging.INFO, logger="nvfp4_ops"):
        assert select_backend("auto", sharded) == "xla"
    assert "may span 8 devices and TE under sharding" in caplog.text
    assert select_backend(("te", "emulated"), sharded) == "emulated"
    assert select_backend("te", sharded) == "te"  # named: runs (te_sharding sets TE's mesh)
    assert select_backend("auto", Call(get_recipe("nvfp4"), devices=1)) == "te"


def test_operand_devices_inside_and_outside_a_trace(monkeypatch):
    x = jnp.ones((4, 4))
    assert backends.operand_devices(x, np.ones(3)) == 1
    seen = []
    jax.make_jaxpr(lambda a: seen.append(backends.operand_devices(a, x)) or a)(x)
    assert seen == [jax.device_count()]  # inside jit: any device of the job may hold a shard
    monkeypatch.setattr(backends.jax, "device_count", lambda: 8)
    jax.make_jaxpr(lambda a: seen.append(backends.operand_devices(a)) or a)(x)
    assert seen[-1] == 8


def test_a_native_backend_whose_real_path_fails_is_unavailable(monkeypatch, fake_te):
    def crash(*args, **kwargs):
        raise RuntimeError("no cuDNN engine for this block-scaled dot (fake)")

    monkeypatch.setitem(nvfp4_ops.gemm.GEMMS, "xla", crash)
    dispatch._canonical_dot.clear_cache()  # the probe's xla trace may be cached from the real GEMM
    ok, why = backends._xla_available()
    dispatch._canonical_dot.clear_cache()
    assert not ok and "RuntimeError: no cuDNN engine for this block-scaled dot (fake)" in why
    # TE: every host check passes, then its forward and gradients fail
    fake_te("2.20.2")
    monkeypatch.setitem(sys.modules, "transformer_engine.jax", types.ModuleType("te_jax"))
    monkeypatch.setattr(backends.jax, "local_devices", lambda: [_Device("gpu", "B200", "10.0")])
    monkeypatch.setattr(te_backend, "te_dot", crash)
    ok, why = backends._te_available()
    assert not ok and "TE's forward and gradients fail here: RuntimeError: no cuDNN" in why


def test_the_xla_probe_runs_the_real_path_padded_for_a_gpu(monkeypatch):
    # The padding a GPU gets (platform faked; XLA:CPU still lowers the block-scaled dot), and
    # what reaches the block-scaled dot: E2M1 operands from the uint8 codes, a 16x16 weight
    # reused transposed in Dgrad, every contraction a multiple of 32. Run from inside a trace
    # (where the first dot_general naming "xla" asks for it), it must still run, not fail on a
    # tracer and leave "xla" unavailable for the whole process.
    seen, transposed = [], []
    block_scaled_dot, xla_gemm = nvfp4_ops.gemm._block_scaled_dot, nvfp4_ops.gemm.GEMMS["xla"]

    def recording_dot(a, b, sa, sb):
        seen.append((a.dtype, b.dtype, a.shape[-1]))
        return block_scaled_dot(a, b, sa, sb)

    def recording_gemm(*args, b_transposed=False):
        transposed.append(b_transposed)
        return xla_gemm(*args, b_transposed=b_transposed)

    monkeypatch.setattr(nvfp4_ops.gemm, "_block_scaled_dot", recording_dot)
    monkeypatch.setitem(nvfp4_ops.gemm.GEMMS, "xla", recording_gemm)
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    try:  # asked first inside a trace, as a dot_general under jax.jit asks: it still runs
        jax.make_jaxpr(lambda a: probe.probe_backend("xla") or a)(jnp.ones(2))
    finally:
        dispatch._canonical_dot.clear_cache()
    fp4 = np.dtype(jnp.float4_e2m1fn)
    assert {(a, b) for a, b, _ in seen} == {(fp4, fp4)}
    # (M, K, N) = (24, 40, 8): Fprop contracts K 40 -> 64, Dgrad N 8 -> 32, Wgrad M 24 -> 32
    # (the forward is traced twice: as the primal and as the custom_vjp's forward rule)
    assert {k for *_, k in seen} == {32, 64}
    assert set(transposed) == {False, True}


@pytest.mark.parametrize("k", [16, 48, 80, 112])
def test_contractions_16_mod_32_are_padded_to_what_each_target_takes(k):
    nvfp4, no_rht = get_recipe("nvfp4"), get_recipe("nvfp4-no-rht")
    padded = lambda size, multiple: -(-size // multiple) * multiple  # noqa: E731
    for recipe in (nvfp4, no_rht):
        assert padded(k, dispatch.padding_multiple(recipe, "xla", "gpu")) % 32 == 0
        for axis in te_backend.te_alignment(recipe):
            assert padded(k, axis) % 32 == 0  # TE's GEMM asserts K % 32 on every axis it contracts
        # elsewhere the recipe's own 16 stays: nothing to pad, no extra work on CPU
        assert padded(k, dispatch.padding_multiple(recipe, "xla", "cpu")) == k
        assert padded(k, dispatch.padding_multiple(recipe, "emulated", "gpu")) == k
    assert dispatch.padding_multiple(get_recipe("mxfp4"), "xla", "gpu") == 32


def test_te_sharding_refuses_an_axis_the_mesh_lacks():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    sharding = nvfp4_ops.te_sharding(mesh, data="data", fsdp="model")
    with pytest.raises(ValueError, match=r"\{'fsdp': 'model'\} are not axes of the mesh"):
        sharding.__enter__()


def test_a_prequantized_weight_on_auto_keeps_the_verification_rule(host):
    """`prequantized_dot_general(backend="auto")` moves past "te" (no prequantized path) but,
    like "auto", takes "xla" only once it passed its check (it used to take it unverified)."""
    from nvfp4_ops.prequantized import _backend

    call = Call(get_recipe("nvfp4"))
    host(gpu=True, verified=("te",))
    assert select_backend("auto", call) == "te"
    assert _backend("auto", call) == "emulated"  # xla not verified
    backends.record_verification("xla", False, "disagrees (fake)")
    assert _backend("auto", call) == "emulated"
    backends.record_verification("xla", True, "agrees (fake)")
    assert _backend("auto", call) == "xla"
    assert _backend(("te", "xla"), call) == "xla"  # an order: as given, without "te"
