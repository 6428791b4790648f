"""An ONNX decoder graph whose FP4 weights stay packed 4-bit next to their scales.

Default form (portable, opset 18, IR 8; every onnxruntime runs it on CPU): per quantized module the
initializers are the packed uint8 codes [out, in/2], the block-scale BYTES uint8 [out, in/16]
(E4M3 or E8M0 bit patterns) and the float32 global decode scale; a subgraph decodes them:
BitwiseAnd(0x0F) / BitShift(RIGHT, 4) -> interleave (even index = low nibble) -> Gather from the
16-entry E2M1 table -> times Gather(256-entry scale table)[scale byte] -> times the global scale,
which is bit-identical to `nvfp4_format.dequantize`. "dq" form (opset 23, IR 11; TensorRT):
FLOAT4E2M1 initializers through DequantizeLinear(block_size=16), the FP8 block scales through a
first DequantizeLinear with the global scale (onnxruntime's CPU provider cannot run it).
Compute is float32 and weight-only (activations are not quantized in the graph).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

import nvfp4_format
from nvfp4_export.dense_names import EMBED, FINAL_NORM, LM_HEAD, layer_tensor
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.formats import BF16, FORMATS
from nvfp4_export.model_spec import LlamaSpec

FORMS = {"portable": (18, 8), "dq": (23, 11)}
"""form -> (opset, ir_version): onnxruntime needs the IR version that matches the opset."""


class _Graph:
    """Accumulates nodes and initializers with unique names."""

    def __init__(self, onnx_mod):
        self.onnx, self.h = onnx_mod, onnx_mod.helper
        self.nodes, self.inits, self.count = [], [], 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, hint: str, array: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str = "t", **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(self.h.make_node(op_type, inputs, [out], **attrs))
        return out


def _decode_codes(g: _Graph, packed: str, out_rows: int, in_cols: int) -> str:
    lo = g.op("BitwiseAnd", [packed, g.const("nib", np.array(15, np.uint8))])
    hi = g.op("BitShift", [packed, g.const("four", np.array(4, np.uint8))], direction="RIGHT")
    axis = g.const("axis", np.array([-1], np.int64))
    pair = g.op("Concat", [g.op("Unsqueeze", [lo, axis]), g.op("Unsqueeze", [hi, axis])], axis=-1)
    codes = g.op("Reshape", [pair, g.const("shape", np.array([out_rows, in_cols], np.int64))])
    idx = g.op("Cast", [codes], to=g.onnx.TensorProto.INT64)
    return g.op("Gather", [g.const("e2m1", nvfp4_format.E2M1_VALUES.astype(np.float32)), idx])


def _portable_weight(g: _Graph, m: ExportedLinear) -> str:
    """float32 [out, in] from the packed module (bit-identical to the format's dequantize)."""
    f = FORMATS[m.fmt]
    out_rows, in_cols = m.shape
    block = f.block_size
    values = _decode_codes(g, g.const(m.name + ".packed", m.packed), out_rows, in_cols)
    scale_bytes = g.const(m.name + ".scale_bytes", np.asarray(m.scales).view(np.uint8))
    table = f.scale_values()
    scales = g.op("Gather", [g.const("scale_lut", table), g.op("Cast", [scale_bytes], to=7)])
    blocks = g.op("Reshape", [values, g.const("shape", np.array([out_rows, -1, block], np.int64))])
    scaled = g.op(
        "Mul", [blocks, g.op("Unsqueeze", [scales, g.const("ax", np.array([-1], np.int64))])]
    )
    if f.global_scale:
        scaled = g.op(
            "Mul", [scaled, g.const(m.name + ".global", np.float32(m.global_decode_scale))]
        )
    return g.op("Reshape", [scaled, g.const("shape", np.array([out_rows, in_cols], np.int64))])


def _dq_weight(g: _Graph, m: ExportedLinear) -> str:
    """float32 [out, in] through DequantizeLinear(FLOAT4E2M1, block_size=16) (opset 23)."""
    onnx = g.onnx
    out_rows, in_cols = m.shape
    fp4 = onnx.helper.make_tensor(
        g.name(m.name + ".fp4"), onnx.TensorProto.FLOAT4E2M1, [out_rows, in_cols],
        vals=np.asarray(m.packed).tobytes(), raw=True,
    )  # fmt: skip
    fp8 = onnx.helper.make_tensor(
        g.name(m.name + ".scale_fp8"), onnx.TensorProto.FLOAT8E4M3FN, list(m.scales.shape),
        vals=np.asarray(m.scales).view(np.uint8).tobytes(), raw=True,
    )  # fmt: skip
    g.inits += [fp4, fp8]
    scale = g.op(
        "DequantizeLinear", [fp8.name, g.const("global", np.float32(m.global_decode_scale))]
    )
    return g.op("DequantizeLinear", [fp4.name, scale], axis=1, block_size=FORMATS[m.fmt].block_size)


def _weight_t(g: _Graph, m: ExportedLinear, form: str) -> str:
    """W^T [in, out] float32 for MatMul."""
    if m.fmt == BF16:
        w = _bf16_const(g, m.name + ".bf16", m.weight)
    elif form == "dq" and FORMATS[m.fmt].onnx_dq:
        w = _dq_weight(g, m)
    else:
        w = _portable_weight(g, m)
    return g.op("Transpose", [w], perm=[1, 0])


def _rms_norm(g: _Graph, x: str, weight: np.ndarray, eps: float) -> str:
    axes = g.const("axes", np.array([-1], np.int64))
    ms = g.op("ReduceMean", [g.op("Mul", [x, x]), axes], keepdims=1)
    inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [ms, g.const("eps", np.float32(eps))])])])
    return g.op("Mul", [g.op("Mul", [x, inv]), g.const("norm", weight.astype(np.float32))])


