"""A hybrid Mamba-2 + attention decoder (`model.architecture: nemotron_h`): its block pattern,
the Mamba mixer's shape, its parameter tree, and what export refuses.

The training package builds one mixer per block, `x + mixer(norm(x))`, the block's kind given by
`model.pattern` (Nemotron's letters: `M` Mamba-2, `*` attention, `-` MLP, `E` Mixture-of-Experts;
docs/hybrid.md). Parameters of block `i` (float32, kernels [in, out]):

    layers.{i}.norm.scale [D]                                         every block
    M: layers.{i}.mamba.in_proj.kernel [D, W]   W = 2 d_inner + 2 G N + H   (z | x, B, C | dt)
       layers.{i}.mamba.conv1d.kernel [K, C], .conv1d.bias [C]        C = d_inner + 2 G N
       layers.{i}.mamba.dt_bias, .A_log, .D [H]; layers.{i}.mamba.norm.scale [d_inner]
       layers.{i}.mamba.out_proj.kernel [d_inner, D]
    *: layers.{i}.attn.qkv.kernel [D, (Hq + 2 Hkv) K], layers.{i}.attn.o.kernel [Hq K, D]
    -: layers.{i}.mlp.up.kernel [D, F], layers.{i}.mlp.down.kernel [F, D]   (squared ReLU)

The quantizable linears are in_proj / out_proj, qkv / o and up / down; the conv, the SSM
parameters and the norms never quantize. `E` blocks (Nemotron 3's MoE: sigmoid router with
`e_score_correction_bias`, relu2 experts, shared expert) are refused for now: their names are
`hybrid_names.MOE_NAMES`, ready for the training package's MoE block.

Example:
    >>> hy = HybridSpec("M*-", mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
    ...                 n_groups=2)
    >>> hy.block_linear_names(0), hy.in_proj_width
    (('mamba.in_proj', 'mamba.out_proj'), 196)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from nvfp4_export.errors import ExportError

HYBRID_ARCHITECTURE = "nemotron_h"
"""The `model.architecture` whose blocks follow `model.pattern` (`NemotronHForCausalLM`)."""
LETTERS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
"""Nemotron's pattern letters (config.json `hybrid_override_pattern`) -> block kinds."""
BLOCK_LINEARS = {
    "mamba": ("mamba.in_proj", "mamba.out_proj"),
    "attention": ("attn.qkv", "attn.o"),
    "mlp": ("mlp.up", "mlp.down"),
}
"""A hybrid block's quantizable linears by kind (training's order)."""
NEVER_QUANTIZED = ("norm", "mamba.conv1d", "mamba.norm", "mamba.A_log", "mamba.D", "mamba.dt_bias")
"""A hybrid block's modules that are not linears: no recipe may quantize them (training runs the
conv, the scan and the gated norm in float32; vLLM builds conv1d with `quant_config=None`,
vllm/model_executor/layers/mamba/mamba_mixer2.py, `MambaMixer2.__init__`)."""
MAMBA_DEFAULTS = {
    "num_heads": 128, "head_dim": 64, "state_dim": 128, "n_groups": 8, "d_inner": 0,
    "conv_kernel": 4, "conv_bias": True, "proj_bias": False, "chunk_size": 128,
    "time_step_limit": (),
}  # fmt: skip
"""Training's `MambaConfig` defaults (a key absent from a checkpoint's config has this value)."""


