"""Reinforcement-learning building blocks shared by the RL trainers, as pure functions on tensors.

masked: masked statistics (the bottom); shaping: reward shaping, KL, GAE and the value loss;
advantages: the registered advantage estimators; policy_losses: the registered policy losses and
the loss aggregations; mismatch: train/inference mismatch metrics and truncated importance sampling.
The public names are re-exported here.
"""
from aligner.rl.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    Advantages,
    AdvantageSettings,
    compute_advantages,
    discounted_returns,
    group_mean_baseline,
    group_std,
    groups,
    informative_groups,
    leave_one_out_baseline,
    register_advantage_estimator,
    sequence_rewards,
    token_advantages,
)
from aligner.rl.masked import (
    explained_variance,
    last_positions,
    masked_mean,
    masked_moment_sums,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    moments_from_sums,
    response_lengths,
    zero_off_mask,
)
from aligner.rl.mismatch import TIS_LEVELS, mismatch_metrics, truncated_importance_weights
from aligner.rl.policy_losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    PolicyLossTerms,
    aggregate_loss,
    policy_loss_terms,
    register_policy_loss,
)
from aligner.rl.shaping import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_missing_stop_penalty,
    clip_scores,
    clipped_value_error,
    gae_advantages,
    kl_penalty,
    normalize_scores,
    overlong_penalty,
    token_rewards,
    value_loss,
    value_loss_sum,
)

__all__ = [
    # advantages
    "ADVANTAGE_ESTIMATORS", "AdvantageEstimator", "AdvantageInputs", "AdvantageSettings", "Advantages",
    "compute_advantages", "discounted_returns", "group_mean_baseline", "group_std", "groups", "informative_groups",
    "leave_one_out_baseline", "register_advantage_estimator", "sequence_rewards", "token_advantages",
    # policy losses
    "AGGREGATIONS", "POLICY_LOSSES", "PolicyLossTerms", "aggregate_loss", "policy_loss_terms",
    "register_policy_loss",
    # mismatch
    "TIS_LEVELS", "mismatch_metrics", "truncated_importance_weights",
    # masked statistics
    "explained_variance", "masked_mean", "masked_moment_sums", "masked_moments", "masked_sum", "masked_var",
    "masked_whiten", "moments_from_sums", "last_positions", "response_lengths", "zero_off_mask",
    # shaping
    "KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "apply_missing_stop_penalty", "clip_scores",
    "clipped_value_error", "gae_advantages", "kl_penalty", "normalize_scores", "overlong_penalty", "token_rewards",
    "value_loss", "value_loss_sum",
]
