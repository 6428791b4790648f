"""Scanned layers and remat: which blocks are stacked, the per-layer view everything else sees
(checkpoints, amax, telemetry, grad norm, sharding, resume), and the numbers.

Numerics, as measured here (`numerics`, a subprocess with `--xla_allow_excess_precision=false`):
the losses, grad norms, activation amax and parameters of 20 SGD steps are bit-identical scanned
and unscanned, and for every remat policy, BF16 and NVFP4. AdamW (the run's optimizer) differs by
one rounding per update on some elements: XLA's algebraic simplifier turns Adam's division by
its bias-correction scalar into a multiplication by the reciprocal for some leaves and not for
others, depending on how many leaves share the scalar (reproduced with plain optax: one stacked
leaf and the same values as separate leaves differ in the same way). Training carries that last
bit on: over 20 AdamW steps the BF16 losses agree to 1.3e-3 (relative), so NOT within 1e-6.
AdamW runs for BF16 only: the SGD runs show NVFP4's gradients bit-identical scanned or not, so
what AdamW adds is the optimizer's rounding, which no recipe changes (the NVFP4 AdamW losses,
when they were run, agreed exactly). With XLA's default flags (excess precision allowed) scanned
and unrolled code may keep different intermediates in float32, so the forward itself can differ
in the last bits.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P
from run_steps import initial, probe_of, run_optimizer, train_step_of

import nvfp4_train.model.config
from nvfp4_train.checkpoint.checkpoints import Checkpoints
from nvfp4_train.checkpoint.integrity import state_integrity
from nvfp4_train.checkpoint.items import LAYOUT_ITEMS
from nvfp4_train.checkpoint.per_layer import PerLayer
from nvfp4_train.config.run_config import config_from_dict
from nvfp4_train.mesh.sharding import AXES, param_spec, tree_shardings
from nvfp4_train.model.config import LINEAR_NAMES, REMAT_POLICIES, ModelConfig
from nvfp4_train.model.decoder import unstacked
from nvfp4_train.model.hf.weights import _canonical_shapes
from nvfp4_train.model.layer_groups import groups_of, runs_of
from nvfp4_train.model.stacked_blocks import layer_keys, scan_segment
from nvfp4_train.model.stacking import (
    LayerLayout,
    Segment,
    canonical_path,
    global_norm,
    is_stacked,
    layer_paths,
)
from nvfp4_train.precision.policy import layer_recipes, run_layout
from nvfp4_train.training.resume import abstract_state
from nvfp4_train.training.run import run
from nvfp4_train.training.step import flat_amax, forward, model_graphdef, model_spec, step_key
from nvfp4_train.tree_paths import flat_paths

HERE = Path(__file__).resolve().parent


@functools.cache
def scan_cfg(recipe="nvfp4", scan=True, remat="none", layers=4, overrides=()):
    """A 4-block model, blocks 0 and 3 in BF16: stacked, it is stored as 0, 1-2, 3."""
    return config_from_dict(
        {
            "model": {
                "vocab_size": 64, "d_model": 32, "num_layers": layers, "num_heads": 2,
                "num_kv_heads": 1, "mlp_dim": 64, "max_seq_len": 16,
                "scan_layers": scan, "remat": remat,
            },
            "precision": {"recipe": recipe, "bf16_first_layers": 1, "bf16_last_layers": 1},
            "optimizer": {"learning_rate": 1e-2, "schedule": "constant", "warmup_steps": 0},
            "train": {"steps": 20, "seed": 5, "batch_size": 4, "seq_len": 16},
        },
        list(overrides),
    )  # fmt: skip


def batch(seed: int = 1):
    tokens = jax.random.randint(jax.random.key(seed), (4, 17), 0, 64, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def leaves_equal(a, b) -> bool:
    flat_a, tree_a = jax.tree.flatten(a)
    flat_b, tree_b = jax.tree.flatten(b)
    return tree_a == tree_b and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(flat_a, flat_b, strict=True)
    )


def jiggled(state):
    """`state` with every float leaf of its params, optimizer state and activation amax replaced
    by distinct random values (a trained state's moments and amax are not zero; no train step is
    compiled for it)."""
    leaves, tree = jax.tree.flatten((state.params, state.opt_state, state.activation_amax))
    rng = np.random.default_rng(3)  # NumPy: no program compiled per shape
    leaves = [
        jnp.asarray(rng.standard_normal(x.shape).astype(x.dtype))
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for x in leaves
    ]
    params, opt_state, amax = jax.tree.unflatten(tree, leaves)
    return state._replace(params=params, opt_state=opt_state, activation_amax=amax)


def digest(tree) -> str:
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        h.update(jax.tree_util.keystr(path).encode())
        h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ the layout


def test_layout_entries_and_round_trip_of_nested_trees():
    layout = LayerLayout(5, runs=((1, 4),))
    assert [key for key, _, _ in layout.entries] == ["0", "1-3", "4"]
    per_layer = {"layers": {str(i): {"w": np.full((2, 3), i, np.float32)} for i in range(5)}}
    tree = {"params": per_layer, "opt": (optax.EmptyState(), {"mu": per_layer, "count": 3})}
    stacked = layout.from_canonical(tree)
    assert sorted(stacked["params"]["layers"]) == ["0", "1-3", "4"]
    assert stacked["opt"][1]["mu"]["layers"]["1-3"]["w"].shape == (3, 2, 3)
    assert stacked["opt"][1]["mu"]["layers"]["1-3"]["w"][2, 0, 0] == 3
    assert leaves_equal(layout.to_canonical(stacked), tree)
    assert leaves_equal(layout.to_canonical(tree), tree)  # already per layer: unchanged
    abstract = layout.to_canonical(jax.eval_shape(lambda: layout.from_canonical(per_layer)))
    assert abstract["layers"]["2"]["w"].shape == (2, 3)


@pytest.mark.parametrize("runs", [((0, 1),), ((2, 4), (1, 3)), ((3, 6),)])
def test_layout_refuses_overlapping_short_or_out_of_range_runs(runs):
    with pytest.raises(ValueError, match="runs must be ordered, disjoint"):
        LayerLayout(5, runs)


def test_runs_paths_and_stacked_detection():
    assert runs_of(["a", "b", "b", "b", "a", "a", "c"]) == ((1, 4), (4, 6))
    assert runs_of(["a", "b", "c"]) == ()
    assert canonical_path("layers.1-30.attn_norm.scale") == "layers.1.attn_norm.scale"
    assert canonical_path("mu.layers.4-5.mlp.down.kernel") == "mu.layers.4.mlp.down.kernel"
    assert canonical_path("layers.3.mlp.down.kernel") == "layers.3.mlp.down.kernel"
    assert is_stacked(("layers", "1-2", "attn", "qkv", "kernel"))
    assert not is_stacked(("layers", "1", "attn", "qkv", "kernel"))


def test_layout_follows_the_precision_policy_its_overrides_and_no_decay():
    entries = lambda cfg: [key for key, _, _ in run_layout(cfg).entries]  # noqa: E731
    assert entries(scan_cfg(layers=8)) == ["0", "1-6", "7"]
    assert entries(scan_cfg(layers=8, scan=False)) == [str(i) for i in range(8)]
    auto_scans_4 = nvfp4_train.model.config.AUTO_SCAN_LAYERS <= 4  # 8, unless --scan-layers-from
    assert entries(scan_cfg(layers=4, scan="auto")) == (
        ["0", "1-2", "3"] if auto_scans_4 else ["0", "1", "2", "3"]
    )
    assert entries(scan_cfg(layers=8, scan="auto")) == ["0", "1-6", "7"]
    override = ("precision.overrides=['layers\\.4\\.mlp\\..*=nvfp4-no-rht']",)
    assert entries(scan_cfg(layers=8, overrides=override)) == ["0", "1-3", "4", "5-6", "7"]
    no_decay = ("optimizer.no_decay=['norm', 'embed', 'layers\\.2\\.attn\\.qkv']",)
    assert entries(scan_cfg(layers=8, overrides=no_decay)) == ["0", "1", "2", "3-6", "7"]
    assert entries(scan_cfg("bf16", layers=8)) == ["0-7"]


def test_model_config_checks_scan_and_remat():
    base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, mlp_dim=64)
    with pytest.raises(ValueError, match="model.remat must be one of"):
        ModelConfig(**base, remat="everything")
    with pytest.raises(ValueError, match="model.scan_layers must be true, false or 'auto'"):
        ModelConfig(**base, scan_layers="yes")
    assert set(REMAT_POLICIES) == {"none", "full", "quantized", "dots", "dots_no_batch"}


def test_a_seed_gives_the_same_weights_stacked_or_not():
    _, scanned = initial(scan_cfg(scan=True))
    _, plain = initial(scan_cfg(scan=False))
    assert sorted(scanned.params["layers"]) == ["0", "1-2", "3"]
    assert scanned.params["layers"]["1-2"]["attn"]["qkv"]["kernel"].shape == (2, 32, 64)
    layout = run_layout(scan_cfg(scan=True))
    assert leaves_equal(layout.to_canonical(scanned.params), plain.params)
    assert leaves_equal(layout.to_canonical(scanned.opt_state), plain.opt_state)
    assert leaves_equal(scanned.activation_amax, plain.activation_amax)  # always per layer


def _jitted_init(cfg):
    return jax.jit(lambda: initial(cfg)[1])()


def test_the_jitted_init_gives_the_same_weights_stacked_or_not():
    # the run's init is jitted: there a run of stacked blocks is built by a scanned init, and
    # each block must still draw the keys (and round the values) it draws built on its own
    scanned, plain = (
        _jitted_init(scan_cfg(scan=True, layers=6)),
        _jitted_init(scan_cfg(scan=False, layers=6)),
    )
    assert sorted(scanned.params["layers"]) == ["0", "1-4", "5"]
    layout = run_layout(scan_cfg(scan=True, layers=6))
    assert leaves_equal(layout.to_canonical(scanned.params), plain.params)
    assert leaves_equal(layout.to_canonical(scanned.opt_state), plain.opt_state)
    blocks = scanned.params["layers"]["1-4"]["mlp"]["down"]["kernel"]
    assert not np.array_equal(blocks[0], blocks[1])  # each block its own keys
    again = _jitted_init(scan_cfg(scan=True, layers=6))
    assert leaves_equal(again.params, scanned.params)


def _init_eqns(layers: int) -> int:
    cfg = scan_cfg(scan=True, layers=layers)
    build = lambda: nnx.split(model_spec(cfg).build(nnx.Rngs(params=0)))[1]  # noqa: E731
    return len(jax.make_jaxpr(build)().jaxpr.eqns)


def test_the_init_of_stacked_blocks_does_not_grow_with_depth():
    # 4 blocks are stored 0, 1-2, 3 and 10 blocks 0, 1-8, 9: one scanned init each
    assert _init_eqns(10) == _init_eqns(4)


def test_the_late_bf16_forward_runs_on_the_stacked_state():
    cfg = scan_cfg(scan=True)
    _, state = initial(cfg)
    late = model_graphdef(
        model_spec(cfg), layer_recipes(cfg.model, cfg.precision, bf16_forward=True)
    )
    run_forward = jax.jit(forward, static_argnums=0)
    logits = run_forward(late, state.params, batch()["inputs"], jax.random.key(0))
    assert logits.shape == (4, 16, 64) and bool(jnp.all(jnp.isfinite(logits)))


def test_a_stacked_parameter_is_sharded_like_one_layer_never_along_layers():
    mesh = AbstractMesh((2, 2, 1, 2), AXES)
    one = param_spec(("layers", "1", "attn", "qkv", "kernel"), (32, 64), mesh)
    assert param_spec(("layers", "1-6", "attn", "qkv", "kernel"), (6, 32, 64), mesh) == P(
        None, *one
    )
    norm = param_spec(("layers", "1-6", "attn_norm", "scale"), (6, 32), mesh)
    assert norm == P(None, *param_spec(("layers", "1", "attn_norm", "scale"), (32,), mesh))
    state = abstract_state(scan_cfg(scan=True))[1]
    device_mesh = jax.make_mesh((1,) * len(AXES), AXES)
    shardings = tree_shardings(state.params, state.params, device_mesh)
    spec = shardings["layers"]["1-2"]["mlp"]["down"]["kernel"].spec
    assert len(spec) == 3 and spec[0] is None


# ------------------------------------------------------------------ the numbers


def _numerics_report() -> dict:
    """Run in a subprocess with `--xla_allow_excess_precision=false` (see the module doc)."""
    variants = {
        "bf16": [(False, "none"), (True, "none")],
        "nvfp4": [(False, "none"), (True, "none"), (True, "quantized"), (False, "full"),
                  (True, "dots")],
    }  # fmt: skip
    report: dict = {}
    for recipe, runs in variants.items():
        for scan, remat in runs:
            cfg = scan_cfg(recipe, scan, remat)
            layout = run_layout(cfg)
            sgd = optax.sgd(1e-2, momentum=0.9)
            graphdef, state = initial(cfg, sgd)
            step = jax.jit(train_step_of(cfg, graphdef, sgd))
            losses, norms, first, first_amax = [], [], None, None
            for i in range(20):
                state, metrics = step(state, batch(i))
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
                first = first or digest(layout.to_canonical(state.params))
                first_amax = first_amax or {
                    name: float(v) for name, v in flat_amax(state.activation_amax).items()
                }
            row = {
                "losses": losses,
                "grad_norms": norms,
                "params_after_1": first,
                "amax_after_1": first_amax,
                "params_after_20": digest(layout.to_canonical(state.params)),
                "amax": digest(state.activation_amax),
            }
            if remat == "none" and recipe == "bf16":  # the run's optimizer: AdamW, clip 1.0
                adamw = run_optimizer(cfg)
                graphdef, state = initial(cfg)
                adam_step = jax.jit(train_step_of(cfg, graphdef, adamw))
                row["adamw_losses"] = []
                for i in range(20):
                    state, metrics = adam_step(state, batch(i))
                    row["adamw_losses"].append(float(metrics["loss"]))
                    if i == 0:
                        row["adamw_params_after_1"] = {
                            jax.tree_util.keystr(p): np.asarray(v).tolist()
                            for p, v in jax.tree_util.tree_leaves_with_path(
                                layout.to_canonical(state.params)
                            )
                        }
            report[f"{recipe}/scan={scan}/remat={remat}"] = row
    return report


@pytest.fixture(scope="module")
def numerics() -> dict:
    code = f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import test_scan; " \
           "print(json.dumps(test_scan._numerics_report()))"  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_scanned_and_unscanned_train_bit_identically_with_sgd(numerics, recipe):
    rows = {k: v for k, v in numerics.items() if k.startswith(f"{recipe}/")}
    reference = rows.pop(f"{recipe}/scan=False/remat=none")
    assert len(set(reference["losses"])) > 1
    for name, row in rows.items():  # scanned, and every remat policy
        for item in ("losses", "grad_norms", "params_after_1", "params_after_20", "amax"):
            assert row[item] == reference[item], f"{name}: {item} differs"


@pytest.mark.parametrize("recipe", ["bf16"])  # the optimizer's rounding: see the module doc
def test_adamw_updates_of_stacked_blocks_differ_by_at_most_one_rounding(numerics, recipe):
    plain = numerics[f"{recipe}/scan=False/remat=none"]
    scanned = numerics[f"{recipe}/scan=True/remat=none"]
    assert plain["adamw_params_after_1"].keys() == scanned["adamw_params_after_1"].keys()
    for name, values in plain["adamw_params_after_1"].items():
        a = np.asarray(values, np.float32)
        b = np.asarray(scanned["adamw_params_after_1"][name], np.float32)
        # one rounding of the update (lr 1e-2, |update| <= lr): below one ulp of 1e-2 plus one
        # ulp of the parameter
        bound = np.spacing(np.float32(1e-2)) + np.spacing(np.maximum(np.abs(a), np.abs(b)))
        assert np.all(np.abs(a - b) <= bound), name
    assert plain["adamw_losses"][0] == scanned["adamw_losses"][0]
    rel = np.abs(np.subtract(plain["adamw_losses"], scanned["adamw_losses"]))
    rel /= np.abs(plain["adamw_losses"])
    print(
        f"{recipe}: AdamW, 20 steps, scanned vs unscanned: max relative loss difference {rel.max():.2e}"
    )
    assert rel.max() < 5e-2  # measured: see the module docstring


def test_telemetry_rows_are_per_layer_and_equal_scanned_or_not():
    rows = {}
    for scan in (False, True):
        cfg = scan_cfg(scan=scan)
        graphdef, state = initial(cfg)
        probe = jax.jit(probe_of(cfg, graphdef))
        rows[scan] = jax.device_get(probe(state.params, batch(), step_key(cfg.train.seed, 0)))
    expected = [f"layers.{i}.{name}" for i in (1, 2) for name in LINEAR_NAMES]
    assert sorted(rows[True]) == sorted(expected)
    assert leaves_equal(rows[True], rows[False])


def test_unstacked_model_has_one_block_per_layer():
    cfg = scan_cfg(scan=True, remat="quantized")
    graphdef, state = initial(cfg)
    from flax import nnx

    model = unstacked(nnx.merge(graphdef, state.params))
    assert sorted(model.layers.keys()) == ["0", "1", "2", "3"]
    assert model.cfg.remat == "none" and not model.layout.scanned
    kernel = model.layers["2"].attn.qkv.kernel[...]
    assert np.array_equal(kernel, state.params["layers"]["1-2"]["attn"]["qkv"]["kernel"][1])


def test_amax_is_per_layer_and_updated_for_stacked_blocks(numerics):
    amax = numerics["nvfp4/scan=True/remat=none"]["amax_after_1"]  # blocks 1-2 stacked
    assert sorted(amax) == sorted(f"layers.{i}.{n}" for i in range(4) for n in LINEAR_NAMES)
    assert all(v > 0 for v in amax.values())
    assert amax == numerics["nvfp4/scan=False/remat=none"]["amax_after_1"]  # each layer its own
    assert any(amax[f"layers.1.{n}"] != amax[f"layers.2.{n}"] for n in LINEAR_NAMES)


# ------------------------------------------------------------------ checkpoints and resume


@pytest.mark.parametrize(("save_scanned", "restore_scanned"), [(True, False), (False, True)])
def test_checkpoints_are_per_layer_and_restore_into_either_layout(
    tmp_path, save_scanned, restore_scanned
):
    saver, restorer = scan_cfg(scan=save_scanned), scan_cfg(scan=restore_scanned)
    state = jiggled(initial(saver)[1])  # every parameter and moment its own value
    with Checkpoints(tmp_path, keep=2, layout=run_layout(saver)) as ckpts:
        ckpts.save(1, state, data_iter_state={"i": 1}, config={"k": 1})
    with Checkpoints(tmp_path, keep=2, layout=run_layout(restorer)) as ckpts:
        restored = ckpts.restore(1, abstract_state(restorer)[1]).state
    with Checkpoints(tmp_path, keep=2) as ckpts:  # no layout: what is on disk
        on_disk = ckpts.restore(1, abstract_state(scan_cfg(scan=False))[1]).state
    assert sorted(on_disk.params["layers"]) == ["0", "1", "2", "3"]
    want_layers = ["0", "1-2", "3"] if restore_scanned else ["0", "1", "2", "3"]
    assert sorted(restored.params["layers"]) == want_layers
    saved_view, restored_view = run_layout(saver), run_layout(restorer)
    assert leaves_equal(
        restored_view.to_canonical(restored.params), saved_view.to_canonical(state.params)
    )
    assert leaves_equal(
        restored_view.to_canonical(restored.opt_state), saved_view.to_canonical(state.opt_state)
    )
    assert flat_amax(restored.activation_amax) == flat_amax(state.activation_amax)  # per layer


def test_the_integrity_of_a_stacked_state_is_the_per_layer_one_on_disk():
    # checksums are taken before the split, one vmapped program per stacked array: they must be
    # those of the per-layer arrays written, under their per-layer paths
    cfg = scan_cfg(scan=True)
    state = jiggled(initial(cfg)[1])
    on_disk = PerLayer(run_layout(cfg)).to_disk(state)
    assert sorted(on_disk.params["layers"]) == ["0", "1", "2", "3"]
    stacked, per_layer = state_integrity(state), state_integrity(on_disk)
    assert stacked == per_layer and stacked["finite"]
    sums = stacked["checksums"]
    assert "params.layers.2.mlp.down.kernel" in sums and not any("1-2" in p for p in sums)
    assert sums["params.layers.1.mlp.down.kernel"] != sums["params.layers.2.mlp.down.kernel"]
    broken = state.params["layers"]["1-2"]["mlp"]["down"]["kernel"].at[1, 0, 0].set(jnp.inf)
    params = {**state.params, "layers": {**state.params["layers"]}}
    params["layers"]["1-2"] = {**params["layers"]["1-2"], "mlp": {**params["layers"]["1-2"]["mlp"]}}
    params["layers"]["1-2"]["mlp"]["down"] = {"kernel": broken}
    changed = state_integrity(state._replace(params=params))
    assert not changed["finite"]
    differ = [p for p in sums if sums[p] != changed["checksums"][p]]
    assert differ == ["params.layers.2.mlp.down.kernel"]


def test_a_run_saved_unscanned_resumes_scanned_and_evaluates(tmp_path, tiny_config):
    # BF16: what is tested is the run resuming across layouts (iterator, step, evaluation); the
    # mixed NVFP4 layout (0, 1-2, 3) with its per-layer amax restores in either direction above,
    # and BF16 compiles the four steps of this test in a fraction of NVFP4's time
    sections = {
        "model": {"num_layers": 4, "scan_layers": False},
        "precision": {"recipe": "bf16"},
        "train": {"steps": 8, "log_every": 1, "eval_every": 8},
        "checkpoint": {"every_steps": 4, "keep": 3},
        "logging": {"tensorboard": False},
    }
    cfg = config_from_dict(tiny_config(tmp_path / "r", **sections))
    first = run(cfg, stream=io.StringIO())
    run_dir = Path(first.run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "8")
    resumed_cfg = config_from_dict(
        tiny_config(tmp_path / "r", **{**sections, "model": {"num_layers": 4, "scan_layers": True}})
    )
    output = io.StringIO()
    second = run(resumed_cfg, stream=output)
    assert "(step 4)" in output.getvalue() and (second.start_step, second.final_step) == (4, 8)
    rel = abs(second.last_loss - first.last_loss) / first.last_loss
    assert rel < 1e-2, (second.last_loss, first.last_loss)
    assert second.val_loss is not None and np.isfinite(second.val_loss)


def test_a_layout_is_read_back_from_its_layers_keys():
    layout = LayerLayout(32, runs=((1, 28), (28, 32)))
    assert LayerLayout.of_keys([key for key, _, _ in layout.entries]) == layout
    assert LayerLayout.of_keys(["1", "0"]) == LayerLayout(2)
    with pytest.raises(ValueError, match="got 'attn'"):
        LayerLayout.of_keys(["0", "attn"])


# ------------------------------------------------------------------ groups of blocks

MOE_EVERY_OTHER = (
    "model.moe.num_experts=4", "model.moe.experts_per_token=2", "model.moe.expert_mlp_dim=32",
    "model.moe.layer_freq=2", "model.moe.bias_update_rate=0.01",
)  # fmt: skip
"""Blocks 1, 3, 5, ... MoE: dense and MoE blocks alternate, one group of 2 repeating."""


def group_cfg(scan=True, layers=6, bf16_ends=True):
    """An NVFP4 model whose blocks alternate dense and MoE: 6 blocks (0 and 5 in BF16) are
    stored "0", "1-4/2", "5"; 4 blocks all NVFP4 ("bf16_ends" False) "0-3/2"."""
    ends = () if bf16_ends else ("precision.bf16_first_layers=0", "precision.bf16_last_layers=0")
    return scan_cfg(scan=scan, layers=layers, overrides=MOE_EVERY_OTHER + ends)


def _fewest_bodies(signatures, max_period=8) -> tuple[int, int]:
    """(bodies, segments) of the best stacking, by trying every segmentation (the reference)."""

    @functools.cache
    def best(i: int) -> tuple[int, int]:
        if i == len(signatures):
            return (0, 0)
        options = [(1 + best(i + 1)[0], 1 + best(i + 1)[1])]
        for p in range(1, max_period + 1):
            for r in range(2, (len(signatures) - i) // p + 1):
                if all(signatures[i + k] == signatures[i + k % p] for k in range(r * p)):
                    options.append((p + best(i + r * p)[0], 1 + best(i + r * p)[1]))
        return min(options)

    return best(0)


def test_groups_of_picks_the_fewest_block_bodies():
    assert groups_of("dEdEdE") == ((0, 6, 2),)
    assert groups_of("adEdEdEb") == ((1, 7, 2),)
    assert groups_of("aaaa") == ((0, 4, 1),)  # period 1 (1 body), not "aa" twice (2)
    assert groups_of("aabaabaab") == ((0, 9, 3),)  # 3 bodies, not "aa", "b" three times (6)
    assert groups_of("ababa") == ((0, 4, 2),)  # a tie: the longer first segment
    assert groups_of("abcabc", max_period=2) == ()
    assert groups_of("") == () and groups_of("a") == ()
    nano = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    assert LayerLayout(52, groups_of(nano)).bodies == 14
    with pytest.raises(ValueError, match="max_period must be >= 1, got 0"):
        groups_of("ab", max_period=0)
    rng = np.random.default_rng(0)
    for _ in range(300):
        signatures = "".join(rng.choice(list("abc"[: rng.integers(1, 4)]), rng.integers(0, 14)))
        runs = groups_of(signatures, max_period=4)
        layout = LayerLayout(len(signatures), runs)
        assert (layout.bodies, len(layout.segments)) == _fewest_bodies(signatures, 4)
        for start, stop, p in runs:
            assert all(
                signatures[i] == signatures[start + (i - start) % p] for i in range(start, stop)
            )
        period_1 = tuple((a, b, 1) for a, b in runs_of(signatures))
        assert groups_of(signatures, max_period=1) == period_1


def test_group_keys_paths_and_layouts():
    layout = LayerLayout(8, runs=((1, 5, 2), (5, 7)))
    assert layout.runs == ((1, 5, 2), (5, 7, 1))
    assert [key for key, _, _ in layout.entries] == ["0", "1-4/2", "5-6", "7"]
    assert [s.repeats for s in layout.segments] == [1, 2, 2, 1] and layout.bodies == 5
    assert LayerLayout.of_keys(["7", "5-6", "1-4/2", "0"]) == layout
    assert layer_paths(("layers", "1-4/2", "1", "mlp", "down", "kernel")) == (
        "layers.2.mlp.down.kernel", "layers.4.mlp.down.kernel",
    )  # fmt: skip
    assert canonical_path("mu.layers.1-4/2.1.mlp.down.kernel") == "mu.layers.2.mlp.down.kernel"
    assert canonical_path("layers.1-4/2.0.attn_norm.scale") == "layers.1.attn_norm.scale"
    assert is_stacked(("layers", "1-4/2", "0", "attn", "qkv", "kernel"))
    with pytest.raises(ValueError, match="must name one of its blocks 0..1 next"):
        layer_paths(("layers", "1-4/2", "attn", "qkv", "kernel"))
    with pytest.raises(ValueError, match="must be spelled '1-4'"):
        LayerLayout.of_keys(["0", "1-4/1"])
    with pytest.raises(ValueError, match="once each"):
        LayerLayout.of_keys(["0", "1-4/2", "3"])
    for runs in [((0, 5, 2),), ((0, 2, 2),), ((0, 4, 0),)]:
        with pytest.raises(ValueError, match="must hold >= 2 whole repetitions"):
            LayerLayout(6, runs)
    with pytest.raises(ValueError, match="each run must be"):
        LayerLayout(6, ((0, 4, 2, 1),))


def test_group_trees_round_trip_and_may_hold_some_blocks():
    layout = LayerLayout(6, runs=((1, 5, 2),))
    per_layer = {"layers": {str(i): {"w": np.full((2, 3), i, np.float32)} for i in range(6)}}
    tree = {"params": per_layer, "opt": {"mu": per_layer}}
    stacked = layout.from_canonical(tree)
    assert sorted(stacked["params"]["layers"]) == ["0", "1-4/2", "5"]
    group = stacked["opt"]["mu"]["layers"]["1-4/2"]
    assert sorted(group) == ["0", "1"] and group["1"]["w"][:, 0, 0].tolist() == [2, 4]
    assert leaves_equal(layout.to_canonical(stacked), tree)
    abstract = layout.to_canonical(jax.eval_shape(lambda: layout.from_canonical(per_layer)))
    assert abstract["layers"]["3"]["w"].shape == (2, 3)
    moe = {"layers": {"1-4/2": {"0": {"mlp": {"aux": np.array([1.0, 3.0])}}}}}  # block 1, 3 MoE
    assert layout.to_canonical(moe) == {
        "layers": {"1": {"mlp": {"aux": 1.0}}, "3": {"mlp": {"aux": 3.0}}}
    }


def test_global_norm_is_the_same_bits_for_groups_of_blocks():
    layout = LayerLayout(7, runs=((0, 4, 2), (4, 6)))  # blocks 0-3: two shapes alternating
    rng = np.random.default_rng(4)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))  # noqa: E731
    block = lambda i: {"a": {"w": normal(3 + i % 2 * (i < 4), 5)}, "b": normal(7) * 1e3}  # noqa: E731
    per_layer = {"embed": normal(9), "layers": {str(i): block(i) for i in range(7)}}
    stacked = layout.from_canonical(per_layer)
    assert sorted(stacked["layers"]) == ["0-3/2", "4-5", "6"]
    norm = jax.jit(global_norm)
    assert np.asarray(norm(stacked)).tobytes() == np.asarray(norm(per_layer)).tobytes()


def test_alternating_dense_and_moe_blocks_are_stacked_as_one_group():
    entries = lambda cfg: [key for key, _, _ in run_layout(cfg).entries]  # noqa: E731
    assert entries(group_cfg()) == ["0", "1-4/2", "5"]
    assert entries(group_cfg(layers=4, bf16_ends=False)) == ["0-3/2"]
    assert entries(group_cfg(scan=False)) == [str(i) for i in range(6)]
    assert run_layout(group_cfg(layers=10)).bodies == 4  # 0, 1-8/2 (two bodies), 9


@pytest.fixture(scope="module")
def group_states():
    """{scan: (graphdef, step-0 state)} of `group_cfg()`, stacked or not."""
    return {scan: initial(group_cfg(scan)) for scan in (True, False)}


def test_a_seed_gives_the_same_weights_grouped_or_not(group_states):
    (_, grouped), (_, plain) = group_states[True], group_states[False]
    group = grouped.params["layers"]["1-4/2"]
    assert sorted(group) == ["0", "1"] and "router" in group["0"]["mlp"]  # block 1 MoE, 2 dense
    assert group["1"]["mlp"]["down"]["kernel"].shape == (2, 64, 32)
    layout = run_layout(group_cfg())
    assert leaves_equal(layout.to_canonical(grouped.params), plain.params)
    assert leaves_equal(layout.to_canonical(grouped.opt_state), plain.opt_state)


def test_the_jitted_init_gives_the_same_weights_grouped_or_not():
    cfg = functools.partial(group_cfg, layers=4, bf16_ends=False)  # "0-3/2": one scanned init
    scanned, plain = _jitted_init(cfg()), _jitted_init(cfg(scan=False))
    assert leaves_equal(run_layout(cfg()).to_canonical(scanned.params), plain.params)
    kernels = scanned.params["layers"]["0-3/2"]["0"]["mlp"]["down"]["kernel"]
    assert not np.array_equal(kernels[0], kernels[1])  # blocks 0 and 2: each its own keys


def test_the_init_of_a_group_does_not_grow_with_depth():
    build = lambda cfg: nnx.split(model_spec(cfg).build(nnx.Rngs(params=0)))[1]  # noqa: E731
    eqns = lambda cfg: len(jax.make_jaxpr(lambda: build(cfg))().jaxpr.eqns)  # noqa: E731
    assert eqns(group_cfg(layers=10)) == eqns(group_cfg(layers=6))


def test_unstacked_model_splits_groups(group_states):
    graphdef, state = group_states[True]
    model = unstacked(nnx.merge(graphdef, state.params))
    assert list(model.layers.keys()) == [str(i) for i in range(6)]
    kernel = model.layers["4"].mlp.down.kernel[...]
    assert np.array_equal(kernel, state.params["layers"]["1-4/2"]["1"]["mlp"]["down"]["kernel"][1])


def test_a_grouped_parameter_is_sharded_like_one_layer(group_states):
    mesh = AbstractMesh((2, 2, 1, 2), AXES)
    path = ("layers", "1-4/2", "0", "mlp", "experts", "gate_up", "kernel")
    one = param_spec(("layers", "1", *path[3:]), (4, 32, 64), mesh)
    assert param_spec(path, (2, 4, 32, 64), mesh) == P(None, *one)
    params = group_states[True][1].params
    shardings = tree_shardings(params, params, jax.make_mesh((1,) * len(AXES), AXES))
    assert shardings["layers"]["1-4/2"]["1"]["mlp"]["down"]["kernel"].spec[0] is None


def test_hf_import_maps_every_grouped_parameter_to_its_layer():
    grouped = abstract_state(group_cfg())[1].params
    plain = abstract_state(group_cfg(scan=False))[1].params
    assert _canonical_shapes(grouped) == _canonical_shapes(plain)


def test_a_checkpoint_of_groups_is_per_layer_and_restores_into_either_layout(
    tmp_path, group_states
):
    state = jiggled(group_states[True][1])  # every parameter and moment its own value
    grouped_layout = run_layout(group_cfg())
    with Checkpoints(tmp_path, keep=2, layout=grouped_layout) as ckpts:
        ckpts.save(1, state, data_iter_state={"i": 1}, config={"k": 1})
    per_layer = {item: grouped_layout.to_canonical(getattr(state, item)) for item in LAYOUT_ITEMS}
    for scan in (False, True):
        layout = run_layout(group_cfg(scan))
        with Checkpoints(tmp_path, keep=2, layout=layout) as ckpts:
            restored = ckpts.restore(1, abstract_state(group_cfg(scan))[1]).state
        want = ["0", "1-4/2", "5"] if scan else [str(i) for i in range(6)]
        assert sorted(restored.params["layers"]) == want
        for item in LAYOUT_ITEMS:
            assert leaves_equal(layout.to_canonical(getattr(restored, item)), per_layer[item])


def test_the_integrity_of_a_grouped_state_is_the_per_layer_one_on_disk(group_states):
    state = jiggled(group_states[True][1])
    on_disk = PerLayer(run_layout(group_cfg())).to_disk(state)
    assert sorted(on_disk.params["layers"]) == [str(i) for i in range(6)]
    stacked = state_integrity(state)
    assert stacked == state_integrity(on_disk) and stacked["finite"]
    assert not any("/" in path for path in stacked["checksums"])


def _recording_sgd() -> optax.GradientTransformation:
    """Leaves the parameters as they are and keeps the last gradients as its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (jax.tree.map(jnp.zeros_like, updates), updates),
    )