@dataclasses.dataclass(frozen=True)
class HybridSpec:
    """The hybrid part of a model spec (`LlamaSpec.hybrid`): the pattern and the Mamba mixer.

    Attributes:
        pattern: one letter per block (`LETTERS`).
        mamba_num_heads, mamba_head_dim: SSM heads H and their width P (d_inner = H * P).
        ssm_state_size: the state size N; n_groups: the B/C groups G.
        conv_kernel: the depthwise conv's width K; conv_bias: it has a bias.
        chunk_size: the chunk of the SSD scan (numerics only; servers read it).
        time_step_limit: [low, high] dt is clipped to after softplus, or () for none.
    """

    pattern: str
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int = 4
    conv_bias: bool = True
    chunk_size: int = 128
    time_step_limit: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "time_step_limit", tuple(self.time_step_limit))
        unknown = sorted(set(self.pattern) - set(LETTERS))
        if unknown:
            raise ExportError(f"model.pattern has unknown letters {unknown}; the letters are "
                              f"{''.join(LETTERS)}")  # fmt: skip

    @property
    def d_inner(self) -> int:
        """The Mamba mixer's inner width H * P."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x (d_inner), then B and C (G * N each)."""
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_width(self) -> int:
        """in_proj's output rows: z (d_inner) | x, B, C (conv_dim) | dt (H)."""
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    def kind(self, i: int) -> str:
        """The kind of block `i`: "mamba", "attention", "mlp" or "moe"."""
        return LETTERS[self.pattern[i]]

    def block_linear_names(self, i: int) -> tuple[str, ...]:
        """The quantizable linears of block `i`, relative to `layers.{i}`."""
        return BLOCK_LINEARS[self.kind(i)]

    def layer_params(self, spec) -> dict[str, tuple[int, ...]]:
        """Every block's parameter path (`layers.{i}.norm.scale`, ...) -> shape, for the
        `LlamaSpec` `spec` this is the `hybrid` of."""
        o_in, qkv = spec.num_heads * spec.head_dim, sum(spec.qkv_split)
        return {
            f"layers.{i}.{name}": shape
            for i in range(len(self.pattern))
            for name, shape in self._block_shapes(i, spec.d_model, spec.mlp_dim, qkv, o_in).items()
        }

    def _block_shapes(self, i: int, d: int, mlp: int, qkv_rows: int, o_in: int) -> dict:
        """Block `i`'s parameters (relative to `layers.{i}.`) -> shapes, for model width `d`,
        MLP width `mlp`, q|k|v rows `qkv_rows` and attention output width `o_in`."""
        kind, h = self.kind(i), self.mamba_num_heads
        if kind == "attention":
            blocks = {"attn.qkv.kernel": (d, qkv_rows), "attn.o.kernel": (o_in, d)}
        elif kind == "mlp":
            blocks = {"mlp.up.kernel": (d, mlp), "mlp.down.kernel": (mlp, d)}
        else:
            blocks = {
                "mamba.in_proj.kernel": (d, self.in_proj_width),
                "mamba.conv1d.kernel": (self.conv_kernel, self.conv_dim),
                "mamba.dt_bias": (h,), "mamba.A_log": (h,), "mamba.D": (h,),
                "mamba.norm.scale": (self.d_inner,), "mamba.out_proj.kernel": (self.d_inner, d),
            }  # fmt: skip
            if self.conv_bias:
                blocks["mamba.conv1d.bias"] = (self.conv_dim,)
        return {"norm.scale": (d,), **blocks}

    def widths(self) -> dict[str, int]:
        """The linear input widths that must be multiples of 16 (NVFP4 blocks), by name."""
        if "mamba" not in map(LETTERS.get, self.pattern):
            return {}
        return {"model.mamba d_inner (num_heads * head_dim)": self.d_inner,
                "the Mamba in_proj output width (16x16 weight tiles)": self.in_proj_width}  # fmt: skip


def _letters(pattern: str | Sequence[str]) -> str:
    if isinstance(pattern, str):
        return pattern
    kinds = {kind: letter for letter, kind in LETTERS.items()}
    unknown = [k for k in pattern if k not in kinds]
    if unknown:
        raise ExportError(f"model.pattern has unknown block kinds {unknown}; the kinds are "
                          f"{list(kinds)}")  # fmt: skip
    return "".join(kinds[k] for k in pattern)


def _mamba(model: Mapping[str, Any]) -> dict[str, Any]:
    section = model.get("mamba") if isinstance(model.get("mamba"), Mapping) else {}
    return {key: section.get(key, default) for key, default in MAMBA_DEFAULTS.items()}


