"""Fixtures: tiny fake runs written with orbax directly in the training schema (no nvfp4_train)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nvfp4_export.checkpoint import (
    CONFIG_ITEM,
    INTEGRITY_ALGORITHM,
    INTEGRITY_ITEM,
    JSON_CHECKSUMS,
    PARAMS_ITEM,
    QUANT_STATS_ITEM,
    REFERENCE_ITEM,
    checksums,
)
from nvfp4_export.json_files import json_sha256

VOCAB = 257  # byte tokenizer: 256 bytes + <|endoftext|>


def model_config(**overrides) -> dict:
    model = {
        "vocab_size": VOCAB, "d_model": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
        "head_dim": 0, "mlp_dim": 96, "max_seq_len": 32, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_embeddings": False, "init_std": 0.02, "dtype": "bfloat16",
    }  # fmt: skip
    model.update(overrides)
    return model


def random_params(model: dict, seed: int = 0) -> dict:
    """A params tree of the training model's form (float32; norms near 1, like trained ones)."""
    if model.get("pattern"):
        return hybrid_params(model, seed)
    rng = np.random.default_rng(seed)
    d, f, v, n = model["d_model"], model["mlp_dim"], model["vocab_size"], model["num_layers"]
    hd = model["head_dim"] or d // model["num_heads"]
    nh, nkv = model["num_heads"], model["num_kv_heads"]

    def w(*shape, std=0.05):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(size=d):
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    layers = {
        str(i): {
            "attn_norm": {"scale": norm()},
            "mlp_norm": {"scale": norm()},
            "attn": {"qkv": {"kernel": w(d, (nh + 2 * nkv) * hd)}, "o": {"kernel": w(nh * hd, d)}},
            "mlp": moe_mlp(model, w)
            if is_moe(model, i)
            else {"gate_up": {"kernel": w(d, 2 * f)}, "down": {"kernel": w(f, d)}},
        }
        for i in range(n)
    }
    for layer in layers.values():  # the architecture options (model_spec.ARCHITECTURE_OPTIONS)
        attn = layer["attn"]
        if model.get("qkv_bias"):
            attn["qkv"]["bias"] = w((nh + 2 * nkv) * hd, std=0.5)
        if model.get("o_bias"):
            attn["o"]["bias"] = w(d, std=0.5)
        if model.get("qk_norm"):
            attn["q_norm"], attn["k_norm"] = {"scale": norm(hd)}, {"scale": norm(hd)}
    params = {
        "embed": {"embedding": w(v, d, std=0.5)},
        "layers": layers,
        "final_norm": {"scale": norm()},
    }
    if not model["tie_embeddings"]:
        params["lm_head"] = {"kernel": w(d, v, std=0.2)}
    return params


HYBRID_LINEARS = {"M": ("mamba.in_proj", "mamba.out_proj"), "*": ("attn.qkv", "attn.o"),
                  "-": ("mlp.up", "mlp.down"), "E": ("mlp.experts.gate_up", "mlp.experts.down")}  # fmt: skip
"""A hybrid block's quantizable linears by pattern letter (training's names)."""


def hybrid_params(model: dict, seed: int = 0) -> dict:
    """A `nemotron_h` params tree of the training model's form (float32): per block `norm` and
    one mixer (Mamba-2 with its conv, dt_bias, A_log, D and gated norm; attention; relu2 MLP)."""
    rng = np.random.default_rng(seed)
    d, f, v, m = model["d_model"], model["mlp_dim"], model["vocab_size"], model["mamba"]
    hd = model["head_dim"] or d // model["num_heads"]
    nh, nkv = model["num_heads"], model["num_kv_heads"]
    heads, inner = m["num_heads"], m["num_heads"] * m["head_dim"]
    conv = inner + 2 * m["n_groups"] * m["state_dim"]

    def w(*shape, std=0.05):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(size=d):
        return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    def block(letter):
        if letter == "*":
            return {"attn": {"qkv": {"kernel": w(d, (nh + 2 * nkv) * hd)},
                             "o": {"kernel": w(nh * hd, d)}}}  # fmt: skip
        if letter == "-":
            return {"mlp": {"up": {"kernel": w(d, f)}, "down": {"kernel": w(f, d)}}}
        if letter == "E":  # the refused MoE block: a placeholder of the Llama-style MoE's form
            return {"mlp": moe_mlp(model, w)}
        return {"mamba": {
            "in_proj": {"kernel": w(d, inner + conv + heads)}, "out_proj": {"kernel": w(inner, d)},
            "conv1d": {"kernel": w(m.get("conv_kernel", 4), conv, std=0.3), "bias": w(conv, std=0.1)},
            "dt_bias": np.log(np.expm1(rng.uniform(0.01, 0.1, heads))).astype(np.float32),
            "A_log": np.log(rng.uniform(1, 16, heads)).astype(np.float32),
            "D": norm(heads), "norm": {"scale": norm(inner)},
        }}  # fmt: skip

    layers = {str(i): {"norm": {"scale": norm()}, **block(c)} for i, c in enumerate(model["pattern"])}  # fmt: skip
    return {"embed": {"embedding": w(v, d, std=0.5)}, "layers": layers,
            "final_norm": {"scale": norm()}, "lm_head": {"kernel": w(d, v, std=0.2)}}  # fmt: skip


