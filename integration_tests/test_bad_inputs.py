"""The bad-input sweep: every command line tool and the Python API, fed what a hostile new user
feeds them. Each row: the input, the exit code (or exception) and a fragment of the message.
A row failing means a bad input became a traceback, a silent wrong result or a data loss again.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

# the export tests' fake-run writer, loaded by path: this directory has a conftest of its own
_EXPORT_CONFTEST = Path(__file__).resolve().parents[1] / "packages/nvfp4-export/tests/conftest.py"
_spec = importlib.util.spec_from_file_location("nvfp4_export_tests_conftest", _EXPORT_CONFTEST)
_export_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_export_conftest)
write_run = _export_conftest.write_run

import hf_models  # noqa: E402

import nvfp4_format as nf  # noqa: E402
import nvfp4_ops  # noqa: E402
from nvfp4_export import ExportError, export_hf  # noqa: E402
from nvfp4_export.checkpoint import CHECKPOINTS_DIR, INTEGRITY_ITEM, PARAMS_ITEM  # noqa: E402
from nvfp4_export.cli import main as export_main  # noqa: E402
from nvfp4_format.cli import main as format_main  # noqa: E402
from nvfp4_ops.cli import main as ops_main  # noqa: E402
from nvfp4_train.cli import main as train_main  # noqa: E402

TOOLS = {"train": train_main, "export": export_main, "format": format_main, "ops": ops_main}


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """A directory of bad (and a few good) inputs, built once."""
    root = tmp_path_factory.mktemp("bad")
    write = lambda name, text: (root / name).write_text(text) or root / name  # noqa: E731
    write("ok.yaml", "train:\n  steps: 3\n")
    write("list.yaml", "- 1\n- 2\n")
    write("notyaml.yaml", "train: [1, 2\n")
    write("unknown.yaml", "trian:\n  steps: 3\n")
    write("wrongtype.yaml", "train:\n  steps: ten\n")
    write("inf.yaml", "optimizer:\n  learning_rate: .inf\n")
    write("nan.yaml", "optimizer:\n  learning_rate: .nan\n")
    write("dup.yaml", "train:\n  steps: 3\ntrain:\n  seed: 1\n")
    aliases = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    aliases += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    write("bomb.yaml", "\n".join([*aliases, "train:", "  steps: *a8", ""]))
    write("deep.yaml", "[" * 100_000)
    write("accum.yaml", "train:\n  batch_size: 6\n  grad_accum_steps: 4\n")
    write("seqlen.yaml", "train:\n  seq_len: 512\nmodel:\n  max_seq_len: 256\n")
    write("file_as_output", "not a directory")
    write("output_is_file.yaml", yaml.safe_dump({"output_dir": str(root / "file_as_output")}))
    write(
        "nodata.yaml", yaml.safe_dump({"data": {"source": "text", "path": str(root / "none.txt")}})
    )
    (root / "loop").symlink_to(root / "loop")
    run = write_run(root / "run", steps=(2,))
    notes = root / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("keep me")
    export_hf(run, root / "export", layout="modelopt")
    (root / "short.safetensors").write_bytes(b"abc")
    nested = b"[" * 200_000
    (root / "nested.safetensors").write_bytes(struct.pack("<Q", len(nested)) + nested)
    with open(root / "bigheader.safetensors", "wb") as f:
        f.write(struct.pack("<Q", 82 * 2**20))
        f.truncate(8 + 82 * 2**20)
    good = root / "export" / "model.safetensors"
    (root / "truncated.safetensors").write_bytes(good.read_bytes()[:-100])
    (root / "empty_dir").mkdir()
    (root / "binary.txt").write_bytes(bytes(range(256)) * 4)
    (root / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n a user's picture")
    shutil.copytree(root / "export", root / "export_list_config")
    (root / "export_list_config" / "config.json").write_text("[1]")
    write("listkey.yaml", "train:\n  steps: 3\n? [a, b]\n: 1\n")
    (root / "latin1.yaml").write_bytes("train:\n  steps: 3 # caf\xe9\n".encode("latin-1"))
    hf = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128}  # fmt: skip
    for name, changes in (("hf_no_weights", {}), ("hf_half_layer", {"num_hidden_layers": 2.5})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**hf, **changes}))
        hf_models.tokenizer().save(str(root / name / "tokenizer.json"))
    _moe_bad_inputs(root)
    (root / "hf_no_tokenizer").mkdir()
    (root / "hf_no_tokenizer" / "config.json").write_text(json.dumps(hf))
    shutil.copytree(run, root / "run_without_integrity")
    shutil.rmtree(root / "run_without_integrity" / CHECKPOINTS_DIR / "2" / INTEGRITY_ITEM)
    return root


def _moe_bad_inputs(root: Path) -> None:
    """Broken Mixture-of-Experts inputs: HF checkpoints with a missing expert, an expert of
    another shape, a router over more experts, an unsupported variant, router jitter; a run whose
    quant_stats give a block's experts no input amax."""
    import safetensors.numpy

    hf_models.make_model("qwen3_moe", root / "moe_ok")
    tensors = safetensors.numpy.load_file(str(root / "moe_ok" / "model.safetensors"))
    config = json.loads((root / "moe_ok" / "config.json").read_text())
    expert = "model.layers.0.mlp.experts.{e}.{p}.weight"
    broken = {
        "moe_missing_expert": {k: v for k, v in tensors.items() if ".experts.3." not in k},
        "moe_unequal_expert": {**tensors, expert.format(e=2, p="gate_proj"): np.zeros((48, 64),
                                                                                      np.float32)},
        "moe_router_5": {**tensors, "model.layers.1.mlp.gate.weight": np.zeros((5, 64), np.float32)},
    }  # fmt: skip
    for name, weights in broken.items():
        shutil.copytree(root / "moe_ok", root / name)
        safetensors.numpy.save_file(weights, str(root / name / "model.safetensors"))
    for name, changes in (("moe_deepseek", {"model_type": "deepseek_v3"}),
                          ("moe_jitter", {"model_type": "mixtral", "router_jitter_noise": 0.1,
                                          "num_local_experts": 4, "intermediate_size": 32})):  # fmt: skip
        shutil.copytree(root / "moe_ok", root / name)
        (root / name / "config.json").write_text(json.dumps({**config, **changes}))
    model = _export_conftest.model_config(**_export_conftest.SMALL_MODEL,
                                          **_export_conftest.MOE_CASES["qwen3_moe"])  # fmt: skip
    stats = _export_conftest.trained_stats(model)
    stats["activation_amax"]["layers.0.mlp.experts.down"] = [0.0] * 4
    write_run(root / "moe_run_idle", model=model, quant_stats=stats)