def _rope(g: _Graph, x: str, cos: str, sin: str, half: int) -> str:
    x1, x2 = g.name("x1"), g.name("x2")
    split = g.const("split", np.array([half, half], np.int64))
    g.nodes.append(g.h.make_node("Split", [x, split], [x1, x2], axis=-1))
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin])])


def _bf16_const(g: _Graph, hint: str, array: np.ndarray) -> str:
    """A BF16 initializer (kept 2 bytes/element) cast to float32 in the graph."""
    name = g.name(hint)
    bits = np.ascontiguousarray(np.asarray(array).astype(ml_dtypes.bfloat16)).view(np.uint16)
    g.inits.append(
        g.h.make_tensor(
            name, g.onnx.TensorProto.BFLOAT16, list(bits.shape), bits.tobytes(), raw=True
        )
    )
    return g.op("Cast", [name], to=g.onnx.TensorProto.FLOAT)


def _attention(g: _Graph, spec: LlamaSpec, q: str, k: str, v: str, mask: str) -> str:
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    q5 = g.op("Reshape", [q, g.const("shape", np.array([0, 0, nkv, nh // nkv, hd], np.int64))])
    scores = g.op("Einsum", [q5, k], equation="blgrk,bsgk->bgrls")
    scores = g.op("Mul", [scores, g.const("inv_sqrt_d", np.float32(1.0) / np.sqrt(np.float32(hd)))])
    lowest = g.const("lowest", np.float32(np.finfo(np.float32).min))
    probs = g.op("Softmax", [g.op("Where", [mask, scores, lowest])], axis=-1)
    out = g.op("Einsum", [probs, v], equation="bgrls,bsgk->blgrk")
    return g.op("Reshape", [out, g.const("shape", np.array([0, 0, nh * hd], np.int64))])


def _linear(g: _Graph, x: str, m: ExportedLinear, form: str, dense=None) -> str:
    y = g.op("MatMul", [x, _weight_t(g, m, form)], hint=m.name.replace(".", "_"))
    bias = None if dense is None else dense.get(m.name + ".bias")
    if bias is None:
        return y
    return g.op("Add", [y, g.const(m.name.replace(".", "_") + "_bias", bias.astype(np.float32))])


def _block(g, spec, i, x, mods, dense, tables, form):
    cos, sin, mask = tables
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def norm(t, key):
        return _rms_norm(g, t, dense[layer_tensor(key, i).hf_name], spec.rms_norm_eps)

    h = norm(x, "attn_norm")
    p = f"model.layers.{i}."
    heads = lambda t, n: g.op("Reshape", [t, g.const("shape", np.array([0, 0, n, hd], np.int64))])  # noqa: E731
    q = heads(_linear(g, h, mods[p + "self_attn.q_proj"], form, dense), nh)
    k = heads(_linear(g, h, mods[p + "self_attn.k_proj"], form, dense), nkv)
    if spec.qk_norm:
        q, k = norm(q, "q_norm"), norm(k, "k_norm")
    q, k = _rope(g, q, cos, sin, hd // 2), _rope(g, k, cos, sin, hd // 2)
    v = heads(_linear(g, h, mods[p + "self_attn.v_proj"], form, dense), nkv)
    att = _attention(g, spec, q, k, v, mask)
    x = g.op("Add", [x, _linear(g, att, mods[p + "self_attn.o_proj"], form, dense)])
    h = norm(x, "mlp_norm")
    gate = _linear(g, h, mods[p + "mlp.gate_proj"], form)
    up = _linear(g, h, mods[p + "mlp.up_proj"], form)
    hidden = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
    return g.op("Add", [x, _linear(g, hidden, mods[p + "mlp.down_proj"], form)])


def _tables(g: _Graph, spec: LlamaSpec, ids: str):
    inv_freq = spec.rope_inv_freq()
    freqs = np.arange(spec.max_seq_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    length = g.op(
        "Slice", [g.op("Shape", [ids]), *[g.const("i", np.array([v], np.int64)) for v in (1, 2)]]
    )
    zero = g.const("zero", np.array([0], np.int64))

    def sliced(t):
        return g.op(
            "Unsqueeze",
            [g.op("Slice", [t, zero, length, zero]), g.const("ax", np.array([1], np.int64))],
        )  # noqa: E731

    cos = sliced(g.const("rope_cos", np.cos(emb).astype(np.float32)))
    sin = sliced(g.const("rope_sin", np.sin(emb).astype(np.float32)))
    causal = np.tril(np.ones((spec.max_seq_len, spec.max_seq_len), dtype=bool))
    both = g.const("axes01", np.array([0, 1], np.int64))
    zeros = g.const("zeros", np.array([0, 0], np.int64))
    ends = g.op("Concat", [length, length], axis=0)
    mask = g.op("Slice", [g.const("causal", causal), zeros, ends, both])
    return cos, sin, mask


def build_onnx(
    spec: LlamaSpec,
    linears: list[ExportedLinear],
    dense: dict[str, np.ndarray],
    form: str = "portable",
):
    """An `onnx.ModelProto`: input `input_ids` int64 [batch, seq], output `logits` f32 [batch, seq, V].

    Args:
        spec: the decoder.
        linears: every HF linear module (`linears.export_linear` output).
        dense: BF16 tensors under their HF names (embeddings, norms, lm_head).
        form: "portable" (opset 18, runs on onnxruntime CPU) or "dq" (opset 23 DequantizeLinear).
    """
    import onnx

    if form not in FORMS:
        raise ValueError(f"form must be one of {sorted(FORMS)}, got {form!r}")
    opset, ir_version = FORMS[form]
    g = _Graph(onnx)
    mods = {m.name: m for m in linears}
    tables = _tables(g, spec, "input_ids")
    embed = _bf16_const(g, "embed", dense[EMBED.hf_name])
    x = g.op("Gather", [embed, "input_ids"])
    for i in range(spec.num_layers):
        x = _block(g, spec, i, x, mods, dense, tables, form)
    x = _rms_norm(g, x, dense[FINAL_NORM.hf_name], spec.rms_norm_eps)
    head = dense[(LM_HEAD if spec.has(LM_HEAD) else EMBED).hf_name]
    head_t = g.op("Transpose", [_bf16_const(g, "lm_head", head)], perm=[1, 0])
    g.nodes.append(g.h.make_node("MatMul", [x, head_t], ["logits"]))
    graph = g.h.make_graph(
        g.nodes, "nvfp4_llama",
        [g.h.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["batch", "seq"])],
        [g.h.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", "seq", spec.vocab_size])],
        initializer=g.inits,
    )  # fmt: skip
    model = g.h.make_model(graph, opset_imports=[g.h.make_opsetid("", opset)])
    model.ir_version = ir_version
    model.producer_name = "nvfp4-export"
    return model


def save_onnx(model, path: Path) -> None:
    """Writes `model` (one file; initializers inline), checked by `onnx.checker` first."""
    import onnx

    onnx.checker.check_model(model)
    onnx.save_model(model, str(path))