def is_moe(model: dict, i: int) -> bool:
    """Whether block `i` of `model` is an MoE block (training's rule)."""
    moe = model.get("moe") or {}
    return (
        bool(moe.get("num_experts"))
        and (i + 1) % moe.get("layer_freq", 1) == 0
        and (i not in moe.get("dense_layers", ()) and i >= moe.get("first_dense_layers", 0))
    )


def moe_mlp(model: dict, w) -> dict:
    """An MoE block's `mlp` params (router, experts, shared expert and its gate)."""
    moe, d = model["moe"], model["d_model"]
    e, f = moe["num_experts"], moe["expert_mlp_dim"]
    mlp = {
        "router": {"kernel": w(d, e, std=0.3), "score_bias": np.zeros(e, np.float32)},
        "experts": {"gate_up": {"kernel": w(e, d, 2 * f)}, "down": {"kernel": w(e, f, d)}},
    }
    if moe.get("shared_experts"):
        s = moe["shared_experts"] * (moe.get("shared_expert_mlp_dim") or f)
        mlp["shared"] = {"gate_up": {"kernel": w(d, 2 * s)}, "down": {"kernel": w(s, d)}}
    if moe.get("shared_expert_gate"):
        mlp["shared_gate"] = {"kernel": w(d, 1, std=0.3)}
    return mlp