MOE_RUN = ["run", "{root}/ok.yaml", "output_dir={root}/o", "model.num_layers=4",
           "model.moe.num_experts=8", "model.moe.expert_mlp_dim=64"]  # fmt: skip
"""A 4-block MoE run: its block choosers (or its size) follow in the rows."""
NO_MOE = "model.moe.num_experts=8 but no block is MoE: model.moe."

# (tool, argv with {root}, exit code, message fragment)
CLI_ROWS = [
    ("train", ["run", "{root}/missing.yaml"], 2, "cannot read config file"),
    ("train", ["run", "{root}"], 2, "cannot read config file"),
    ("train", ["run", "{root}/notyaml.yaml"], 2, "is not valid YAML"),
    ("train", ["run", "{root}/list.yaml"], 2, "a config must be a YAML mapping"),
    (
        "train",
        ["run", "{root}/unknown.yaml"],
        2,
        "unknown config key 'trian' (did you mean 'train'?)",
    ),
    ("train", ["run", "{root}/wrongtype.yaml"], 2, "train.steps: expected int, got 'ten'"),
    ("train", ["run", "{root}/inf.yaml"], 2, "optimizer.learning_rate: expected a finite number"),
    ("train", ["run", "{root}/nan.yaml"], 2, "expected a finite number, got nan"),
    ("train", ["run", "{root}/dup.yaml"], 2, "duplicate key 'train' at line 3"),
    ("train", ["run", "{root}/bomb.yaml"], 2, "once its aliases (*name) are expanded"),
    ("train", ["run", "{root}/deep.yaml"], 2, "nested too deeply"),
    ("train", ["run", "{root}/accum.yaml"], 2, "must be a multiple of train.grad_accum_steps"),
    ("train", ["run", "{root}/seqlen.yaml"], 2, "train.seq_len must be <= model.max_seq_len"),
    ("train", ["run", "{root}/output_is_file.yaml"], 2, "is a file, not a directory"),
    ("train", ["run", "{root}/nodata.yaml", "output_dir={root}/o"], 2, "none.txt"),
    ("train", ["run", "{root}/ok.yaml", "output_dir={root}/o", "mesh.data=3"], 2, "must equal"),
    ("train", [*MOE_RUN, "model.moe.first_dense_layers=10"], 2, f"{NO_MOE}first_dense_layers=10,"),
    ("train", [*MOE_RUN, "model.moe.dense_layers=[0,1,2,3]"], 2, "dense_layers=[0, 1, 2, 3] leave"),
    ("train", [*MOE_RUN, "model.moe.layer_freq=5"], 2, "model.moe.layer_freq=5 and"),
    ("train", [*MOE_RUN, "model.moe.num_experts=1000000"], 2, "GiB per device (parameters"),
    ("train", [*MOE_RUN, "model.moe.num_experts=1000000"], 2, "set train.memory_check=false to"),
    ("train", ["show-config", "{root}/listkey.yaml"], 2, "a key of the YAML is a list"),
    ("train", ["show-config", "{root}/latin1.yaml"], 2, "is not UTF-8 text"),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "model.init_from={root}/hf_no_tokenizer"],
        2,
        "has no tokenizer.json, so the data's token ids would not be the ones the model learnt",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "model.init_from={root}/hf_half_layer"],
        2,
        "config.json's num_hidden_layers must be a whole number, got 2.5",
    ),
    (
        "train",
        ["run", "{root}/ok.yaml", "model.init_from={root}/hf_no_weights", "output_dir={root}/o"],
        2,
        "holds no model.safetensors or model.safetensors.index.json",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "train.steps"],
        2,
        "must look like section.key=value",
    ),
    ("train", ["show-config", "{root}/ok.yaml", "output_dir.x=1"], 2, "output_dir: expected str"),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "train.steps=3", "train.steps.x=1"],
        2,
        "is a value, not a section",
    ),
    ("train", ["show-config", "{root}/dup.yaml"], 2, "duplicate key"),
    ("train", ["show-config", "{root}/missing.yaml"], 2, "cannot read config file"),
    ("train", ["show-config", "{root}/list.yaml"], 2, "YAML mapping"),
    ("train", ["run", "{root}/missing.yaml"], 2, "No such file or directory"),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "optimizer.learning_rate=.inf"],
        2,
        "expected a finite number",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "precison.recipe=nvfp4"],
        2,
        "unknown config key 'precison' (did you mean 'precision'?)",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "precision.recipe=nvfp5"],
        2,
        "unknown recipe 'nvfp5'",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "precision.backend=cuda"],
        2,
        "precision.backend must be",
    ),
    ("train", ["show-config", "{root}/ok.yaml", "train.steps=-1"], 2, "train.steps must be >= 1"),
    ("train", ["show-config", "{root}/ok.yaml", "train.stop_after_nonfinite=-1"], 2, ">= 0"),
    ("train", ["show-config", "{root}/loop"], 2, "Too many levels of symbolic links"),
    ("train", ["eval", "{root}/notes"], 2, "is not a run directory"),
    ("train", ["eval", "{root}/missing_run"], 2, "is not a run directory"),
    (
        "train",
        ["plot", "--quant", "{root}/notes", "{root}/run"],
        2,
        "plot --quant takes one RUN_DIR",
    ),
    (
        "train",
        ["eval", "{root}/run", "--tasks", "{root}/binary.txt"],
        2,
        "not UTF-8 text (byte 128",
    ),
    (
        "train",
        ["eval", "{root}/run", "--tasks", "{root}/binary.txt", "-o", "{root}/missing/r.json"],
        2,
        "does not exist (checked before scoring)",
    ),
    ("train", ["plot", "{root}/run", "-o", "{root}/plot.txt"], 2, "matplotlib cannot write '.txt'"),
    ("train", ["plot", "{root}/run", "-o", "{root}/picture.png"], 2, "exists; not overwriting it"),
    ("export", ["hf", "{root}/missing", "{root}/o1", "--layout", "modelopt"], 2, "does not exist"),
    (
        "export",
        ["hf", "{root}/loop", "{root}/o2", "--layout", "modelopt"],
        2,
        "a loop of symbolic links",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/run", "--layout", "modelopt", "--overwrite"],
        2,
        "would overwrite the checkpoint it is exported from",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/run/checkpoints", "--layout", "modelopt", "--overwrite"],
        2,
        "would overwrite the checkpoint",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}", "--layout", "modelopt", "--overwrite"],
        2,
        "would overwrite the checkpoint",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/notes", "--layout", "modelopt", "--overwrite"],
        2,
        "is not an nvfp4-export export",
    ),
    ("export", ["hf", "{root}/run", "{root}/export", "--layout", "modelopt"], 2, "already exists"),
    (
        "export",
        ["hf", "{root}/run", "{root}/o3", "--layout", "modelopt", "--step", "7"],
        2,
        "no checkpoint at step 7",
    ),
    (
        "export",
        ["hf", "{root}/run/checkpoints/2", "{root}/o4", "--layout", "modelopt", "--step", "3"],
        2,
        "does not match the step directory",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/o5", "--layout", "modelopt", "--max-shard-bytes", "0"],
        2,
        "max_shard_bytes must be >= 1",
    ),
    (
        "export",
        ["hf", "{root}/notes", "{root}/o6", "--layout", "modelopt"],
        2,
        "no checkpoint under",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/file_as_output/x", "--layout", "modelopt"],
        2,
        "does not exist",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/o7", "--layout", "modelopt", "--calibrate", "0"],
        2,
        "--calibrate must be >= 1 sequences, got 0",
    ),
    (
        "export",
        [
            "hf",
            "{root}/run",
            "{root}/o7",
            "--layout",
            "modelopt",
            "--weight-only",
            "--calibrate",
            "-3",
        ],
        2,
        "--calibrate must be >= 1 sequences, got -3",
    ),
    (
        "export",
        ["hf", "{root}/run", "{root}/o7", "--layout", "modelopt", "--calibrate", "2"],
        2,
        "calibration",
    ),
    (
        "export",
        ["onnx", "{root}/run", "{root}/notes/mine.txt", "--overwrite"],
        2,
        "is not an nvfp4-export export",
    ),
    (
        "export",
        [
            "hf",
            "{root}/run",
            "{root}/o8",
            "--layout",
            "modelopt",
            "--calibrate",
            "2",
            "--calibration-text",
            "{root}/missing.txt",
        ],
        2,
        "cannot read --calibration-text",
    ),
    (
        "export",
        [
            "hf",
            "{root}/run",
            "{root}/o9",
            "--layout",
            "modelopt",
            "--calibrate",
            "2",
            "--calibration-text",
            "{root}/binary.txt",
        ],
        2,
        "is not UTF-8 text",
    ),
    (
        "export",
        [
            "hf",
            "{root}/run",
            "{root}/o10",
            "--layout",
            "modelopt",
            "--calibration-text",
            "{root}/ok.yaml",
        ],
        2,
        "--calibration-text needs --calibrate N",
    ),
    (
        "export",
        ["hf", "{root}/run_without_integrity", "{root}/o11", "--layout", "modelopt"],
        2,
        "has no 'integrity' item",
    ),
    ("export", ["onnx", "{root}/run_without_integrity", "{root}/m.onnx"], 2, "no 'integrity' item"),
    (
        "export",
        ["verify", "{root}/export", "--against", "{root}/run_without_integrity"],
        2,
        "pass --no-integrity-check",
    ),
    ("export", ["verify", "{root}/export_list_config"], 2, "must be a JSON object, got list"),
    (
        "export",
        ["verify", "{root}/export", "--sequences", "0"],
        2,
        "--sequences must be an integer",
    ),
    ("export", ["verify", "{root}/notes"], 2, "lacks config.json"),
    ("export", ["verify", "{root}/model.onnx"], 2, "needs --against"),
    (
        "train",
        [
            "run",
            "{root}/ok.yaml",
            "model.init_from={root}/moe_missing_expert",
            "output_dir={root}/o",
        ],
        2,
        "layer 0 lacks expert 3 (missing experts [3] of num_experts=4)",
    ),
    (
        "train",
        [
            "run",
            "{root}/ok.yaml",
            "model.init_from={root}/moe_unequal_expert",
            "output_dir={root}/o",
        ],
        2,
        "tensor 'model.layers.0.mlp.experts.2.gate_proj.weight' has shape (48, 64), the config "
        "implies (32, 64)",
    ),
    (
        "train",
        ["run", "{root}/ok.yaml", "model.init_from={root}/moe_router_5", "output_dir={root}/o"],
        2,
        "model.layers.1.mlp.gate.weight routes to 5 experts, but config.json gives num_experts=4",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "model.init_from={root}/moe_deepseek"],
        2,
        "model_type 'deepseek_v3' is a Mixture-of-Experts variant whose multi-head latent attention",
    ),
    (
        "train",
        ["show-config", "{root}/ok.yaml", "model.init_from={root}/moe_jitter"],
        2,
        "router_jitter_noise=0.1 is not supported",
    ),
    (
        "train",
        [
            "show-config",
            "{root}/ok.yaml",
            "model.init_from={root}/moe_ok",
            "model.moe.num_experts=8",
        ],
        2,
        "model.moe.num_experts=8 but",
    ),
    (
        "export",
        ["hf", "{root}/moe_run_idle", "{root}/o12", "--layout", "modelopt"],
        2,
        "layers.0.mlp.experts.down: every expert (0, 1, 2, 3) has input amax 0",
    ),
    (
        "export",
        ["onnx", "{root}/moe_run_idle", "{root}/moe.onnx"],
        2,
        "ONNX export of Mixture-of-Experts models (qwen3_moe) is not implemented",
    ),
    ("format", ["inspect", "{root}/missing.safetensors"], 2, "no such file or directory"),
    ("format", ["inspect", "{root}/loop"], 2, "a loop of symbolic links"),
    ("format", ["inspect", "{root}/short.safetensors"], 2, "shorter than the 8-byte header"),
    ("format", ["inspect", "{root}/nested.safetensors"], 2, "nested too deeply"),
    ("format", ["inspect", "{root}/bigheader.safetensors"], 2, "exceeds the 16777216-byte limit"),
    ("format", ["inspect", "{root}/truncated.safetensors"], 2, "truncated"),
    ("format", ["inspect", "{root}/empty_dir"], 2, "no model.safetensors.index.json"),
    ("format", ["inspect", "{root}/list.yaml"], 2, "not a safetensors file?"),
]