def _refusal(model: Mapping[str, Any], letters: str, mamba: dict) -> str | None:
    """Why a nemotron_h run cannot be exported as `NemotronHForCausalLM`, or None."""
    moe = [i for i, letter in enumerate(letters) if letter == "E"]
    if moe:
        return (f"model.pattern has Mixture-of-Experts blocks (E at blocks {moe[:8]}); exporting "
                "Nemotron-H's MoE blocks is not implemented yet (M, * and - blocks are)")  # fmt: skip
    if int(model.get("num_layers", len(letters))) != len(letters):
        return f"model.pattern has {len(letters)} blocks, model.num_layers {model['num_layers']}"
    checks = (
        (model.get("rope", True), "model.rope: true; NemotronHForCausalLM's attention has no "
         "position embedding (transformers, vLLM and TensorRT-LLM build none)"),
        (model.get("mlp_activation", "swiglu") != "relu2", f"model.mlp_activation="
         f"{model.get('mlp_activation', 'swiglu')!r}; NemotronHForCausalLM's MLP is relu2"),
        (mamba["proj_bias"], "model.mamba.proj_bias: true (in_proj/out_proj biases are not "
         "exported yet)"),
        (model.get("tie_embeddings", False), "model.tie_embeddings: true; NemotronHForCausalLM "
         "has no tied head (transformers' _tied_weights_keys is empty, vLLM builds its own)"),
        (mamba["d_inner"] not in (0, mamba["num_heads"] * mamba["head_dim"]),
         "model.mamba.d_inner other than num_heads * head_dim"),
    )  # fmt: skip
    return next((why for bad, why in checks if bad), None)


def hybrid_fields(model: Mapping[str, Any]) -> dict[str, HybridSpec]:
    """{"hybrid": HybridSpec} for a nemotron_h training config's `model:` section, else {}.

    Raises:
        ExportError: a pattern without nemotron_h (or the reverse), MoE (`E`) blocks, or a model
            `NemotronHForCausalLM` does not build (RoPE, a gated MLP, projection biases, a tied
            head), one line naming it.
    """
    arch, pattern = str(model.get("architecture", "llama")), model.get("pattern") or ""
    if (arch == HYBRID_ARCHITECTURE) != bool(pattern):
        raise ExportError(f"model.pattern {pattern!r} with model.architecture={arch!r}: a pattern "
                          f"goes with {HYBRID_ARCHITECTURE!r} and only with it")  # fmt: skip
    if not pattern:
        return {}
    letters, mamba = _letters(pattern), _mamba(model)
    why = _refusal(model, letters, mamba)
    if why:
        raise ExportError(f"cannot export this {HYBRID_ARCHITECTURE} run: {why}")
    spec = HybridSpec(
        letters, int(mamba["num_heads"]), int(mamba["head_dim"]), int(mamba["state_dim"]),
        int(mamba["n_groups"]), int(mamba["conv_kernel"]), bool(mamba["conv_bias"]),
        int(mamba["chunk_size"]), tuple(float(v) for v in mamba["time_step_limit"] or ()),
    )  # fmt: skip
    return {"hybrid": spec}


def never_quantized_refusal(
    hybrid: HybridSpec,
    recipes: Mapping[str, str],
    overrides: Sequence[str],
    linear_paths: Sequence[str],
) -> None:
    """Raises ExportError (one line) when the checkpoint's recipe list would quantize a module
    that never quantizes (`NEVER_QUANTIZED`), or a `precision.overrides` entry names only such
    modules (training refuses it: an override applies to linears, `linear_paths`)."""
    never = [f"layers.{i}.{m}" for i in range(len(hybrid.pattern)) for m in NEVER_QUANTIZED]
    for path in never:
        recipe = recipes.get(path, "bf16")
        if recipe != "bf16":
            raise ExportError(f"quant_stats.recipes would quantize {path} with {recipe!r}; "
                              f"{_NEVER}")  # fmt: skip
    for text in overrides:
        pattern = re.compile(str(text).rpartition("=")[0].strip())
        hit = next((path for path in never if pattern.fullmatch(path)), None)
        if hit and not any(pattern.fullmatch(path) for path in linear_paths):
            raise ExportError(f"precision.overrides entry {text!r} would quantize {hit}; "
                              f"{_NEVER}")  # fmt: skip


_NEVER = ("Mamba's conv, A_log, D, dt_bias and the norms never quantize (training runs them in "
          "float32 and no server has a quantized kernel for them); only linears take a recipe")  # fmt: skip
