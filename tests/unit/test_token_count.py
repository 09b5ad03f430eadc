"""The tokens/s count: real tokens from the lengths each algorithm's batch carries, eos included when pad == eos."""
from __future__ import annotations

import pytest
import torch

from aligner.data.preference import collate_preferences
from aligner.data.reward import collate_comparisons, collate_regression
from aligner.data.sft import collate_sft
from aligner.generation.rollouts import RolloutBatch, RolloutRow
from aligner.training.trainer import real_token_count

EOS = PAD = 2  # as in SmolLM2 and Qwen: the pad id is the eos id
BOS = 1


def tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def pad_compared_count(batch: dict) -> int:
    """The old count, which drops every real eos."""
    return int((batch["tokens"] != PAD).sum())


def test_sft_batch_counts_its_eos_tokens():
    sequences = [[BOS, 5, 6, 7, EOS], [BOS, 8, EOS, 9, 10, 11, EOS], [BOS, EOS]]  # eos mid-row: multi-turn
    examples = [{"tokens": tensor(s), "loss_mask": tensor([0] + [1] * (len(s) - 1))} for s in sequences]
    batch = collate_sft(examples, PAD, pad_to_multiple_of=8)
    assert batch["tokens"].shape == (3, 8)
    # Each row's tokens hold the whole sequence (the longest, 7, fits in the 8 input columns).
    assert real_token_count(batch) == 5 + 7 + 2 == 14
    assert pad_compared_count(batch) == 14 - 4
    # A row as long as the padded length + 1 loses its last token to the labels only.
    batch = collate_sft(examples, PAD, pad_to_multiple_of=1)
    assert batch["tokens"].shape == (3, 6) and real_token_count(batch) == 5 + 6 + 2


@pytest.mark.usefixtures("single_process")  # packing asks megatron's parallel state for the layout
def test_preference_batches_count_their_eos_tokens():
    items = [{"prompt": tensor([BOS, 5, 6]), "chosen": tensor([7, EOS]), "rejected": tensor([8, 9, EOS])},
             {"prompt": tensor([BOS, 4]), "chosen": tensor([EOS]), "rejected": tensor([3, 3, 3, EOS])}]
    batch = collate_preferences(items, PAD, pad_to_multiple_of=8)  # DPO and SPIN
    assert real_token_count(batch) == 5 + 6 + 3 + 6 == 20
    assert pad_compared_count(batch) == 20 - 4
    # Packed with each pair's prompt once (what the forward runs): the prompts of 3 and 2 tokens count once.
    from aligner.models.packing import SharedPromptPackingSection, packed_rows_of

    packed_rows_of(batch, batch["prompt_lengths"] + batch["response_lengths"], SharedPromptPackingSection(), PAD,
                   prompt_lengths=batch["prompt_lengths"])
    assert real_token_count(batch) == 20 - 3 - 2


@pytest.mark.parametrize("kind", ["comparisons", "regression"])
def test_reward_model_batches_count_their_eos_tokens(kind):
    chosen, rejected = tensor([BOS, 5, 6, EOS]), tensor([BOS, 7, EOS, 8, EOS])
    if kind == "comparisons":
        batch = collate_comparisons([{"chosen": chosen, "rejected": rejected}], PAD, pad_to_multiple_of=8)
    else:
        examples = [{"tokens": t, "labels": torch.zeros(1), "label_mask": torch.ones(1)} for t in (chosen, rejected)]
        batch = collate_regression(examples, PAD, pad_to_multiple_of=8)
    assert real_token_count(batch) == 4 + 5
    assert pad_compared_count(batch) == 9 - 3


def test_rollout_micro_batch_counts_its_eos_tokens():
    rows = [(0, RolloutRow(prompt=[BOS, 5, 6], response=tensor([7, EOS]), logprobs=torch.full((2,), -1.0),
                           ended_with_stop=True)),
            (1, RolloutRow(prompt=[BOS, 4], response=tensor([8, 9, 10]), logprobs=torch.full((3,), -1.0),
                           ended_with_stop=False))]
    batch = RolloutBatch.from_rows(rows, PAD, seq_length=16)
    # The RL actor's micro batch record, as it is built from a RolloutBatch (aligner/training/microbatch_plan.py).
    from aligner.training.microbatch_plan import PolicyMicrobatch

    microbatch = PolicyMicrobatch(tokens=batch.tokens, position_ids=batch.tokens, prompt_lengths=batch.prompt_lengths,
                                  response_lengths=batch.response_lengths, mask=batch.mask,
                                  old_logprobs=batch.engine_logprobs, advantages=batch.engine_logprobs,
                                  importance_weights=None, loss_scale=1.0)
    assert real_token_count(microbatch) == 5 + 5
    assert pad_compared_count({"tokens": batch.tokens}) == 10 - 1


def test_a_batch_without_lengths_is_an_internal_error():
    with pytest.raises(KeyError, match="lengths"):
        real_token_count({"tokens": torch.zeros(2, 4, dtype=torch.long)})


def test_ptx_micro_batches_keep_the_lengths_when_padded_to_the_ppo_length():
    from types import SimpleNamespace

    from aligner.models.packing import SharedPromptPackingSection
    from aligner.training.microbatch_plan import DataParallel, MicroBatchPlanner

    sequences = [[BOS, 5, EOS], [BOS, 6, 7, 8, EOS]]
    examples = [{"tokens": tensor(s), "loss_mask": tensor([0] + [1] * (len(s) - 1))} for s in sequences]
    loader = SimpleNamespace(iterate=lambda consumed: iter([[collate_sft(examples, PAD)]]))
    for packs, width in ((False, 12), (True, 4)):  # padded for a pipeline schedule; packed: the longest's length
        planner = MicroBatchPlanner(SharedPromptPackingSection(), packs=packs, shares_prompts=False, seq_length=12,
                                    micro_batch_size=2, minibatch_size=2, samples_per_prompt=1, seed=0, pad_id=PAD,
                                    data_parallel=DataParallel(None, 0, 1), normalizer=lambda mask: 1.0,
                                    ptx_loader=loader)
        (microbatch,) = planner.ptx_microbatches()
        assert microbatch.tokens.shape == (2, width)
        assert real_token_count(microbatch) == 3 + 4  # the longest row's last token is a label only
