"""`model.init_from` without transformers: config.json -> `model:` section, weights -> params.

The checkpoints here are written with `safetensors.numpy` under Hugging Face's tensor names; the
parity of the imported model with transformers itself is tested in integration_tests/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import tokenizers

from nvfp4_train.config.run_config import ConfigError, config_from_dict
from nvfp4_train.model.hf.config import HFConfigError, model_section
from nvfp4_train.model.hf.weights import HFImportError, load_hf_params

QWEN3 = {
    "model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "eos_token_id": 3,
    "attention_bias": True, "hidden_act": "silu",
}  # fmt: skip


def hf_tensors(hf: dict, rng: np.random.Generator, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights under HF names for the config `hf` (llama/qwen layouts)."""
    d, f, v = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
    hd, nh, nkv = hf["head_dim"], hf["num_attention_heads"], hf["num_key_value_heads"]
    kind, bias = hf["model_type"], hf.get("attention_bias", False)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (nh * hd, d), p + "self_attn.k_proj.weight": (nkv * hd, d),
            p + "self_attn.v_proj.weight": (nkv * hd, d), p + "self_attn.o_proj.weight": (d, nh * hd),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }  # fmt: skip
        if kind == "qwen2" or (bias and kind in ("llama", "qwen3")):
            for n, rows in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                shapes[p + f"self_attn.{n}_proj.bias"] = (rows,)
        if bias and kind in ("llama", "qwen3"):
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if kind == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}