def write_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer.json like the training data package's byte tokenizer writes."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = [b for b in range(256) if b not in printable]
    chars = dict(
        zip(
            [*printable, *extra], map(chr, [*printable, *range(256, 256 + len(extra))]), strict=True
        )
    )
    hf = tokenizers.Tokenizer(models.BPE(vocab={c: b for b, c in chars.items()}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|endoftext|>"])
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


MOE_NAMES = ("attn.qkv", "attn.o", "mlp.experts.gate_up", "mlp.experts.down")


def trained_stats(model: dict) -> dict:
    """A `quant_stats` item as training writes it: an activation amax for every linear (a list
    of one per expert for an MoE block's experts)."""
    names = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")
    amax: dict = {}
    for i in range(model["num_layers"]):
        block = HYBRID_LINEARS[model["pattern"][i]] if model.get("pattern") else names
        if is_moe(model, i):
            shared = ("mlp.shared.gate_up", "mlp.shared.down")
            block = MOE_NAMES + shared * bool(model["moe"].get("shared_experts"))
        for n in block:
            k = len(amax)
            amax[f"layers.{i}.{n}"] = (
                [2.0 + 0.25 * k + 0.125 * e for e in range(model["moe"]["num_experts"])]
                if ".experts." in n else 2.0 + 0.25 * k
            )  # fmt: skip
    return {"activation_amax": amax}


def _flat(tree: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def integrity_item(params: dict, json_items: dict | None) -> dict:
    """The `integrity` item training writes (docs/checkpoint-schema.md): checksums of every
    parameter and, unless `json_items` is None (an older nvfp4-train), the SHA-256 of the
    canonical JSON of each JSON item given (None values: items not saved)."""
    item = {
        "algorithm": INTEGRITY_ALGORITHM,
        "finite": True,
        "checksums": {f"params.{k}": checksums(v) for k, v in _flat(params).items()},
    }
    if json_items is not None:
        item[JSON_CHECKSUMS] = {k: json_sha256(v) for k, v in json_items.items() if v is not None}
    return item


def write_run(
    run_dir: Path,
    *,
    model: dict | None = None,
    precision: dict | None = None,
    steps: tuple[int, ...] = (2,),
    quant_stats: dict | None | str = "trained",
    reference: dict | None = None,
    seed: int = 0,
    integrity: str | None = "full",
) -> Path:
    """Writes run_dir/{config.yaml, tokenizer/, checkpoints/<step>/{params, config, ...}}.

    `quant_stats`: "trained" (default) writes activation amaxes as training does
    (`trained_stats`); None writes no `quant_stats` item (a checkpoint without statistics).
    `integrity`: "full" (default) writes the `integrity` item as training does (parameter
    checksums and the config and quant_stats checksums), "params" as training did before the
    config was checksummed, None none (a checkpoint older than checksums).
    """
    import orbax.checkpoint as ocp
    import yaml

    model = model or model_config()
    if quant_stats == "trained":
        quant_stats = trained_stats(model)
    config = {
        "output_dir": str(run_dir),
        "model": model,
        "precision": precision or {"recipe": "nvfp4"},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    write_tokenizer(run_dir / "tokenizer")
    options = ocp.CheckpointManagerOptions(max_to_keep=10, create=True)
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), options=options) as manager:
        for k, step in enumerate(steps):
            params = random_params(model, seed + k)
            items = {
                PARAMS_ITEM: ocp.args.StandardSave(params),
                CONFIG_ITEM: ocp.args.JsonSave(config),
            }
            if integrity is not None:
                json_items = {CONFIG_ITEM: config, QUANT_STATS_ITEM: quant_stats}
                item = integrity_item(params, json_items if integrity == "full" else None)
                items[INTEGRITY_ITEM] = ocp.args.JsonSave(item)
            if quant_stats is not None:
                items[QUANT_STATS_ITEM] = ocp.args.JsonSave(quant_stats)
            if reference is not None:
                items[REFERENCE_ITEM] = ocp.args.StandardSave(reference)
            manager.save(step, args=ocp.args.Composite(**items), force=True)
        manager.wait_until_finished()
    return run_dir


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """A 4-block NVFP4 run (blocks 0 and 3 BF16 by the rule), two checkpoints (steps 2 and 4)."""
    return write_run(tmp_path_factory.mktemp("runs") / "tiny", steps=(2, 4))


def add_pytree_item(step_dir: Path, name: str, tree: dict) -> None:
    """Writes an orbax PyTree item (e.g. `reference`) into an existing step directory."""
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save((step_dir / name).absolute(), tree)


SMALL_MODEL = {"d_model": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 32,
               "max_seq_len": 16}  # fmt: skip
"""The smallest model with one NVFP4 block (0) and one BF16 block (1) by the policy rule."""
ARCH_CASES = {
    "llama": {},
    "llama-bias": {"qkv_bias": True, "o_bias": True},
    "llama-tied": {"tie_embeddings": True},
    "mistral": {"architecture": "mistral"},
    "qwen2": {"architecture": "qwen2", "qkv_bias": True},
    "qwen3": {"architecture": "qwen3", "qk_norm": True},
    "qwen3-bias": {"architecture": "qwen3", "qkv_bias": True, "o_bias": True, "qk_norm": True},
}
"""Every architecture and option training builds (its `ModelConfig` check), tied heads included."""
MOE = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 32}
MOE_CASES = {
    "qwen3_moe": {"architecture": "qwen3_moe", "qk_norm": True, "moe": MOE},
    "mixtral": {"architecture": "mixtral", "moe": MOE},
    "qwen2_moe": {"architecture": "qwen2_moe", "qkv_bias": True, "moe": {
        **MOE, "shared_experts": 1, "shared_expert_mlp_dim": 48, "shared_expert_gate": True,
        "norm_topk_prob": False}},
}  # fmt: skip
"""The Mixture-of-Experts classes (2 blocks, 4 experts, top-2): block 0 NVFP4, block 1 BF16 by
the policy rule, so both an FP4 and a BF16 MoE block are exported."""


@pytest.fixture(scope="session")
def moe_runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny trained run (per-expert activation amax in `quant_stats`) per `MOE_CASES` entry."""
    root = tmp_path_factory.mktemp("moe_runs")
    return {
        case: write_run(root / case, model=model_config(**SMALL_MODEL, **options))
        for case, options in MOE_CASES.items()
    }


@pytest.fixture(scope="session")
def arch_runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny trained run (activation amax in `quant_stats`) per `ARCH_CASES` entry."""
    root = tmp_path_factory.mktemp("arch_runs")
    return {
        case: write_run(root / case, model=model_config(**SMALL_MODEL, **options))
        for case, options in ARCH_CASES.items()
    }


def set_scalar_and_reseal(export_dir: Path, tensor: str, value: float) -> None:
    """Overwrites the float32 scalar `tensor` of an export in place and re-seals its manifest
    (what an export bug that writes a wrong value would leave: the checksums agree)."""
    from nvfp4_export.manifest import FILES, MANIFEST, SELF_SHA256, seal
    from nvfp4_format.safetensors_header import read_safetensors_header

    index = export_dir / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][tensor] if index.is_file() else None
    path = export_dir / (file or "model.safetensors")
    info = read_safetensors_header(path).tensors[tensor]
    data = bytearray(path.read_bytes())
    data[info.begin : info.begin + 4] = np.float32(value).tobytes()
    path.write_bytes(bytes(data))
    manifest = json.loads((export_dir / MANIFEST).read_text())
    files = list(manifest.pop(FILES))
    manifest.pop(SELF_SHA256)
    (export_dir / MANIFEST).write_text(json.dumps(seal(manifest, export_dir, files)))


