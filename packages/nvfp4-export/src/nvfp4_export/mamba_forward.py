"""The Mamba-2 mixer of a hybrid (`nemotron_h`) block in NumPy, as the training model computes it
(nvfp4_train.model.blocks.mamba, written from transformers' `NemotronHMamba2Mixer`):

    z | xBC | dt = in_proj(x)                      (the caller's linear: output in the compute dtype)
    xBC = silu(conv1d(xBC))                         depthwise causal conv with bias, float32
    x | B | C = xBC;  dt = softplus(dt + dt_bias), clipped to time_step_limit;  A = -exp(A_log)
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T;  y_t = h_t C_t + D x_t     (per head; B, C per group)
    out = out_proj(gated_rmsnorm(y, z))             normed per group, rounded to the compute dtype

The scan runs token by token in float64 (training's chunked SSD computes the same recurrence in
float32 chunks: they agree to ~1e-6 of the output's size) and returns float32. Weights are in
HF's layout (`ForwardWeights`): "conv1d" [C, 1, K], "conv1d_bias" [C], "dt_bias", "A_log",
"D" [H], "mixer_norm" [d_inner].

Example:
    >>> [round(float(v), 4) for v in silu(np.float32([0.0, 1.0]))]
    [0.0, 0.7311]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), float32."""
    x = np.asarray(x, np.float32)
    return (x / (np.float32(1) + np.exp(-x))).astype(np.float32)


def causal_conv(x_BxLxC: np.ndarray, weight_Cx1xK: np.ndarray, bias_C) -> np.ndarray:
    """out[t, c] = bias[c] + sum_k weight[c, 0, k] x[t - (K-1) + k, c] (x = 0 before the start),
    float32: PyTorch's `Conv1d(C, C, K, groups=C, padding=K-1)` cut to L."""
    b, l, c = x_BxLxC.shape
    w_KxC = np.asarray(weight_Cx1xK, np.float32)[:, 0, :].T
    k = w_KxC.shape[0]
    padded = np.concatenate([np.zeros((b, k - 1, c), np.float32), x_BxLxC], axis=1)
    out = sum(padded[:, j : j + l] * w_KxC[j] for j in range(k))
    return (out + (0.0 if bias_C is None else np.asarray(bias_C, np.float32))).astype(np.float32)


def ssd_recurrence(x_BxLxHxP, dt_BxLxH, a_H, b_BxLxGxN, c_BxLxGxN) -> np.ndarray:
    """y [B, L, H, P] of h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t, h_0 = 0
    (head h reads group h // (H / G)), in float64."""
    _, l, h, _ = x_BxLxHxP.shape
    group = np.arange(h) // (h // b_BxLxGxN.shape[2])
    x, dt = x_BxLxHxP.astype(np.float64), dt_BxLxH.astype(np.float64)
    bb = b_BxLxGxN.astype(np.float64)[:, :, group]  # [B, L, H, N]
    cc = c_BxLxGxN.astype(np.float64)[:, :, group]
    decay = np.exp(dt * np.asarray(a_H, np.float64))  # [B, L, H]
    state = np.zeros((*x.shape[:1], h, x.shape[3], bb.shape[3]))  # [B, H, P, N]
    y = np.zeros(x.shape)
    for t in range(l):
        update = (dt[:, t, :, None] * x[:, t])[..., None] * bb[:, t, :, None, :]
        state = decay[:, t, :, None, None] * state + update
        y[:, t] = np.einsum("bhpn,bhn->bhp", state, cc[:, t])
    return y.astype(np.float32)


def gated_rms_norm(y: np.ndarray, z: np.ndarray, scale: np.ndarray, groups: int, eps: float):
    """(y * silu(z)) RMS-normalised over each of `groups` groups of channels, times `scale`,
    float32 (training's `GatedRMSNorm`)."""
    gated = y.astype(np.float32) * silu(z)
    split = gated.reshape(*gated.shape[:-1], groups, -1)
    inv = 1.0 / np.sqrt(np.mean(split * split, axis=-1, keepdims=True) + np.float32(eps))
    return ((split * inv.astype(np.float32)).reshape(gated.shape) * scale).astype(np.float32)


def mamba_mixer(h_BxLxD: np.ndarray, layer: dict, spec, rnd: Callable, linear: Callable):
    """The Mamba mixer of one block: `linear(x, name)` applies its "in_proj" or "out_proj" (with
    training's input quantization and output rounding), `rnd` rounds to the compute dtype."""
    hy = spec.hybrid
    heads, p, g, n = hy.mamba_num_heads, hy.mamba_head_dim, hy.n_groups, hy.ssm_state_size
    zxbcdt = linear(h_BxLxD, "in_proj")
    z, xbc, dt = np.split(zxbcdt, [hy.d_inner, hy.d_inner + hy.conv_dim], axis=-1)
    xbc = silu(causal_conv(xbc.astype(np.float32), layer["conv1d"], layer.get("conv1d_bias")))
    x, b_, c_ = np.split(xbc, [hy.d_inner, hy.d_inner + g * n], axis=-1)
    dt = np.logaddexp(np.float32(0), dt.astype(np.float32) + layer["dt_bias"]).astype(np.float32)
    if hy.time_step_limit:
        dt = np.clip(dt, *hy.time_step_limit).astype(np.float32)
    bl = x.shape[:2]
    x4 = x.reshape(*bl, heads, p)
    a = -np.exp(np.asarray(layer["A_log"], np.float32))
    y = ssd_recurrence(x4, dt, a, b_.reshape(*bl, g, n), c_.reshape(*bl, g, n))
    y = (y + np.asarray(layer["D"], np.float32)[:, None] * x4).reshape(*bl, hy.d_inner)
    normed = gated_rms_norm(y, z, layer["mixer_norm"], g, spec.rms_norm_eps)
    return linear(rnd(normed), "out_proj")
