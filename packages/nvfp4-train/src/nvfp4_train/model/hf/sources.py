"""Where each parameter of the run's tree is read from in a Hugging Face checkpoint.

`Source`: HF tensors concatenated along the parameter's last axis (transposed or not), optionally
one entry of a stacked HF tensor (transformers 5's fused `experts.gate_up_proj` [E, 2F, D]), or a
depthwise conv's weight (torch's `Conv1d.weight` [C, 1, K], read as [C, K]);
`ExpertSources`: one `Source` per expert along the parameter's leading axis (an MoE block's
`experts.gate_up.kernel` [E, D, 2F]); a `Source` without parts is zeros (a parameter the HF model
does not have, such as the router's balancing bias). `hf_weights` reads them, `hf_moe` and
`hf_weights.sources` write the tables.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Source:
    """How one canonical parameter is read: the HF tensors concatenated along its last axis.

    Attributes:
        parts: (HF tensor name, rows of the last axis it fills), in order; empty: zeros.
        transposed: HF stores it [out, in], the parameter is [in, out].
        entry: the HF tensors are stacked [E, ...] and this is their entry `entry` (None: the
            whole tensor).
        depthwise_conv: the HF tensor is a depthwise conv's weight [C, 1, K], read as [C, K]
            (transposed: the parameter is [K, C]).
    """

    parts: tuple[tuple[str, int], ...]
    transposed: bool = False
    entry: int | None = None
    depthwise_conv: bool = False


@dataclasses.dataclass(frozen=True)
class ExpertSources:
    """A parameter whose leading axis holds experts: `experts[e]` fills its entry e."""

    experts: tuple[Source, ...]


ZEROS = Source(())
"""A parameter the HF checkpoint does not hold, initialised to zeros."""
