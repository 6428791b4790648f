"""The `model.mamba` section: the Mamba-2 mixer of a hybrid model's `M` blocks (`model.pattern`).

Its names follow Hugging Face's `NemotronHConfig` (`mamba_num_heads`, `mamba_head_dim`,
`ssm_state_size`, `n_groups`, `conv_kernel`, `chunk_size`, `time_step_limit`, ...); the inner width
is `d_inner = num_heads * head_dim` and the conv runs over `conv_dim = d_inner + 2 * n_groups *
state_dim` channels (x, then B, then C).

Example:
    >>> m = MambaConfig(num_heads=4, head_dim=16, state_dim=16, n_groups=2)
    >>> m.inner, m.conv_dim, m.in_proj_width
    (64, 128, 196)
"""

from __future__ import annotations

import dataclasses


def _check(ok: bool, key: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"model.mamba.{key} must be {expected}, got {actual!r}")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 (SSD) mixer; the defaults are Nemotron-H 8B's.

    Attributes:
        num_heads: SSM heads (`mamba_num_heads`); each has its own dt, A and D.
        head_dim: width of a head (`mamba_head_dim`).
        state_dim: SSM state size N (`ssm_state_size`).
        n_groups: B/C groups (`n_groups`): head h reads group h // (num_heads // n_groups); the
            gated norm normalises each group's d_inner / n_groups channels on their own.
        d_inner: 0 (num_heads * head_dim), or that same number written out (checked).
        conv_kernel: width of the depthwise causal conv over x|B|C (`conv_kernel`).
        conv_bias: the conv has a bias (`use_conv_bias`).
        proj_bias: in_proj and out_proj have biases (`use_bias`).
        chunk_size: tokens per chunk of the chunked SSD scan (`chunk_size`): memory grows as
            L x chunk_size, the arithmetic as L x chunk_size too; any length works (padded).
        time_step_limit: [low, high]: dt is clipped to it after softplus (`time_step_limit`);
            [] (the default, Hugging Face's (0, inf)) clips nothing.
        time_step_min, time_step_max, time_step_floor: the init of `dt_bias`: softplus^-1 of dt
            drawn log-uniformly in [time_step_min, time_step_max], floored at time_step_floor.
    """

    num_heads: int = 128
    head_dim: int = 64
    state_dim: int = 128
    n_groups: int = 8
    d_inner: int = 0
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    chunk_size: int = 128
    time_step_limit: tuple[float, ...] = ()
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4

    def __post_init__(self) -> None:
        for key in ("num_heads", "head_dim", "state_dim", "n_groups"):
            _check(getattr(self, key) >= 1, key, ">= 1", getattr(self, key))
        _check(self.conv_kernel >= 1, "conv_kernel", ">= 1", self.conv_kernel)
        _check(self.chunk_size >= 1, "chunk_size", ">= 1", self.chunk_size)
        width = self.num_heads * self.head_dim
        _check(self.d_inner in (0, width), "d_inner",
               f"0 or num_heads * head_dim = {self.num_heads} * {self.head_dim} = {width}",
               self.d_inner)  # fmt: skip
        _check(self.num_heads % self.n_groups == 0, "n_groups",
               f"a divisor of num_heads={self.num_heads}", self.n_groups)  # fmt: skip
        limit = self.time_step_limit
        _check(limit == () or (len(limit) == 2 and 0 <= limit[0] < limit[1]), "time_step_limit",
               "[] (no clip) or [low, high] with 0 <= low < high", list(limit))  # fmt: skip
        _check(0 < self.time_step_min <= self.time_step_max, "time_step_min",
               f"> 0 and <= time_step_max={self.time_step_max}", self.time_step_min)  # fmt: skip
        _check(self.time_step_floor > 0, "time_step_floor", "> 0", self.time_step_floor)

    @property
    def inner(self) -> int:
        """d_inner = num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x (d_inner), then B and C (n_groups * state_dim each)."""
        return self.inner + 2 * self.n_groups * self.state_dim

    @property
    def in_proj_width(self) -> int:
        """Output width of in_proj: z (d_inner) | x, B, C (conv_dim) | dt (num_heads)."""
        return self.inner + self.conv_dim + self.num_heads