def _group_numerics_report() -> dict:
    """One train step of 4 BF16 blocks, dense and MoE alternating, per layer and as one group
    of 2 ("0-3/2"); run with `--xla_allow_excess_precision=false`. BF16: an NVFP4 step compiles
    in twice the time, and what NVFP4 adds per block (its SR keys) is checked directly by
    `test_each_block_of_a_scanned_group_gets_its_own_keys`."""
    report = {}
    for scan in (False, True):
        cfg = scan_cfg("bf16", scan=scan, layers=4, overrides=MOE_EVERY_OTHER)
        layout = run_layout(cfg)
        graphdef, state = initial(cfg, _recording_sgd())
        state, metrics = jax.jit(train_step_of(cfg, graphdef, _recording_sgd()))(state, batch(0))
        report[f"scan={scan}"] = {
            "layers": sorted(state.params["layers"]),
            "metrics": {k: np.asarray(v).tolist() for k, v in flat_paths(metrics).items()},
            "grads": digest(layout.to_canonical(state.opt_state)),
            "params": digest(layout.to_canonical(state.params)),  # the router bias moved
            "amax": {
                k: np.asarray(v).tolist() for k, v in flat_amax(state.activation_amax).items()
            },
        }
    return report


@pytest.fixture(scope="module")
def group_numerics() -> dict:
    code = f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import test_scan; " \
           "print(json.dumps(test_scan._group_numerics_report()))"  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_group_of_blocks_trains_bit_identically_to_its_layers(group_numerics):
    plain, grouped = group_numerics["scan=False"], group_numerics["scan=True"]
    assert grouped["layers"] == ["0-3/2"] and plain["layers"] == ["0", "1", "2", "3"]
    assert plain["metrics"]["grad_norm"] > 0 and plain["metrics"]["moe.layers.3.max_load"] > 0
    assert len(plain["amax"]) == 16 and all(
        np.all(np.asarray(v) > 0) for v in plain["amax"].values()
    )
    for item in ("metrics", "grads", "params", "amax"):  # loss, grad norm, MoE load and losses
        assert grouped[item] == plain[item], item


def test_each_block_of_a_scanned_group_gets_its_own_keys():
    # the SR keys of block start + q*period + j, as unstacked (`linear_keys`), for NVFP4
    key, segment = jax.random.key(7), Segment("2-7/3", 2, 8, 3)

    def apply(params, rest, x, keys, documents):
        return x + params, {"keys": jnp.stack([jax.random.key_data(k) for k in keys])}

    params = tuple(jnp.arange(2.0) + 10 * j for j in range(3))  # [repetitions] per block
    x, sown = scan_segment((apply,) * 3, params, (None,) * 3, jnp.zeros(()), key, segment)
    assert float(x) == sum(float(p.sum()) for p in params)
    for i in range(2, 8):
        q, j = divmod(i - 2, 3)
        expected = jnp.stack([jax.random.key_data(k) for k in layer_keys(key, i)])
        assert np.array_equal(sown[j]["keys"][q], expected), i
