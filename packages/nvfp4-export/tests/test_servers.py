"""Export refuses what a target server would not serve as trained, and what no class can hold.

The loaders' rules themselves are checked against the exports in test_serving_rules.py; here the
export's own decisions: the architecture check repeated from training, the servers an export is
for (`--server`), a dropped tensor (refused, or a warning with `--allow-dropped-tensors`), and a
layout or mode a named server does not load.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import SMALL_MODEL, model_config, random_params, write_run

from nvfp4_export import SERVERS, ExportError, export_hf, spec_from_config
from nvfp4_export.cli import main

VLLM_DROPS = r"vllm builds qwen3 without self_attn\.o_proj\.bias .*qwen3\.py"


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


@pytest.mark.parametrize(
    "options",
    [
        {"architecture": "mistral", "qkv_bias": True},  # MistralAttention has no biases
        {"architecture": "qwen2"},  # Qwen2 always has q/k/v biases
        {"architecture": "qwen2", "qkv_bias": True, "o_bias": True},  # and never an o_proj bias
        {"architecture": "qwen3"},  # Qwen3 always has q/k norms
        {"architecture": "llama", "qk_norm": True},  # which no other class has
        {"architecture": "llama", "qkv_bias": True},  # attention_bias is both biases or neither
    ],
)
def test_an_architecture_that_cannot_hold_the_checkpoint_is_refused(options):
    model = model_config(**SMALL_MODEL, **options)
    params = _flat(random_params(model))
    name = options["architecture"]
    with pytest.raises(ExportError, match=rf"model\.architecture='{name}' .* but the checkpoint"):
        spec_from_config({"model": model}, params)


def test_a_hand_edited_run_config_does_not_export(tmp_path):
    run = write_run(tmp_path / "run", model=model_config(**SMALL_MODEL, architecture="mistral",
                                                           qkv_bias=True))  # fmt: skip
    with pytest.raises(ExportError, match="MistralForCausalLM"):
        export_hf(run, tmp_path / "out", layout="compressed-tensors")
    assert not (tmp_path / "out").exists()


def test_qwen3_with_attention_bias_is_refused_for_vllm_unless_told(arch_runs, tmp_path):
    run = arch_runs["qwen3-bias"]
    with pytest.raises(ExportError, match=VLLM_DROPS) as refused:
        export_hf(run, tmp_path / "default", layout="compressed-tensors")
    assert "--server sglang --server tensorrt-llm --server transformers" in str(refused.value)
    assert "--allow-dropped-tensors" in str(refused.value)
    assert not (tmp_path / "default").exists()
    for layout in ("modelopt", "compressed-tensors"):
        with pytest.raises(ExportError, match=VLLM_DROPS):
            export_hf(run, tmp_path / layout, layout=layout, servers=["vllm", "sglang"])
    kept = export_hf(run, tmp_path / "kept", layout="modelopt", servers=["sglang", "tensorrt-llm"])
    assert kept.servers == ("sglang", "tensorrt-llm") and kept.notes == ()
    provenance = json.loads((kept.out_dir / "nvfp4_export.json").read_text())
    assert provenance["servers"] == ["sglang", "tensorrt-llm"]
    said = []
    warned = export_hf(run, tmp_path / "warned", layout="compressed-tensors",
                       allow_dropped_tensors=True, log=said.append)  # fmt: skip
    assert warned.servers == SERVERS
    [note] = warned.notes
    assert note.startswith("vllm builds qwen3 without self_attn.o_proj.bias")
    assert "OTHER than the trained one" in note and f"warning: {note}" in said


@pytest.mark.parametrize("case", ["llama-bias", "qwen2", "qwen3", "mistral", "llama-tied"])
def test_every_server_keeps_what_the_other_architectures_trained(arch_runs, tmp_path, case):
    result = export_hf(arch_runs[case], tmp_path / "ct", layout="compressed-tensors")
    assert result.servers == SERVERS and result.notes == ()


def test_a_named_server_that_does_not_load_the_layout_or_mode_is_refused(arch_runs, tmp_path):
    run = arch_runs["llama"]
    ct16 = export_hf(run, tmp_path / "ct16", layout="compressed-tensors", weight_only=True)
    assert ct16.servers == ("vllm", "sglang", "transformers")  # TensorRT-LLM cannot read it
    with pytest.raises(ExportError, match=r"--server tensorrt-llm: .*input_activations"):
        export_hf(run, tmp_path / "x1", layout="compressed-tensors", weight_only=True,
                  servers=["vllm", "tensorrt-llm"])  # fmt: skip
    mo16 = export_hf(run, tmp_path / "mo16", layout="modelopt", weight_only=True)
    assert mo16.servers == ("vllm", "tensorrt-llm")
    with pytest.raises(ExportError, match=r"--server sglang: .*W4A16_NVFP4"):
        export_hf(run, tmp_path / "x2", layout="modelopt", weight_only=True, servers=["sglang"])
    with pytest.raises(ExportError, match=r"--server transformers: .*ModelOpt"):
        export_hf(run, tmp_path / "x3", layout="modelopt", servers=["transformers"])
    with pytest.raises(ExportError, match=r"servers must be some of .*got \['tgi'\]"):
        export_hf(run, tmp_path / "x4", layout="modelopt", servers=["tgi"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("x")]


def test_cli_server_flags(arch_runs, tmp_path, capsys):
    run = str(arch_runs["qwen3-bias"])
    assert main(["hf", run, str(tmp_path / "a"), "--layout", "modelopt"]) == 2
    assert "o_proj.bias" in capsys.readouterr().err
    args = ["hf", run, str(tmp_path / "b"), "--layout", "modelopt", "--server", "sglang"]
    assert main(args) == 0
    assert "for sglang;" in capsys.readouterr().out
    args = ["hf", run, str(tmp_path / "c"), "--layout", "modelopt", "--allow-dropped-tensors"]
    assert main(args) == 0
    assert "warning: vllm builds qwen3 without self_attn.o_proj.bias" in capsys.readouterr().err
