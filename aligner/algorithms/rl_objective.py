"""The RL policy update's objective: the loss megatron's schedule runs on each micro batch of the update
(`aligner.training.microbatch_plan`), the registered policy loss and its aggregation
(`aligner.rl.policy_losses`), an entropy bonus and the PTX loss."""
from __future__ import annotations

import math

import torch

from aligner.algorithms.rl_config import LossSection
from aligner.algorithms.sft import response_token_loss
from aligner.models.logprobs import response_logprobs_and_entropy
from aligner.models.packed_logprobs import response_logprobs_and_entropy as packed_pass
from aligner.models.packing import packed_forward, zero_loss
from aligner.rl import masked, mismatch, policy_losses
from aligner.training.microbatch_plan import PTXMicrobatch


class PolicyObjective:
    """Loss of one micro batch: the registered policy loss aggregated - entropy bonus (+ the PTX loss).

    Megatron divides the summed loss by the summed counts of the whole minibatch. Every micro batch
    returns count 1 and its aggregated loss times its `loss_scale` = (micro batches in the minibatch)
    / (the minibatch's normaliser of its kind, over all ranks): so the minibatch loss is exactly
    sum(policy terms) / N_policy + coef * sum(PTX terms) / N_ptx at any layout.
    """

    reads_logits_at_positions = True  # response (and PTX loss) positions only: the output layer runs there

    def __init__(self, vocab_size: int, temperature: float, loss: LossSection, clip_high: float,
                 constant_normalizer: float, ptx_coef: float):
        self.vocab_size = vocab_size
        self.temperature = temperature
        self.policy_loss = loss.policy_loss
        self.clip_low, self.clip_high = loss.clip_ratio, clip_high
        self.aggregation = loss.aggregation
        self.constant_normalizer = constant_normalizer
        self.entropy_coef = loss.entropy_coef
        self.ptx_coef = ptx_coef

    def normalizer(self, mask: torch.Tensor) -> float:
        """What the aggregation divides a batch's summed loss by, for rows `mask` [b, T]."""
        return float(policy_losses.aggregate_loss(torch.zeros(mask.shape), mask, self.aggregation,
                                                  self.constant_normalizer)[1])

    def forward(self, model, batch):
        if getattr(batch, "packed", None) is not None:
            return packed_forward(model, batch.packed.to(batch.tokens.device))
        return model(batch.tokens, batch.position_ids, None)

    def loss(self, batch, logits):
        one = torch.tensor(1, dtype=torch.int)
        if isinstance(batch, PTXMicrobatch):
            loss_sum, tokens = response_token_loss(logits, batch.labels, batch.loss_mask, self.vocab_size)
            return loss_sum * batch.loss_scale, one, {"ptx_loss_sum": loss_sum.detach(),
                                                      "ptx_tokens": tokens.detach().float()}
        if batch.packed is not None and batch.packed.lengths.numel() == 0:  # evens a token-budget plan's count
            return zero_loss(logits), one, {}
        mask = batch.mask
        width = mask.shape[1]
        # Logprobs and the entropy of the sampling distribution at each response position, in one
        # chunked pass (vocab-parallel, never gathered), both 0 off `mask`; packed rows are read in place.
        entropy_grad = self.entropy_coef != 0 and torch.is_grad_enabled()
        if batch.packed is not None:
            logprobs, entropy = packed_pass(
                logits, batch.packed, batch.prompt_lengths, batch.response_lengths, vocab_size=self.vocab_size,
                temperature=self.temperature, response_width=width, entropy_grad=entropy_grad)
        else:
            logprobs, entropy = response_logprobs_and_entropy(
                logits, batch.tokens, batch.prompt_lengths, batch.response_lengths, vocab_size=self.vocab_size,
                temperature=self.temperature, response_width=width, entropy_grad=entropy_grad)
        old_logprobs = logprobs.detach() if batch.old_logprobs is None else batch.old_logprobs
        terms = policy_losses.policy_loss_terms(self.policy_loss, logprobs, old_logprobs, batch.advantages, mask,
                                                clip_low=self.clip_low, clip_high=self.clip_high,
                                                weights=batch.importance_weights)
        policy_sum, count = policy_losses.aggregate_loss(terms.per_token, mask, self.aggregation,
                                                         self.constant_normalizer)
        entropy_sum, _ = policy_losses.aggregate_loss(entropy, mask, self.aggregation, self.constant_normalizer)
        objective_sum = policy_sum - self.entropy_coef * entropy_sum
        with torch.no_grad():
            valid = mask.bool()
            ratio = terms.ratio.detach()
            log_ratio = masked.zero_off_mask(logprobs.detach() - old_logprobs, mask)
            report = {
                "policy_loss_sum": policy_sum.detach(), "count": count.detach().float(),
                "entropy_sum": entropy_sum.detach(), "tokens": valid.sum().float(),
                "clipped_tokens": (terms.clipped & valid).sum().float(),
                "approx_kl_sum": (0.5 * log_ratio.pow(2))[valid].sum(),
                "ratio_sum": ratio[valid].sum(),
                "ratio_max": torch.where(valid, ratio, -math.inf).max(),
                "ratio_min": torch.where(valid, ratio, math.inf).min(),
            }
            if batch.engine_logprobs is not None:
                report.update(mismatch.mismatch_sums(logprobs, batch.engine_logprobs, mask))
        return objective_sum * batch.loss_scale, one, report

    def summarize(self, totals):
        tokens, count = max(totals.get("tokens", 0.0), 1.0), max(totals.get("count", 0.0), 1.0)
        metrics = {
            "policy_loss": totals["policy_loss_sum"] / count, "entropy": totals["entropy_sum"] / count,
            "clip_fraction": totals["clipped_tokens"] / tokens, "approx_kl": totals["approx_kl_sum"] / tokens,
            "ratio_mean": totals["ratio_sum"] / tokens, "ratio_max": totals["ratio_max"],
            "ratio_min": totals["ratio_min"],
        }
        if "mismatch_tokens" in totals:
            metrics.update(mismatch.metrics_from_sums(totals))
        if "ptx_tokens" in totals:
            metrics["ptx_loss"] = totals["ptx_loss_sum"] / max(totals["ptx_tokens"], 1.0)
        metrics["loss"] = metrics["policy_loss"] - self.entropy_coef * metrics["entropy"] + (
            self.ptx_coef * metrics.get("ptx_loss", 0.0))
        return metrics
