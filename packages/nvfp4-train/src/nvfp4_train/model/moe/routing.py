"""The router of an MoE block, in float32 (it never quantizes): top-k experts per token, their
combine weights, and the load-balancing losses and statistics of one batch.

Example:
    >>> logits = jnp.array([[2.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    >>> r = route(logits, k=2, norm_topk_prob=True)
    >>> r.experts_TxK.tolist()
    [[0, 1], [2, 0]]
    >>> [round(float(w), 4) for w in r.weights_TxK.sum(axis=-1)]
    [1.0, 1.0]
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """Where the tokens of a batch go.

    Attributes:
        experts_TxK: int32 [T, k]: the chosen experts of each token, best first.
        weights_TxK: float32 [T, k]: their combine weights (the softmax probabilities, divided by
            their sum with `norm_topk_prob`).
        probs_TxE: float32 [T, E]: the router's softmax over every expert.
        logits_TxE: float32 [T, E]: the router's logits.
    """

    experts_TxK: jax.Array
    weights_TxK: jax.Array
    probs_TxE: jax.Array
    logits_TxE: jax.Array


def route(
    logits_TxE: jax.Array,
    *,
    k: int,
    norm_topk_prob: bool,
    score_bias_E: jax.Array | None = None,
) -> Routing:
    """Softmax top-k routing of float32 router logits.

    `score_bias_E` (DeepSeek-V3's auxiliary-loss-free balancing) is added to the probabilities
    for choosing the experts only; the weights are the unbiased probabilities. Ties go to the
    lower expert index (`jax.lax.top_k`).
    """
    logits_TxE = logits_TxE.astype(jnp.float32)
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    scores = probs_TxE if score_bias_E is None else probs_TxE + score_bias_E
    _, experts_TxK = jax.lax.top_k(scores, k)
    weights_TxK = jnp.take_along_axis(probs_TxE, experts_TxK, axis=-1)
    if norm_topk_prob:
        weights_TxK = weights_TxK / jnp.sum(weights_TxK, axis=-1, keepdims=True)
    return Routing(experts_TxK.astype(jnp.int32), weights_TxK, probs_TxE, logits_TxE)


def expert_counts(experts_TxK: jax.Array, num_experts: int) -> jax.Array:
    """float32 [E]: how many assignments (token, slot) of the batch chose each expert."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts_TxK.reshape(-1)].add(1.0)


def load_balancing_loss(routing: Routing, counts_E: jax.Array) -> jax.Array:
    """Switch Transformer's auxiliary loss as transformers computes it: `E * sum_e f_e * P_e`,
    with `f_e` the fraction of tokens routed to expert e (over the k slots, so the f_e sum to
    k) and `P_e` the mean router probability of e. 1 * k when perfectly balanced."""
    tokens, num_experts = routing.probs_TxE.shape
    fraction_E = counts_E / tokens
    mean_prob_E = jnp.mean(routing.probs_TxE, axis=0)
    return num_experts * jnp.sum(fraction_E * mean_prob_E)


def z_loss(routing: Routing) -> jax.Array:
    """ST-MoE's router z-loss: the mean over tokens of logsumexp(logits)^2."""
    return jnp.mean(jax.nn.logsumexp(routing.logits_TxE, axis=-1) ** 2)


def router_entropy(routing: Routing) -> jax.Array:
    """The mean over tokens of the entropy (nats) of the router's softmax."""
    probs = routing.probs_TxE
    return -jnp.mean(jnp.sum(probs * jnp.log(jnp.maximum(probs, 1e-30)), axis=-1))
