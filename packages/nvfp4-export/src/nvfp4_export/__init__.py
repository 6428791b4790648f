"""nvfp4_export: trained NVFP4 checkpoints -> files that inference servers and Hugging Face load.

Reads checkpoints through their on-disk schema (docs/export.md) and quantizes with `nvfp4_format`
exactly as training's forward pass did, so an export adds no quantization error of its own.

Example:
    >>> from nvfp4_export import export_hf, verify  # doctest: +SKIP
    >>> export_hf("runs/tiny", "runs/tiny-ct", layout="compressed-tensors")  # doctest: +SKIP
    >>> verify("runs/tiny-ct", against="runs/tiny").ok  # doctest: +SKIP
    True
"""

from nvfp4_export.checkpoint import Checkpoint, CheckpointRef, read_checkpoint, resolve_checkpoint
from nvfp4_export.errors import ExportError
from nvfp4_export.exported_linear import ExportedLinear
from nvfp4_export.forward import ForwardWeights, forward
from nvfp4_export.hf_export import ExportResult, export_hf
from nvfp4_export.layouts import LAYOUTS
from nvfp4_export.linears import export_linear
from nvfp4_export.model_spec import LlamaSpec, spec_from_config
from nvfp4_export.onnx_export import export_onnx
from nvfp4_export.policy import linear_recipes
from nvfp4_export.reload import load_export
from nvfp4_export.servers import SERVERS
from nvfp4_export.verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "LAYOUTS",
    "SERVERS",
    "Checkpoint",
    "CheckpointRef",
    "ExportError",
    "ExportResult",
    "ExportedLinear",
    "ForwardWeights",
    "LlamaSpec",
    "VerifyReport",
    "export_hf",
    "export_linear",
    "export_onnx",
    "forward",
    "linear_recipes",
    "load_export",
    "read_checkpoint",
    "resolve_checkpoint",
    "spec_from_config",
    "verify",
]
