"""Reinforcement-learning building blocks shared by the RL trainers (PPO first).

`ppo_math` holds the math as pure functions on tensors; the public names are re-exported here.
"""
from aligner.rl.ppo_math import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_missing_stop_penalty,
    clip_scores,
    clipped_surrogate,
    clipped_value_error,
    entropy_from_logits,
    entropy_from_partial_sums,
    entropy_partial_sums,
    explained_variance,
    gae_advantages,
    kl_penalty,
    masked_mean,
    masked_moment_sums,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    moments_from_sums,
    normalize_scores,
    policy_loss,
    response_lengths,
    token_rewards,
    value_loss,
)

__all__ = [
    "AGGREGATIONS", "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "aggregate_loss",
    "apply_missing_stop_penalty", "clip_scores", "clipped_surrogate", "clipped_value_error", "entropy_from_logits",
    "entropy_from_partial_sums", "entropy_partial_sums", "explained_variance", "gae_advantages", "kl_penalty",
    "masked_mean", "masked_moment_sums", "masked_moments", "masked_sum", "masked_var", "masked_whiten",
    "moments_from_sums", "normalize_scores", "policy_loss", "response_lengths", "token_rewards", "value_loss",
]