HYBRID = {"architecture": "nemotron_h", "pattern": "M*-M", "num_layers": 4, "d_model": 32,
          "num_heads": 2, "num_kv_heads": 1, "mlp_dim": 32, "max_seq_len": 16,
          "mlp_activation": "relu2", "rope": False,
          "mamba": {"num_heads": 16, "head_dim": 4, "state_dim": 8, "n_groups": 2,
                    "chunk_size": 8}}  # fmt: skip
"""The smallest Nemotron-H with every dense block kind: Mamba (d_inner 64, in_proj 176 rows),
attention, relu2 MLP, and a last Mamba block that both policies keep in BF16."""


def super_stats(model: dict) -> dict:
    """The `quant_stats` nvfp4-train writes for `model` under `precision.preset:
    nemotron-3-super`: Mamba in_proj and the MLPs NVFP4, out_proj MXFP8, attention BF16, the
    last round(0.15 L) blocks BF16; an activation amax for every quantized linear."""
    last = int(0.15 * model["num_layers"] + 0.5)
    recipes = {}
    for i, letter in enumerate(model["pattern"]):
        for name in HYBRID_LINEARS[letter]:
            bf16 = i >= model["num_layers"] - last or name.startswith("attn.")
            recipes[f"layers.{i}.{name}"] = "bf16" if bf16 else (
                "mxfp8" if name == "mamba.out_proj" else "nvfp4")  # fmt: skip
    amax = trained_stats(model)["activation_amax"]
    return {"recipes": recipes, "activation_amax": {p: amax[p] for p, r in recipes.items()
                                                    if r != "bf16"}}  # fmt: skip


HYBRID_POLICIES = {
    "nvfp4": {"recipe": "nvfp4", "bf16_first_layers": 0, "bf16_last_layers": 1},
    "super": {"recipe": "nvfp4", "preset": "nemotron-3-super"},
}
"""The two Nemotron-H runs: every kind in NVFP4 but the last block (the plain NVFP4 layout of
NVIDIA's Nemotron Nano checkpoints), and Nemotron 3 Super's mixed policy (MIXED_PRECISION)."""


@pytest.fixture(scope="session")
def hybrid_runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny Nemotron-H run per `HYBRID_POLICIES` entry."""
    root, model = tmp_path_factory.mktemp("hybrid_runs"), model_config(**HYBRID)
    stats = {"nvfp4": trained_stats(model), "super": super_stats(model)}
    return {case: write_run(root / case, model=model, precision=precision,
                            quant_stats=stats[case])
            for case, precision in HYBRID_POLICIES.items()}  # fmt: skip


HYBRID_EXPORTS = (("nvfp4", "modelopt"), ("nvfp4", "compressed-tensors"), ("nvfp4", "bf16"),
                  ("super", "modelopt"), ("super", "compressed-tensors"))  # fmt: skip


@pytest.fixture(scope="session")
def hybrid_exports(hybrid_runs, tmp_path_factory) -> dict:
    """(case, layout) -> (`ExportResult`, its log lines) of every `HYBRID_EXPORTS` export."""
    from nvfp4_export import export_hf

    root, out = tmp_path_factory.mktemp("hybrid_exports"), {}
    for case, layout in HYBRID_EXPORTS:
        lines: list[str] = []
        result = export_hf(hybrid_runs[case], root / f"{case}-{layout}", layout=layout,
                           log=lines.append)  # fmt: skip
        out[case, layout] = (result, lines)
    return out