@pytest.mark.parametrize("tool, argv, code, fragment", CLI_ROWS, ids=lambda v: None)
def test_a_bad_command_line_is_one_clear_error(place, capsys, tool, argv, code, fragment):
    argv = [a.replace("{root}", str(place)) for a in argv]
    before = {p: p.stat().st_mtime_ns for p in (place / "run").rglob("*") if p.is_file()}
    entries = sorted(place.iterdir())
    assert TOOLS[tool](argv) == code
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert fragment in text, text[-2000:]
    assert "Traceback" not in text
    after = {p: p.stat().st_mtime_ns for p in (place / "run").rglob("*") if p.is_file()}
    assert after == before  # the run a bad command names is never touched
    if tool in ("export", "train"):  # nothing written: no output, no run directory, no temporary
        assert sorted(place.iterdir()) == entries
    assert (place / "notes" / "mine.txt").read_text() == "keep me"


E4M3 = np.dtype(nf.nvfp4.ml_dtypes.float8_e4m3fn)
X = np.ones((4, 16), np.float32)
API_ROWS = [
    (lambda: nf.quantize([1.0] * 16), TypeError, "x must be a NumPy or JAX array"),
    (lambda: nf.quantize(np.ones((4, 100), np.float32)), ValueError, "multiple of 16"),
    (lambda: nf.quantize(np.ones((4, 16), np.int32)), TypeError, "floating dtype"),
    (lambda: nf.quantize(X, (16, 16)), ValueError, "rows (x.shape[-2]) a multiple of 16"),
    (lambda: nf.quantize(np.full((4, 16), np.nan, np.float32)), ValueError, "non-finite"),
    (lambda: nf.quantize(X, rounding="stochastic"), ValueError, "needs uniform"),
    (lambda: nf.quantize(X, rounding="floor"), ValueError, "rounding must be"),
    (
        lambda: nf.NVFP4Array(
            np.zeros((4, 8), np.uint8), np.zeros((1, 1), E4M3), np.float32(1), (4, 16)
        ),
        ValueError,
        "block_scales must have shape (4, 1)",
    ),
    (
        lambda: nf.MXFP4Array(np.zeros((4, 16), np.uint8), np.zeros((4, 2), np.uint8), (4, 32)),
        ValueError,
        "scales must have shape (4, 1)",
    ),
    (lambda: nf.dequantize(X), TypeError, "NVFP4Array"),
    (
        lambda: nvfp4_ops.dot_general(X, X.T, (((1,), (0,)), ((), ())), recipe="nvfp4"),
        ValueError,
        "needs a PRNG key",
    ),
    (
        lambda: nvfp4_ops.dot_general(X, X.T, (((1,), (0,)), ((), ())), recipe="nvfp5"),
        ValueError,
        "unknown recipe",
    ),
    (
        lambda: nvfp4_ops.dot_general(X, X, (((1,), (0,)), ((), ())), recipe="bf16"),
        TypeError,
        "dot_general requires contracting dimensions to have the same shape",
    ),
    (
        lambda: nvfp4_ops.dot_general(
            X, X.T, (((1,), (0,)), ((), ())), recipe="nvfp4-no-sr", backend="cuda"
        ),
        ValueError,
        "backend must be 'auto' or one of",
    ),
    (
        lambda: (
            nvfp4_ops.get_recipe("nvfp4").with_bf16_fprop() and nvfp4_ops.Recipe(hadamard_size=12)
        ),
        ValueError,
        "hadamard_size must be a power of two",
    ),
]