def write_model(path, hf: dict, tensors: dict[str, np.ndarray], shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    word_level = tokenizers.models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]")
    tokenizers.Tokenizer(word_level).save(str(path / "tokenizer.json"))  # any; nothing tokenizes
    if shards == 1:
        safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
        return path
    names, weight_map = sorted(tensors), {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        safetensors.numpy.save_file(part, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def _load(path, **model):
    import jax

    from nvfp4_train.mesh.sharding import make_mesh, tree_shardings
    from nvfp4_train.training.resume import abstract_state

    cfg = config_from_dict({"model": {"init_from": str(path), **model}})
    _, abstract = abstract_state(cfg)
    shardings = tree_shardings(abstract, abstract.params, make_mesh(cfg.mesh, jax.devices()))
    return cfg, *load_hf_params(path, cfg.model, abstract.params, shardings.params)


def _canonical(cfg, params) -> dict[str, np.ndarray]:
    import jax
    from flax import nnx

    from nvfp4_train.training.step import model_graphdef, model_spec

    layout = nnx.merge(model_graphdef(model_spec(cfg)), params).layout

    flat = jax.tree_util.tree_flatten_with_path(layout.to_canonical(params))[0]
    return {".".join(str(k.key) for k in kp): np.asarray(v) for kp, v in flat}


def _expected(hf: dict, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    out = {"embed.embedding": f32(t["model.embed_tokens.weight"]),
           "final_norm.scale": f32(t["model.norm.weight"])}  # fmt: skip
    if "lm_head.weight" in t and not hf.get("tie_word_embeddings"):
        out["lm_head.kernel"] = f32(t["lm_head.weight"]).T
    for i in range(hf["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        q = f"layers.{i}."
        out[q + "attn_norm.scale"] = f32(t[p + "input_layernorm.weight"])
        out[q + "mlp_norm.scale"] = f32(t[p + "post_attention_layernorm.weight"])
        out[q + "attn.qkv.kernel"] = np.concatenate(
            [f32(t[a + f"{n}_proj.weight"]).T for n in "qkv"], axis=1
        )
        out[q + "attn.o.kernel"] = f32(t[a + "o_proj.weight"]).T
        out[q + "mlp.gate_up.kernel"] = np.concatenate(
            [f32(t[p + "mlp.gate_proj.weight"]).T, f32(t[p + "mlp.up_proj.weight"]).T], axis=1
        )
        out[q + "mlp.down.kernel"] = f32(t[p + "mlp.down_proj.weight"]).T
        if a + "q_proj.bias" in t:
            out[q + "attn.qkv.bias"] = np.concatenate([f32(t[a + f"{n}_proj.bias"]) for n in "qkv"])
        if a + "o_proj.bias" in t:
            out[q + "attn.o.bias"] = f32(t[a + "o_proj.bias"])
        if a + "q_norm.weight" in t:
            out[q + "attn.q_norm.scale"] = f32(t[a + "q_norm.weight"])
            out[q + "attn.k_norm.scale"] = f32(t[a + "k_norm.weight"])
    return out


# ----------------------------------------------------------------------------- config.json


def test_model_section_per_architecture():
    base = {k: QWEN3[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")}  # fmt: skip
    flags = lambda s: (s["qkv_bias"], s["o_bias"], s["qk_norm"])  # noqa: E731
    assert flags(model_section({**base, "model_type": "llama"})) == (False, False, False)
    assert flags(model_section({**base, "model_type": "llama", "attention_bias": True})) == (
        True, True, False,
    )  # fmt: skip
    assert flags(model_section({**base, "model_type": "qwen2"})) == (True, False, False)
    assert flags(model_section({**base, "model_type": "qwen3"})) == (False, False, True)
    assert flags(model_section({**base, "model_type": "qwen3", "attention_bias": True})) == (
        True, True, True,
    )  # fmt: skip
    assert flags(model_section({**base, "model_type": "mistral"})) == (False, False, False)
    section = model_section({**base, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 8192}})  # fmt: skip
    assert section["rope_theta"] == 5e5
    assert section["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert model_section(QWEN3)["rope_theta"] == 1e6  # transformers 5 `rope_parameters`
    assert model_section({**base, "model_type": "llama", "head_dim": None})["head_dim"] == 16


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"quantization_config": {"quant_method": "fp8"}}, "already quantized"),
        ({"vocab_size": None}, "malformed value"),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(change, message):
    hf = {**QWEN3, **change}
    with pytest.raises(HFConfigError, match=message):
        model_section(hf)
    del hf["hidden_size"]
    with pytest.raises(HFConfigError):
        model_section(hf)


def test_sliding_windows_are_honoured_or_refused():
    mistral = {**QWEN3, "model_type": "mistral", "sliding_window": 64, "attention_bias": False}
    assert model_section(mistral)["max_seq_len"] == 64  # full attention within the window
    assert "max_seq_len" not in model_section(mistral, max_seq_len=32)  # the user's 32 stands
    with pytest.raises(HFConfigError, match="sliding window of 64 tokens"):
        model_section(mistral, max_seq_len=128)
    qwen = {**QWEN3, "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"]}
    with pytest.raises(HFConfigError, match="sliding window of 32"):
        model_section(qwen, max_seq_len=64)
    off = {**QWEN3, "sliding_window": 32, "use_sliding_window": False}
    assert model_section(off)["max_seq_len"] == 128
    with pytest.raises(HFConfigError, match="exceeds the checkpoint's max_position_embeddings"):
        model_section(QWEN3, max_seq_len=256)


def test_config_loader_fills_the_model_and_data_sections(tmp_path):
    model_dir = write_model(tmp_path / "m", QWEN3, hf_tensors(QWEN3, np.random.default_rng(0)))
    (model_dir / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 3, "content": "<|im_end|>"}], "model": {"vocab": {}}}))  # fmt: skip
    cfg = config_from_dict({"model": {"init_from": str(model_dir), "dtype": "float32"}})
    assert (cfg.model.architecture, cfg.model.d_model, cfg.model.num_layers) == ("qwen3", 32, 2)
    assert (cfg.model.qkv_bias, cfg.model.o_bias, cfg.model.qk_norm) == (True, True, True)
    assert cfg.model.dtype == "float32" and cfg.model.max_seq_len == 128
    assert cfg.data.tokenizer_path == str(model_dir) and cfg.data.eos_token == "<|im_end|>"
    mine = config_from_dict({"model": {"init_from": str(model_dir)}, "data": {"eos_token": ""}})
    assert mine.data.eos_token == ""
    agree = config_from_dict({"model": {"init_from": str(model_dir), "d_model": 32, "head_dim": 0}})
    assert agree.model == cfg.model.__class__(**{**cfg.model.__dict__, "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match=r"model.d_model=64 but .*config.json gives 32"):
        config_from_dict({"model": {"init_from": str(model_dir), "d_model": 64}})
    with pytest.raises(ConfigError, match=r"model.qk_norm=False but .* gives True"):
        config_from_dict({"model": {"init_from": str(model_dir), "qk_norm": False}})
    with pytest.raises(ConfigError, match="is not a directory"):
        config_from_dict({"model": {"init_from": str(tmp_path / "nowhere")}})
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        config_from_dict({"model": {"init_from": str(tmp_path / "bad")}})


def test_the_continue_from_hf_example_loads_with_a_model(tmp_path):
    from pathlib import Path

    from nvfp4_train.config.run_config import load_config

    hf = {**QWEN3, "max_position_embeddings": 4096}
    model_dir = write_model(tmp_path / "m", hf, hf_tensors(hf, np.random.default_rng(0)))
    example = Path(__file__).resolve().parents[3] / "examples/configs/continue-from-hf.yaml"
    cfg = load_config(example, [f"model.init_from={model_dir}"])
    assert cfg.model.architecture == "qwen3" and cfg.precision.recipe == "nvfp4"
    assert cfg.train.seq_len <= cfg.model.max_seq_len


# ----------------------------------------------------------------------------- weights


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["f32", "bf16"])
def test_weights_land_in_the_fused_layouts(tmp_path, scan, dtype):
    tensors = hf_tensors(QWEN3, np.random.default_rng(1), dtype)
    model_dir = write_model(tmp_path / "m", QWEN3, tensors, shards=1 if scan else 3)
    cfg, params, unused = _load(model_dir, scan_layers=scan)
    assert unused == []
    got, want = _canonical(cfg, params), _expected(QWEN3, tensors)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_tied_checkpoints_and_unused_tensors(tmp_path):
    hf = {**QWEN3, "model_type": "llama", "attention_bias": False, "tie_word_embeddings": True}
    tensors = hf_tensors(hf, np.random.default_rng(2))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()  # tied: ignored
    tensors["model.extra.weight"] = np.ones(3, np.float32)
    cfg, params, unused = _load(write_model(tmp_path / "m", hf, tensors))
    assert cfg.model.tie_embeddings and "lm_head" not in params
    assert unused == ["model.extra.weight"]


def test_bad_weights_are_named(tmp_path):
    rng = np.random.default_rng(3)
    tensors = hf_tensors(QWEN3, rng)
    wrong = dict(
        tensors,
        **{"model.layers.1.mlp.up_proj.weight": rng.normal(size=(40, 32)).astype(np.float32)},
    )
    with pytest.raises(
        HFImportError,
        match=r"'model.layers.1.mlp.up_proj.weight' has shape \(40, 32\), the config implies \(48, 32\)",
    ):
        _load(write_model(tmp_path / "shape", QWEN3, wrong))
    ints = dict(tensors, **{"model.norm.weight": np.ones(32, np.int32)})
    with pytest.raises(HFImportError, match=r"'model.norm.weight' is I32, expected one of"):
        _load(write_model(tmp_path / "int", QWEN3, ints))
    nan = dict(tensors)
    nan["model.layers.0.mlp.down_proj.weight"] = nan["model.layers.0.mlp.down_proj.weight"].copy()
    nan["model.layers.0.mlp.down_proj.weight"][3, 5] = np.nan
    with pytest.raises(HFImportError, match=r"'model.layers.0.mlp.down_proj.weight' holds NaN"):
        _load(write_model(tmp_path / "nan", QWEN3, nan))
    missing = {k: v for k, v in tensors.items() if "k_norm" not in k}
    with pytest.raises(HFImportError, match=r"no tensor 'model.layers.0.self_attn.k_norm.weight'"):
        _load(write_model(tmp_path / "missing", QWEN3, missing))
    sharded = write_model(tmp_path / "sharded", QWEN3, tensors, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(HFImportError, match=r"shards that are missing: \['model-00002-of-00002"):
        _load(sharded)
    truncated = write_model(tmp_path / "truncated", QWEN3, tensors)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(HFImportError, match=r"cannot read .*model.safetensors"):
        _load(truncated)
    pickled = write_model(tmp_path / "pickled", QWEN3, tensors)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(HFImportError, match=r"pickled weights are never loaded"):
        _load(pickled)


def test_weights_are_read_into_the_mesh_sharding(tmp_path):
    """8 fake devices, fsdp=2 x tensor=4: every parameter sharded as the rules say, with the
    checkpoint's values."""
    tensors = hf_tensors(QWEN3 | {"vocab_size": 64}, np.random.default_rng(4))
    model_dir = write_model(tmp_path / "m", QWEN3, tensors)
    script = textwrap.dedent(f"""
        import jax, numpy as np, safetensors.numpy
        from nvfp4_train.config.run_config import config_from_dict
        from nvfp4_train.model.hf.weights import load_hf_params
        from nvfp4_train.training.resume import abstract_state
        from nvfp4_train.mesh.sharding import make_mesh, tree_shardings
        cfg = config_from_dict({{"model": {{"init_from": {str(model_dir)!r}}},
                                "mesh": {{"fsdp": 2, "tensor": 4}}}})
        mesh = make_mesh(cfg.mesh, jax.devices())
        _, abstract = abstract_state(cfg)
        sh = tree_shardings(abstract, abstract.params, mesh)
        params, _ = load_hf_params(cfg.model.init_from, cfg.model, abstract.params, sh.params)
        t = safetensors.numpy.load_file({str(model_dir / "model.safetensors")!r})
        qkv = params["layers"]["1"]["attn"]["qkv"]["kernel"]
        assert qkv.sharding.spec == sh.params["layers"]["1"]["attn"]["qkv"]["kernel"].spec
        assert len({{str(s.index) for s in qkv.addressable_shards}}) == 8, qkv.sharding
        want = np.concatenate([t[f"model.layers.1.self_attn.{{n}}_proj.weight"].T for n in "qkv"], 1)
        np.testing.assert_array_equal(np.asarray(qkv), want)
        emb = params["embed"]["embedding"]
        np.testing.assert_array_equal(np.asarray(emb), t["model.embed_tokens.weight"])
        print("sharded ok", qkv.sharding.spec)
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sharded ok" in done.stdout


def test_the_cli_reports_a_bad_model_directory_in_one_line(tmp_path, capsys):
    from pathlib import Path

    from nvfp4_train.cli import main

    bad = {**QWEN3, "model_type": "gpt_neox"}
    model_dir = write_model(tmp_path / "m", bad, {})
    tiny = Path(__file__).resolve().parents[3] / "examples/configs/tiny.yaml"
    assert main(["show-config", str(tiny), f"model.init_from={model_dir}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: model.init_from: model_type 'gpt_neox' is not supported (supported: "
        "('llama', 'mistral', 'qwen2', 'qwen3', 'qwen3_moe', 'mixtral', 'qwen2_moe', 'nemotron_h'))"
    ]
    hybrid_dir = write_model(tmp_path / "h", {**QWEN3, "model_type": "jamba"}, {})
    assert main(["show-config", str(tiny), f"model.init_from={hybrid_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.init_from: JambaForCausalLM (model_type 'jamba') is not ")
