"""What each server does with a Nemotron-H export, read from its loading code, where that differs
from what training computed (`servers.check_servers` refuses it unless allowed) or where it cannot
load the layout at all.

| rule | vLLM | SGLang | TensorRT-LLM | transformers |
|---|---|---|---|---|
| Mamba dt clip (`time_step_limit`) | ignored: `MambaMixer2.conv_ssm_forward` passes `dt_limit=(0.0, inf)` (vllm/model_executor/layers/mamba/mamba2/mamba_mixer2.py) | not read here | ignored: `Mamba2Mixer` takes no limit and scans with `dt_limit=(0.0, inf)` (tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py) | applied (`NemotronHMamba2Mixer`: `dt_limit=self.time_step_limit`) |
| norms' eps | `layer_norm_epsilon` | `layer_norm_epsilon` (python/sglang/srt/models/nemotron_h.py, `NemotronHMambaDecoderLayer`) | `rms_norm_eps`, else `layer_norm_epsilon` (`NemotronHForCausalLM.__init__`) | `layer_norm_epsilon` |
| conv1d | never quantized (`quant_config=None`) | never quantized (`quant_config=None`) | a `Linear` with the checkpoint's quant config: excluded by name (`hybrid_names.conv1d_modules`) | an `nn.Conv1d` |
| MXFP8 linears | compressed-tensors: `CompressedTensorsW8A8Mxfp8`; ModelOpt mixed: no (FP8 stand-in) | ModelOpt mixed: no (FP8 stand-in) | `QuantAlgo` has no MXFP8 (tensorrt_llm/quantization/mode.py): no compressed-tensors MXFP8 group | compressed-tensors `mxfp8-quantized` |

Example:
    >>> from nvfp4_export.hybrid_spec import HybridSpec
    >>> class Spec:
    ...     hybrid = HybridSpec("M", 4, 16, 16, 2, time_step_limit=(0.0, 0.1))
    ...     rms_norm_eps = 1e-5
    >>> [line.split(":")[0] for line in hybrid_differences("vllm", Spec())]
    ['the Mamba dt clip time_step_limit=[0.0, 0.1]']
"""

from __future__ import annotations

IGNORES_DT_CLIP = {
    "vllm": "vllm/model_executor/layers/mamba/mamba2/mamba_mixer2.py, MambaMixer2."
            "conv_ssm_forward: dt_limit=(0.0, inf)",
    "tensorrt-llm": "tensorrt_llm/_torch/modules/mamba/mamba2_mixer.py, Mamba2Mixer: no "
                    "time_step_limit, dt_limit=(0.0, inf)",
}  # fmt: skip
"""Servers whose Mamba scan ignores config.json's `time_step_limit` (and where it is read)."""


def hybrid_differences(server: str, spec) -> tuple[str, ...]:
    """How `server` would compute an export of hybrid `spec` other than training did (empty
    when it serves it as trained, or for a non-hybrid spec)."""
    hy = getattr(spec, "hybrid", None)
    if hy is None or "mamba" not in map(hy.kind, range(len(hy.pattern))):
        return ()
    out = []
    if hy.time_step_limit and server in IGNORES_DT_CLIP:
        out.append(f"the Mamba dt clip time_step_limit={list(hy.time_step_limit)}: {server} "
                   f"scans without it ({IGNORES_DT_CLIP[server]})")  # fmt: skip
    return tuple(out)


def hybrid_layout_refusal(server: str, plan) -> str | None:
    """Why `server` cannot load a layout holding 8-bit linears, or None."""
    if server == "transformers" and plan.layout == "compressed-tensors" and plan.fmt == "mixed":
        return (
            "transformers + compressed-tensors dequantizes every dense module with ONE config "
            "group (transformers/integrations/compressed_tensors.py, get_dense_scheme: the first "
            "group not targeting experts), so a mixed NVFP4 + MXFP8 export fails to load "
            "(transformers 5.25). Dequantize with compressed-tensors first "
            "(nvfp4_export.clients.moe_dense_copy), or leave transformers out of --server"
        )
    if (
        server == "tensorrt-llm"
        and plan.layout == "compressed-tensors"
        and "mxfp8" in (plan.formats)
    ):
        return (
            "TensorRT-LLM has no MXFP8 quantization (tensorrt_llm/quantization/mode.py, "
            "QuantAlgo), so its compressed-tensors reader cannot map the MXFP8 group; export "
            "--layout modelopt for it (MXFP8 stored as FP8 per tensor)"
        )
    return None
