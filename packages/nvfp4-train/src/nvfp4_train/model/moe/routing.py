"""The router of an MoE block, in float32 (it never quantizes): top-k experts per token
(softmax or sigmoid scores, optionally DeepSeek-V3's grouped top-k), their combine weights, and the
load-balancing losses and statistics of one batch.

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
        weights_TxK: float32 [T, k]: their combine weights (the chosen scores, divided by their
            sum with `norm_topk_prob`, times the routed scaling factor).
        probs_TxE: float32 [T, E]: the router's probabilities over every expert: its softmax,
            or a sigmoid router's scores divided by their sum (what the load-balancing loss and
            the entropy read, as Megatron's aux loss for a sigmoid router).
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
    router: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
) -> Routing:
    """Top-k routing of float32 router logits.

    `router`: "softmax" (the scores are the softmax probabilities) or "sigmoid" (per-expert
    sigmoid scores, as DeepSeek-V3 and Nemotron 3). `score_bias_E` (DeepSeek-V3's
    auxiliary-loss-free balancing, Nemotron 3's `e_score_correction_bias`) is added to the
    scores for choosing the experts only; the weights are the unbiased scores of the chosen ones,
    divided by their sum with `norm_topk_prob` (plus 1e-20 for sigmoid scores, as transformers),
    times `routed_scaling_factor`. With `n_group > 1` only the experts of the `topk_group`
    groups with the largest sums of their two best biased scores are chosen from
    (`grouped_choice_scores`). Ties go to the lower index (`jax.lax.top_k`).
    """
    logits_TxE = logits_TxE.astype(jnp.float32)
    if router == "sigmoid":
        scores_TxE = jax.nn.sigmoid(logits_TxE)
        probs_TxE = scores_TxE / (jnp.sum(scores_TxE, axis=-1, keepdims=True) + 1e-20)
    else:
        scores_TxE = probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    choice = scores_TxE if score_bias_E is None else scores_TxE + score_bias_E
    if n_group > 1:
        choice = grouped_choice_scores(choice, n_group, topk_group)
    _, experts_TxK = jax.lax.top_k(choice, k)
    weights_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
    if norm_topk_prob:
        total_Tx1 = jnp.sum(weights_TxK, axis=-1, keepdims=True)
        weights_TxK = weights_TxK / (total_Tx1 + 1e-20 if router == "sigmoid" else total_Tx1)
    if routed_scaling_factor != 1.0:
        weights_TxK = weights_TxK * routed_scaling_factor
    return Routing(experts_TxK.astype(jnp.int32), weights_TxK, probs_TxE, logits_TxE)


def grouped_choice_scores(choice_TxE: jax.Array, n_group: int, topk_group: int) -> jax.Array:
    """`choice_TxE` with every expert outside its token's `topk_group` best groups set to -inf:
    the E experts form `n_group` consecutive groups, each scored by the sum of its two largest
    choice scores (DeepSeek-V3's `group_limited_greedy` as transformers' `NemotronHTopkRouter`).

    Example:
        >>> grouped_choice_scores(jnp.array([[0.875, 0.125, 0.5, 0.75]]), 2, 1).tolist()
        [[-inf, -inf, 0.5, 0.75]]
    """
    t, e = choice_TxE.shape
    grouped = choice_TxE.reshape(t, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    keep_TxG = jnp.any(jax.nn.one_hot(best_groups, n_group, dtype=jnp.bool_), axis=1)
    keep_TxE = jnp.repeat(keep_TxG, e // n_group, axis=1)
    return jnp.where(keep_TxE, choice_TxE, -jnp.inf)


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
