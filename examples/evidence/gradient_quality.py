"""What each part of the NVFP4 recipe does to the gradients, measured on fixed operands.

Training runs at small scale are too noisy to rank the recipe's parts (16x16 weight tiles, random
Hadamard transform on the Wgrad operands, stochastic rounding of gradients), so this script measures
them directly. It takes the operands of every block linear of a BF16 Llama (`nvfp4_train`'s model)
on one fixed batch of the built-in data: x (the linear's input), w (its kernel) and dy (the gradient
of the mean token cross-entropy w.r.t. its output), from the freshly initialised model and, with
`--checkpoint RUN_DIR`, from the newest checkpoint of a trained run. For each recipe it runs the
quantized `nvfp4_ops.dot_general` forward and VJP with `--draws` stochastic-rounding keys and
compares with the FP32 reference (plain matmuls of the operands cast to float32):

- Fprop: relative error and cosine of y.
- Dgrad (dX) and Wgrad (dW): relative bias ||mean_k G_k - G|| / ||G|| with its noise floor
  sqrt(sum var / K) / ||G|| (the expected size of that norm for an unbiased estimator with the
  observed per-element variance), the same bias against the recipe with dy NOT quantized (the
  bias of rounding the gradient alone: x and w are quantized as in the recipe), and the mean
  single-draw cosine and relative error.
- Weight consistency ||Q_fprop(W) - Q_dgrad(W)^T|| / ||W||: Q_fprop quantizes W along K (as Fprop
  uses it), Q_dgrad along N (as Dgrad uses it); 0 when both are the same values (16x16 tiles,
  per-tensor FP8).
- Per operand role: amax, underflow, saturation and relative error (`nvfp4_ops.gemm_operand_stats`).

Writes gradients.json (per linear and mean/max over linears), gradients.md and gradients.png to
`--out-dir` and prints the tables.

    python examples/evidence/gradient_quality.py
    python examples/evidence/gradient_quality.py --checkpoint runs/evidence/bf16-s0

The default is 32 draws (not 64) to keep a run of the 24 linears of small.yaml within minutes on
two CPU cores; the noise floor is reported with the bias, so fewer draws only make it larger.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nvfp4_ops
from nvfp4_ops import gemm_operand_stats
from nvfp4_train import (
    Checkpoints,
    abstract_state,
    capture_linear_operands,
    initial_state,
    load_config,
    load_run_config,
    make_datasets,
    with_vocab_size,
)

RECIPE_NAMES = (
    "nvfp4",
    "nvfp4-no-sr",
    "nvfp4-no-rht",
    "nvfp4-no-2d",
    "nvfp4-naive",
    "nvfp4-4over6",
    "nvfp4-fwd-mxfp8-bwd",
    "nvfp4-per-token",
    "mxfp4",
    "fp8",
)
DIMS = (((1,), (0,)), ((), ()))  # x [M, K] . w [K, N]
HIGHEST = jax.lax.Precision.HIGHEST
DRAWS_PER_CHUNK = 8
GRADS = ("dgrad", "wgrad")
Operands = tuple[jax.Array, jax.Array, jax.Array]
Source = tuple[dict[str, Operands], str, dict[str, jax.Array]]  # operands, description, batch


# ----------------------------------------------------------------------------- operands


def fixed_batch(cfg) -> tuple[Any, dict[str, jax.Array]]:
    """(cfg with the data's vocabulary, the first validation batch, or the first train batch)."""
    data = make_datasets(
        cfg.data, seq_len=cfg.train.seq_len, batch_size=cfg.train.batch_size, seed=cfg.train.seed
    )
    batches = data.validation_batches()
    batch = batches[0] if batches else next(iter(data.train_iterator()))
    batch = {k: jnp.asarray(batch[k]) for k in ("inputs", "targets")}
    return with_vocab_size(cfg, data.vocab_size), batch


def init_operands(config: str, seed: int, overrides: list[str]) -> Source:
    """Operands of the freshly initialised BF16 model of `config` (seed `seed`)."""
    cfg = load_config(config, [*overrides, "precision.recipe=bf16", f"train.seed={seed}"])
    cfg, batch = fixed_batch(cfg)
    graphdef, state = initial_state(cfg)
    label = f"BF16 model at initialisation ({config}, seed {seed})"
    return capture_linear_operands(graphdef, state.params, batch), label, batch


def checkpoint_operands(run_dir: str) -> Source:
    """Operands of the newest checkpoint of the run in `run_dir` (its own config and batch)."""
    cfg, batch = fixed_batch(load_run_config(run_dir))
    graphdef, abstract = abstract_state(cfg)
    with Checkpoints(Path(run_dir) / "checkpoints", keep=cfg.checkpoint.keep) as ckpts:
        step = ckpts.latest_step()
        if step is None:
            raise ValueError(f"--checkpoint {run_dir!r} has no checkpoint under checkpoints/")
        restored = ckpts.restore(step, abstract)
    label = f"trained run {run_dir} at step {step} (recipe {cfg.precision.recipe})"
    return capture_linear_operands(graphdef, restored.state.params, batch), label, batch


def flat_f32(x: jax.Array, w: jax.Array, dy: jax.Array) -> Operands:
    """x [M, K], w [K, N], dy [M, N] in float32 (the captured values, tokens flattened)."""
    f32 = jnp.float32
    return (
        x.reshape(-1, x.shape[-1]).astype(f32),
        w.astype(f32),
        dy.reshape(-1, dy.shape[-1]).astype(f32),
    )


# ----------------------------------------------------------------------------- measurement


def _rel_cos(a: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(||a - ref|| / ||ref||, cosine of a and ref), flattened."""
    a, ref = a.reshape(-1), ref.reshape(-1)
    norm_ref = jnp.linalg.norm(ref)
    rel = jnp.linalg.norm(a - ref) / norm_ref
    return rel, jnp.dot(a, ref, precision=HIGHEST) / (jnp.linalg.norm(a) * norm_ref)


def _quantized_vjp(x, w, dy, recipe, key):
    """(y, dx, dw) of the recipe's quantized dot_general."""
    fn = lambda a, b: nvfp4_ops.dot_general(a, b, DIMS, recipe=recipe, key=key)  # noqa: E731
    y, vjp = jax.vjp(fn, x, w)
    return (y, *vjp(dy))


def _fake_quant(t: jax.Array, tq: nvfp4_ops.TensorQuant) -> jax.Array:
    return nvfp4_ops.fake_quantize(
        t, tq.fmt, tq.block_shape, "rne",
        block_scale_rule=tq.block_scale_rule, outer_scale=tq.outer_scale,
    )  # fmt: skip


def weight_consistency(w: jax.Array, recipe: nvfp4_ops.Recipe) -> jax.Array:
    """||Q_fprop(W) - Q_dgrad(W)^T|| / ||W||: W quantized along K (the Fprop settings) versus
    along N (the Dgrad settings), RNE."""
    q_fprop = _fake_quant(w.T, recipe.fprop_weight).T  # blocks along K, as Fprop's W^T
    q_dgrad = _fake_quant(w, recipe.setting("dgrad_weight"))  # blocks along N, as Dgrad's W
    return jnp.linalg.norm(q_fprop - q_dgrad) / jnp.linalg.norm(w)


@functools.partial(jax.jit, static_argnames=("recipe",))
def measure_gemms(x, w, dy, keys_CxD, recipe: nvfp4_ops.Recipe) -> dict[str, Any]:
    """Every number of one linear under one recipe; `keys_CxD` holds the draws in chunks."""
    y_ref = jnp.dot(x, w, precision=HIGHEST)
    refs = {
        "dgrad": jnp.dot(dy, w.T, precision=HIGHEST),
        "wgrad": jnp.dot(x.T, dy, precision=HIGHEST),
    }
    bf16 = nvfp4_ops.TensorQuant("bf16", None)
    exact_dy = dataclasses.replace(recipe, grad=bf16, wgrad_grad=None)  # dY unquantized in both
    _, *exact = _quantized_vjp(x, w, dy, exact_dy, keys_CxD[0, 0])

    def chunk(sums, keys_D):
        y, dx, dw = jax.vmap(lambda k: _quantized_vjp(x, w, dy, recipe, k))(keys_D)
        scalars = {"fprop": jax.vmap(_rel_cos, (0, None))(y, y_ref)}
        for name, g in zip(GRADS, (dx, dw), strict=True):
            scalars[name] = jax.vmap(_rel_cos, (0, None))(g, refs[name])
            dev = g - refs[name]
            sums[name] = (sums[name][0] + dev.sum(0), sums[name][1] + (dev * dev).sum(0))
        return sums, scalars

    zeros = {n: (jnp.zeros_like(r), jnp.zeros_like(r)) for n, r in refs.items()}
    sums, scalars = jax.lax.scan(chunk, zeros, keys_CxD)
    stats = gemm_operand_stats(x, w, dy, recipe, keys_CxD[0, 0])
    return {
        "scalars": jax.tree.map(lambda s: s.reshape(-1), scalars),
        "sums": sums,
        "refs": refs,
        "exact_dy": dict(zip(GRADS, exact, strict=True)),
        "roles": stats,
        "consistency": weight_consistency(w, recipe),
    }


def estimator_numbers(dev_sum, dev_sq_sum, ref, exact_dy, draws: int) -> dict[str, float]:
    """Bias, noise floor and dy-rounding bias of the mean of `draws` estimates of `ref`."""
    s1, s2 = np.asarray(dev_sum, np.float64), np.asarray(dev_sq_sum, np.float64)
    ref, exact = np.asarray(ref, np.float64), np.asarray(exact_dy, np.float64)
    norm = np.linalg.norm(ref)
    mean_dev = s1 / draws
    var = np.maximum(s2 / draws - mean_dev**2, 0.0) * (draws / (draws - 1) if draws > 1 else 0.0)
    return {
        "bias": float(np.linalg.norm(mean_dev) / norm),
        "noise_floor": float(np.sqrt(var.sum() / draws) / norm),
        "dy_rounding_bias": float(np.linalg.norm(mean_dev + ref - exact) / norm),
    }


def measure_linear(operands: Operands, recipe: nvfp4_ops.Recipe, key, draws: int) -> dict:
    """The JSON-ready numbers of one linear under one recipe."""
    x, w, dy = flat_f32(*operands)
    draws = draws if recipe.needs_key else 1  # RNE-only recipes are deterministic
    per_chunk = min(draws, DRAWS_PER_CHUNK)
    keys = jax.random.split(key, draws).reshape(draws // per_chunk, per_chunk)
    out = jax.device_get(measure_gemms(x, w, dy, keys, recipe))
    rel, cos = out["scalars"]["fprop"]
    row = {"fprop_rel_error": float(np.mean(rel)), "fprop_cos": float(np.mean(cos))}
    for name in GRADS:
        numbers = estimator_numbers(
            *out["sums"][name], out["refs"][name], out["exact_dy"][name], draws
        )
        rel, cos = out["scalars"][name]
        numbers |= {"cos": float(np.mean(cos)), "rel_error": float(np.mean(rel))}
        row |= {f"{name}_{k}": v for k, v in numbers.items()}
    row["weight_consistency"] = float(out["consistency"])
    row["roles"] = {r: {k: float(v) for k, v in s.items()} for r, s in out["roles"].items()}
    row["draws"] = draws
    return row


def summarise(per_linear: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Mean and max over linears of every scalar (roles flattened to `role.stat`)."""
    flat: dict[str, list[float]] = {}
    for row in per_linear.values():
        for k, v in row.items():
            if k == "roles":
                for role, stats in v.items():
                    for stat, value in stats.items():
                        flat.setdefault(f"{role}.{stat}", []).append(value)
            elif k != "draws":
                flat.setdefault(k, []).append(v)
    return {k: {"mean": float(np.mean(v)), "max": float(np.max(v))} for k, v in flat.items()}


def measure_source(operands, recipe_names, seed: int, draws: int, say) -> dict[str, Any]:
    """{recipe name: {"summary": ..., "per_linear": {path: ...}}} for one set of operands."""
    results = {}
    for name in recipe_names:
        start, recipe = time.perf_counter(), nvfp4_ops.get_recipe(name)
        per_linear = {}
        for index, (path, ops) in enumerate(operands.items()):
            key = jax.random.fold_in(jax.random.key(seed), index)
            per_linear[path] = measure_linear(ops, recipe, key, draws)
        results[name] = {"summary": summarise(per_linear), "per_linear": per_linear}
        say(f"  {name}: {len(per_linear)} linears in {time.perf_counter() - start:.1f} s")
    return results


# ----------------------------------------------------------------------------- output

GRADIENT_COLUMNS = (
    ("Fprop rel err", "fprop_rel_error"),
    ("Dgrad bias", "dgrad_bias"),
    ("Dgrad floor", "dgrad_noise_floor"),
    ("Dgrad dy-bias", "dgrad_dy_rounding_bias"),
    ("Dgrad cos", "dgrad_cos"),
    ("Wgrad bias", "wgrad_bias"),
    ("Wgrad floor", "wgrad_noise_floor"),
    ("Wgrad dy-bias", "wgrad_dy_rounding_bias"),
    ("Wgrad cos", "wgrad_cos"),
    ("Wgrad rel err", "wgrad_rel_error"),
    ("W consistency", "weight_consistency"),
)
ROLES = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_x", "wgrad_dy")


def _cell(summary: dict, key: str, stat: str = "mean") -> str:
    return f"{summary[key][stat]:.4f}" if key in summary else "-"


def gradient_table(results: dict[str, Any]) -> str:
    """Markdown table: one row per recipe, the mean over linears of each gradient number."""
    lines = ["| recipe | " + " | ".join(h for h, _ in GRADIENT_COLUMNS) + " |"]
    lines.append("|---" * (len(GRADIENT_COLUMNS) + 1) + "|")
    for name, res in results.items():
        cells = [_cell(res["summary"], key) for _, key in GRADIENT_COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def role_table(results: dict[str, Any]) -> str:
    """Markdown table: per role, mean rel_error and max underflow / saturation over linears."""
    header = " | ".join(f"{r} err (uf/sat max)" for r in ROLES)
    lines = [f"| recipe | {header} |", "|---" * (len(ROLES) + 1) + "|"]
    for name, res in results.items():
        s, cells = res["summary"], []
        for role in ROLES:
            if f"{role}.rel_error" not in s:
                cells.append("-")
                continue
            uf, sat = s[f"{role}.underflow"]["max"], s[f"{role}.saturation"]["max"]
            cells.append(f"{s[f'{role}.rel_error']['mean']:.4f} ({uf:.1e}/{sat:.1e})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


HOW_MEASURED = """\
How measured: `{command}`. Operands x (linear input), w (kernel) and dy (gradient of the mean
token cross-entropy w.r.t. the linear's output) of every block linear ({n_linears} per source:
{shapes}) of a BF16 model on one fixed batch of {tokens} tokens ({batch}) of the built-in data,
captured with `nvfp4_train.capture_linear_operands`, then cast to float32. The reference
is plain FP32 matmuls of those operands. Each recipe runs `nvfp4_ops.dot_general` forward + VJP
({backend} backend) with {draws} stochastic-rounding keys (1 for recipes without stochastic
rounding: they are deterministic). Bias = ||mean_k G_k - G|| / ||G||; floor = sqrt(sum var / K) /
||G||, the bias an unbiased estimator with the observed per-element variance would show after K
draws (bias ~ floor: no measurable bias); dy-bias = the same against the recipe with dy left
unquantized (x and w quantized as in the recipe), i.e. the bias of rounding the gradient alone;
cos and rel err are single-draw means. W consistency = ||Q(W along K) - Q(W along N)|| / ||W||
(0: Fprop and Dgrad see the same quantized weight). Every number is the mean over linears
(gradients.json also holds the max and each linear's values). Role table: relative quantization
error of each GEMM operand (mean over linears) with the largest underflow / saturation fraction
(`nvfp4_ops.gemm_operand_stats`; dgrad_w only where W is re-quantized for Dgrad)."""


def markdown(report: dict[str, Any]) -> str:
    """The whole gradients.md text."""
    parts = [
        "# Gradient quality per recipe part (fixed operands)",
        "",
        HOW_MEASURED.format(**report["how"]),
    ]
    for label, source in report["sources"].items():
        parts += ["", f"## {label}: {source['description']}", "", gradient_table(source["recipes"])]
        parts += [
            "",
            "Quantization error per GEMM operand role:",
            "",
            role_table(source["recipes"]),
        ]
    return "\n".join(parts) + "\n"


def _means(recipes: dict[str, Any], key: str) -> list[float]:
    return [res["summary"][key]["mean"] for res in recipes.values()]


def plot(report: dict[str, Any], path: Path) -> None:
    """Wgrad bias vs noise floor, and Wgrad cosine, per recipe and operand source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = report["sources"]
    fig, axes = plt.subplots(len(sources), 2, figsize=(12, 3.6 * len(sources)), squeeze=False)
    for row, (label, source) in enumerate(sources.items()):
        names = list(source["recipes"])
        mean = functools.partial(_means, source["recipes"])
        pos = np.arange(len(names))
        ax = axes[row, 0]
        ax.bar(pos - 0.27, mean("wgrad_bias"), 0.27, label="bias vs FP32")
        ax.bar(pos, mean("wgrad_dy_rounding_bias"), 0.27, label="bias of dy rounding alone")
        ax.bar(pos + 0.27, mean("wgrad_noise_floor"), 0.27, label="noise floor (unbiased)")
        ax.set_title(f"{label}: Wgrad relative bias (mean over linears)")
        ax.legend(fontsize=8)
        ax = axes[row, 1]
        cos = mean("wgrad_cos")
        ax.bar(pos, cos, 0.5, color="tab:green")
        ax.set_ylim(min(cos) - 0.2 * (1 - min(cos)) - 1e-4, 1.0)
        ax.set_title(f"{label}: Wgrad single-draw cosine to FP32")
        for ax in axes[row]:
            ax.set_xticks(pos, names, rotation=20, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out-dir", default="runs/evidence",
        help="where gradients.{json,md,png} go (pass docs/evidence to refresh the committed ones)",
    )  # fmt: skip
    p.add_argument(
        "--draws", type=int, default=32, help="stochastic-rounding keys per linear (64: ~2x time)"
    )
    p.add_argument("--checkpoint", default=None, help="run dir: also measure its newest checkpoint")
    p.add_argument("--config", default="examples/configs/small.yaml", help="model/data for init")
    p.add_argument("--seed", type=int, default=0, help="init seed and stochastic-rounding seed")
    p.add_argument("--no-init", action="store_true", help="skip the initialised model's operands")
    p.add_argument("--recipes", default=",".join(RECIPE_NAMES), help="comma-separated presets")
    p.add_argument("--linears", default=".*", help="regex on linear paths (layers.3.mlp.down)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = p.parse_args(argv)
    if args.draws < 2 or (args.draws > DRAWS_PER_CHUNK and args.draws % DRAWS_PER_CHUNK):
        raise ValueError(
            f"--draws must be 2..{DRAWS_PER_CHUNK} or a multiple of {DRAWS_PER_CHUNK} (a variance "
            f"needs two draws; larger counts run in chunks of {DRAWS_PER_CHUNK}), got {args.draws}"
        )
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    for r in args.recipes:
        nvfp4_ops.get_recipe(r)  # raises naming the allowed presets
    if args.no_init and args.checkpoint is None:
        raise ValueError("--no-init needs --checkpoint RUN_DIR (nothing to measure otherwise)")
    return args


def _selected(operands: dict[str, Operands], pattern: str) -> dict[str, Operands]:
    chosen = {p: o for p, o in operands.items() if re.search(pattern, p)}
    if not chosen:
        raise ValueError(f"--linears {pattern!r} matches none of {sorted(operands)}")
    return chosen


def _source_entry(operands, description, batch, args, say) -> dict[str, Any]:
    shapes = {p: {"M": int(np.prod(x.shape[:-1])), "K": w.shape[0], "N": w.shape[1]}
              for p, (x, w, _) in operands.items()}  # fmt: skip
    recipes = measure_source(operands, args.recipes, args.seed, args.draws, say)
    return {"description": description, "batch_shape": list(batch["inputs"].shape),
            "shapes": shapes, "recipes": recipes}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurement, write gradients.{json,md,png} to --out-dir; returns the report."""
    args = parse_args(argv)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    loaders = []
    if not args.no_init:
        loaders.append(("init", lambda: init_operands(args.config, args.seed, args.set)))
    if args.checkpoint is not None:
        loaders.append(("trained", lambda: checkpoint_operands(args.checkpoint)))
    sources, start = {}, time.perf_counter()
    for label, load in loaders:
        operands, description, batch = load()
        operands = _selected(operands, args.linears)
        say(f"{label}: {description}, {len(operands)} linears")
        sources[label] = _source_entry(operands, description, batch, args, say)
    first = next(iter(sources.values()))
    how = {
        "command": "python examples/evidence/gradient_quality.py " + " ".join(argv or sys.argv[1:]),
        "n_linears": len(first["shapes"]),
        "shapes": ", ".join(sorted({f"{s['K']}x{s['N']}" for s in first["shapes"].values()})),
        "tokens": next(iter(first["shapes"].values()))["M"],
        "batch": "x".join(map(str, first["batch_shape"])) + " [batch x seq]",
        "draws": args.draws,
        "backend": nvfp4_ops.auto_backend()[0],
    }
    report = {"how": how, "draws": args.draws, "seed": args.seed, "recipes": args.recipes,
              "seconds": round(time.perf_counter() - start, 1), "sources": sources}  # fmt: skip
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gradients.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "gradients.md").write_text(text)
    plot(report, out / "gradients.png")
    print(text)
    return report


if __name__ == "__main__":
    main()
