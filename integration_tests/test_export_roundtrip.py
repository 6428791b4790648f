"""Train a tiny model with nvfp4-train, export it in every layout, load it with real clients.

Training writes the `reference` and `quant_stats` items itself (see test_train_checkpoint_items.py);
this fixture replaces them with the JAX model's logits on sequences of a known English text and an
amax calibrated on them, so the client comparisons below run on real words and a fixed batch (and
records the new `quant_stats` in the `integrity` item, as training would have).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nvfp4_export import export_hf, export_onnx, forward, read_checkpoint, resolve_checkpoint
from nvfp4_export.calibrate import calibrate
from nvfp4_export.checkpoint import (
    INTEGRITY_ITEM,
    JSON_CHECKSUMS,
    QUANT_STATS_ITEM,
    REFERENCE_ITEM,
)
from nvfp4_export.json_files import json_sha256
from nvfp4_export.model_spec import spec_from_config
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import (
    bf16_dense,
    bf16_weights,
    load_export,
    weights_from_checkpoint,
    weights_from_export,
)
from nvfp4_export.verify import verify
from nvfp4_format.layout_names import (
    INPUT_GLOBAL_SCALE,
    INPUT_SCALE,
    WEIGHT,
    WEIGHT_GLOBAL_SCALE,
    WEIGHT_PACKED,
    WEIGHT_SCALE,
    WEIGHT_SCALE_2,
)

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and "
    "void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face "
    "of the waters. And God said, Let there be light: and there was light. And God saw the light."
)


def _missing(*mods: str) -> list[str]:
    return [m for m in mods if importlib.util.find_spec(m) is None]


def _jax_logits(ckpt, tokens: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.training.resume import initial_state

    graphdef, _ = initial_state(config_from_dict(ckpt.config))
    tree: dict = {}
    for path, value in ckpt.params.items():
        node = tree
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(value)
    model = nnx.merge(graphdef, tree)
    return np.asarray(model(jnp.asarray(tokens), key=jax.random.key(0)), np.float32)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    import orbax.checkpoint as ocp
    import tokenizers

    run_dir = tmp_path_factory.mktemp("train") / "tiny"
    cmd = [
        sys.executable, "-m", "nvfp4_train", "run", str(ROOT / "examples/configs/tiny.yaml"),
        f"output_dir={run_dir}", "train.steps=4", "train.batch_size=4", "train.seq_len=32",
        "train.eval_every=4", "checkpoint.every_steps=4", "logging.tensorboard=false",
        "logging.progress=plain",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    ckpt = read_checkpoint(resolve_checkpoint(run_dir))
    tok = tokenizers.Tokenizer.from_file(str(run_dir / "tokenizer" / "tokenizer.json"))
    ids = np.asarray(tok.encode(TEXT).ids, np.int32)
    tokens = ids[: 3 * 32].reshape(3, 32)
    step_dir = ckpt.ref.step_dir
    ocp.PyTreeCheckpointer().save(
        (step_dir / REFERENCE_ITEM).absolute(),
        {"tokens": tokens, "logits": _jax_logits(ckpt, tokens)},
        force=True,
    )
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.precision.policy import layer_recipe_names

    cfg = config_from_dict(ckpt.config)
    recipes = layer_recipe_names(cfg.model, cfg.precision)
    spec = spec_from_config(ckpt.config, ckpt.params)
    amax = calibrate(weights_from_checkpoint(ckpt, spec, recipes, {}), tokens)
    written = ckpt.quant_stats or {}  # training writes `recipes`; the amax is added here
    assert written.get("recipes", recipes) == recipes
    stats = {**written, "recipes": recipes, "activation_amax": amax}
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(
        (step_dir / QUANT_STATS_ITEM).absolute(), stats, force=True
    )
    integrity = step_dir / INTEGRITY_ITEM / "metadata"
    saved = json.loads(integrity.read_text())
    saved[JSON_CHECKSUMS][QUANT_STATS_ITEM] = json_sha256(stats)
    integrity.write_text(json.dumps(saved))
    return run_dir


@pytest.fixture(scope="module")
def exports(run, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("exports")
    dirs = {
        layout: export_hf(run, out / layout, layout=layout).out_dir
        for layout in ("modelopt", "compressed-tensors")
    }
    dirs["onnx"] = export_onnx(run, out / "model.onnx")
    return dirs


def test_policy_rule_and_numpy_emulation_match_training(run):
    from nvfp4_train.config.run_config import config_from_dict
    from nvfp4_train.precision.policy import layer_recipe_names

    ckpt = read_checkpoint(resolve_checkpoint(run))
    cfg = config_from_dict(ckpt.config)
    spec = spec_from_config(ckpt.config, ckpt.params)
    assert linear_recipes(spec, ckpt.config, None) == layer_recipe_names(cfg.model, cfg.precision)
    ref = ckpt.reference
    ours = forward(
        weights_from_checkpoint(ckpt, spec, linear_recipes(spec, ckpt.config, None), {}),
        ref["tokens"],
    )
    # same codes and scales, same roundings: only float32 summation order differs
    assert np.abs(ours - ref["logits"]).max() <= 1e-3 * np.abs(ref["logits"]).max()


def test_exports_verify_ok_and_are_w4a4_from_quant_stats(run, exports):
    for name, path in exports.items():
        report = verify(path, against=run)
        assert report.ok, (name, report)
        if name != "onnx":
            assert load_export(path).provenance["input_amax_from"] == QUANT_STATS_ITEM
    for name in ("modelopt", "compressed-tensors"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "nvfp4_export.cli",
                "verify",
                str(exports[name]),
                "--against",
                str(run),
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0 and "result: OK" in done.stdout, done.stdout + done.stderr


def test_modelopt_and_compressed_tensors_hold_the_same_fp4_bytes(exports):
    mo = load_export(exports["modelopt"]).tensors
    ct = load_export(exports["compressed-tensors"]).tensors
    packed = [n[: -len(WEIGHT_PACKED) - 1] for n in ct if n.endswith("." + WEIGHT_PACKED)]
    assert packed
    for m in packed:
        assert mo[f"{m}.{WEIGHT}"].tobytes() == ct[f"{m}.{WEIGHT_PACKED}"].tobytes()
        assert mo[f"{m}.{WEIGHT_SCALE}"].tobytes() == ct[f"{m}.{WEIGHT_SCALE}"].tobytes()
        assert mo[f"{m}.{WEIGHT_SCALE_2}"] == np.float32(1.0) / ct[f"{m}.{WEIGHT_GLOBAL_SCALE}"][0]
        assert mo[f"{m}.{INPUT_SCALE}"] == np.float32(1.0) / ct[f"{m}.{INPUT_GLOBAL_SCALE}"][0]


@pytest.mark.skipif(
    bool(_missing("torch", "transformers", "compressed_tensors")),
    reason=f"not installed: {_missing('torch', 'transformers', 'compressed_tensors')}",
)
def test_transformers_loads_compressed_tensors_export_and_matches(run, exports):
    from transformers import AutoTokenizer

    from nvfp4_export.clients import transformers_logits

    path = exports["compressed-tensors"]
    ref = read_checkpoint(resolve_checkpoint(run)).reference
    hf = transformers_logits(path, ref["tokens"])
    same = forward(
        bf16_weights(weights_from_export(load_export(path))),
        ref["tokens"],
        activations="none",
        compute_dtype="float32",
    )
    # the same dequantized weights in fp32: only summation order differs
    assert np.abs(hf - same).max() <= 1e-3 * np.abs(same).max()
    # vs the JAX model (W4A4 with dynamic activation scaling, BF16 compute): transformers runs
    # the dequantized weights without activation quantization, so the match is statistical
    diff = np.abs(hf - ref["logits"])
    assert diff.mean() <= 0.1 * np.abs(ref["logits"]).mean()
    assert np.mean(hf.argmax(-1) == ref["logits"].argmax(-1)) >= 0.85
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok(TEXT[:40])["input_ids"]
    assert tok.decode(ids) == TEXT[:40]
    assert ids[:32] == ref["tokens"][0].tolist()  # the run's tokenizer, byte for byte


@pytest.mark.skipif(
    bool(_missing("onnx", "onnxruntime")), reason="onnx / onnxruntime not installed"
)
def test_onnxruntime_runs_the_onnx_file_and_matches(run, exports):
    from nvfp4_export.clients import onnxruntime_logits

    ckpt = read_checkpoint(resolve_checkpoint(run))
    spec = spec_from_config(ckpt.config, ckpt.params)
    ref = ckpt.reference
    got = onnxruntime_logits(exports["onnx"], ref["tokens"])
    weights = bf16_dense(
        weights_from_checkpoint(ckpt, spec, linear_recipes(spec, ckpt.config, ckpt.quant_stats), {})
    )
    same = forward(weights, ref["tokens"], activations="none", compute_dtype="float32")
    assert np.abs(got - same).max() <= 1e-3 * np.abs(same).max()
    assert np.mean(got.argmax(-1) == ref["logits"].argmax(-1)) >= 0.85


def test_nvfp4_format_inspect_reads_every_export(exports):
    for name in ("modelopt", "compressed-tensors"):
        done = subprocess.run(
            [sys.executable, "-m", "nvfp4_format.cli", "inspect", str(exports[name]), "--json"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert json.loads(done.stdout)


def test_mxfp4_run_exports_mxfp4_pack_quantized_and_verifies(tmp_path):
    run_dir = tmp_path / "mx"
    cmd = [
        sys.executable, "-m", "nvfp4_train", "run", str(ROOT / "examples/configs/tiny.yaml"),
        f"output_dir={run_dir}", "precision.recipe=mxfp4", "train.steps=2", "train.batch_size=4",
        "train.seq_len=32", "train.eval_every=2", "checkpoint.every_steps=2",
        "logging.tensorboard=false", "logging.progress=plain",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = export_hf(run_dir, tmp_path / "ct", layout="compressed-tensors")
    assert result.plan.fmt == "mxfp4"
    config = json.loads((result.out_dir / "config.json").read_text())
    assert config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    report = verify(result.out_dir, against=run_dir)  # transformers too, when installed
    assert report.ok, report


def test_a_scanned_run_exports_one_tensor_per_layer_and_verifies(tmp_path, exports):
    run_dir = tmp_path / "scanned"
    cmd = [
        sys.executable, "-m", "nvfp4_train", "run", str(ROOT / "examples/configs/tiny.yaml"),
        f"output_dir={run_dir}", "model.scan_layers=true", "model.remat=quantized",
        "train.steps=2", "train.batch_size=4", "train.seq_len=32", "train.eval_every=2",
        "checkpoint.every_steps=2", "logging.tensorboard=false", "logging.progress=plain",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = export_hf(run_dir, tmp_path / "mo", layout="modelopt")
    scanned = load_export(result.out_dir).tensors
    unscanned = load_export(exports["modelopt"]).tensors
    assert sorted(scanned) == sorted(unscanned)  # model.layers.{i}..., one tensor per layer
    assert all(scanned[n].shape == unscanned[n].shape for n in scanned)
    report = verify(result.out_dir, against=run_dir)
    assert report.ok, report