@pytest.mark.parametrize("call, error, fragment", API_ROWS, ids=lambda v: None)
def test_a_bad_python_call_is_a_typed_error_naming_the_problem(call, error, fragment):
    with pytest.raises(error) as info:
        call()
    assert fragment in str(info.value)


def test_export_api_refuses_to_replace_what_it_did_not_write(place):
    with pytest.raises(ExportError, match="pass overwrite=True"):
        export_hf(place / "run", place / "export", layout="modelopt")
    with pytest.raises(ExportError, match="is not an nvfp4-export export"):
        export_hf(place / "run", place / "notes", layout="modelopt", overwrite=True)
    assert (place / "notes" / "mine.txt").read_text() == "keep me"


def test_the_sweep_still_exercises_every_tool():
    assert {row[0] for row in CLI_ROWS} == {"train", "export", "format"}
    assert len(CLI_ROWS) + len(API_ROWS) >= 70


def test_ops_doctor_json_needs_verify(capsys):
    with pytest.raises(SystemExit) as info:
        ops_main(["doctor", "--json", "x.json"])
    assert info.value.code == 2 and "--json needs --verify" in capsys.readouterr().err


def test_corrupt_and_tampered_checkpoints_are_refused_by_export(place, tmp_path, capsys):
    run = shutil.copytree(place / "run", tmp_path / "run")
    params = [p for p in (run / CHECKPOINTS_DIR / "2" / PARAMS_ITEM).rglob("*") if p.is_file()]
    for p in params:
        p.write_bytes(b"garbage")
    assert export_main(["hf", str(run), str(tmp_path / "o"), "--layout", "modelopt"]) == 2
    assert "cannot be read" in capsys.readouterr().err
