"""Packed batches (aligner.models.packing) against the padded layout: the row plan, the masks, the THD
parameters, rotary embeddings at position ids, and the logprobs, losses and gradients of a tiny model
(fp32), which must equal the padded path's within 1e-6."""
from __future__ import annotations

import pytest
import torch

from aligner.models import packed_logprobs, packing
from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

pytestmark = pytest.mark.usefixtures("single_process")
VOCAB = 50


def _sequences(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def test_rows_are_first_fit_longest_first_and_every_sequence_keeps_its_own_positions():
    sequences = _sequences([3, 6, 2, 5])
    assert packing.first_fit_rows([3, 6, 2, 5], 8) == [[1, 2], [3, 0]]
    packed = packing.pack_rows(sequences, 8, pad_id=0)
    assert packed.tokens.shape == (2, 8)
    assert packed.starts.tolist() == [8 + 5, 0, 6, 8]
    for sequence, start in zip(sequences, packed.starts.tolist()):
        assert torch.equal(packed.tokens.reshape(-1)[start:start + len(sequence)], sequence)
        assert packed.position_ids.reshape(-1)[start:start + len(sequence)].tolist() == list(range(len(sequence)))
    assert packed.segment_ids.tolist() == [[0] * 6 + [1] * 2, [0] * 5 + [1] * 3]
    with pytest.raises(ValueError, match="does not fit"):
        packing.first_fit_rows([9], 8)


def test_attention_mask_is_causal_inside_each_sequence_only():
    packed = packing.pack_rows(_sequences([2, 3]), 6, pad_id=0)  # one row: [3 tokens][2 tokens][pad]
    attend = ~packed.attention_mask()[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for first, length in ((0, 3), (3, 2)):
        for query in range(first, first + length):
            expected[query, first:query + 1] = True
    expected[5, 5] = True  # padding sees only itself (no empty softmax row)
    assert torch.equal(attend, expected)


def test_thd_parameters_cut_at_every_sequence_and_row_end():
    """transformer-engine's path (not run without a GPU): the rows flattened, each row's padding a sequence."""
    packed = packing.pack_rows(_sequences([3, 6, 2, 5]), 8, pad_id=0)  # rows [6][2] and [5][3]
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == [0, 6, 8, 13, 16]
    assert params.max_seqlen_q == 6
    with_padding = packing.pack_rows(_sequences([3, 2]), 8, pad_id=0)  # one row [3][2][3 padding]
    assert with_padding.packed_seq_params().cu_seqlens_kv.tolist() == [0, 3, 5, 8]


def test_rotary_embedding_at_column_positions_is_megatrons_own_bit_for_bit():
    cfg = GPTConfig.llama(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=8, llama3_rope_scaling_factor=8.0)
    rotary = build_gpt_model(cfg, transformer_config(cfg)).rotary_pos_emb
    positions = torch.arange(20).unsqueeze(0).repeat(3, 1)
    assert torch.equal(packing.rotary_embedding_at(rotary, positions), rotary.get_emb(20).expand(-1, 3, -1, -1))


def _tiny_model(style):
    cfg = getattr(GPTConfig, style)(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB,
                                    num_query_groups=2 if style == "llama" else None,
                                    make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return build_gpt_model(cfg, transformer_config(cfg))


def _rollouts(seed=1):
    """Five prompt + response rows, right-padded to 24 columns as the RL actor lays them out."""
    prompts, responses = torch.tensor([3, 7, 5, 9, 2]), torch.tensor([6, 2, 9, 4, 11])
    tokens = torch.zeros(5, 24, dtype=torch.long)
    for row, sequence in enumerate(_sequences((prompts + responses).tolist(), seed)):
        tokens[row, :len(sequence)] = sequence
    return tokens, prompts, responses


def _group_rollouts(seed=4):
    """Six rollouts of three prompts (3, 2 and 1 samples: a GRPO group's rows share their prompt's
    tokens), in shuffled order, right-padded to 24 columns."""
    generator = torch.Generator().manual_seed(seed)
    prompt_tokens = [torch.randint(3, VOCAB, (n,), generator=generator) for n in (4, 6, 3)]
    rows = [(0, 5), (1, 7), (0, 9), (2, 11), (1, 3), (0, 2)]  # (prompt, response length)
    tokens = torch.zeros(len(rows), 24, dtype=torch.long)
    for row, (prompt, response) in enumerate(rows):
        sequence = torch.cat([prompt_tokens[prompt], torch.randint(3, VOCAB, (response,), generator=generator)])
        tokens[row, :len(sequence)] = sequence
    prompts = torch.tensor([len(prompt_tokens[p]) for p, _ in rows])
    return tokens, prompts, torch.tensor([r for _, r in rows])


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_packed_logprob_pass_equals_the_padded_one(style):
    from aligner.models import logprobs

    model = _tiny_model(style).eval()
    tokens, prompts, responses = _rollouts()
    padded = logprobs.sequence_logprobs([model], tokens, prompts, responses, vocab_size=VOCAB, temperature=0.7,
                                        response_width=12)
    for row_length, rows_per_forward in ((24, 2), (40, 1)):
        packed = packed_logprobs.sequence_logprobs(
            [model], tokens, prompts, responses, vocab_size=VOCAB, temperature=0.7, pad_id=0, response_width=12,
            packing=packing.PackingSection(row_length=row_length), micro_batch_size=rows_per_forward)
        torch.testing.assert_close(packed, padded, atol=1e-6, rtol=0)
        assert torch.all(packed[:, 11:][responses.unsqueeze(1) <= 11] == 0)
    off = packed_logprobs.sequence_logprobs([model], tokens, prompts, responses, vocab_size=VOCAB, temperature=0.7,
                                            packing=packing.PackingSection(enabled=False), pad_id=0,
                                            response_width=12)
    assert torch.equal(off, padded)


def _actor_config(cfg_settings):
    """The group yaml with rollouts of 12 + 12 tokens (rows of 24) and micro batches of 2."""
    from aligner.algorithms.rl_config import RLActorConfig
    from aligner.config import CONF_DIR, load_config

    return load_config(RLActorConfig, CONF_DIR / "gpt_reinforce_actor.yaml", [
        "model.init_from=x", "data.prompts=p.jsonl", "reward.source=function", "reward.function=m:f",
        "data.max_prompt_length=12", "generation.max_new_tokens=12", "trainer.micro_batch_size=2",
        "loss.entropy_coef=0.01", *cfg_settings])


def _policy_planner(cfg_settings, model=None, *, rank=0, ranks=1, group=None):
    """(the RL actor's micro-batch planner, its objective) of the group yaml with `cfg_settings`, on `model`
    (default a tiny llama), as data-parallel rank `rank` of `ranks` (one process plays every rank unless
    `group` is a real data-parallel group)."""
    import torch.distributed as dist

    from aligner.algorithms.rl_actor import policy_planner
    from aligner.algorithms.rl_objective import PolicyObjective
    from aligner.training.microbatch_plan import DataParallel

    cfg = _actor_config(cfg_settings)
    objective = PolicyObjective(VOCAB, 0.7, cfg.loss, cfg.clip_high, cfg.constant_normalizer, 0.0)
    model = model if model is not None else _tiny_model("llama")
    return policy_planner(cfg, model, 0, objective, DataParallel(group or dist.group.WORLD, rank, ranks)), objective


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean"])
def test_packed_policy_micro_batches_give_the_padded_loss_and_gradients(aggregation):
    """A minibatch of five rollouts: the padded micro batches (2 sequences each) and the packed ones
    (2 rows of 24 tokens each) give the same loss, metrics and gradients within 1e-6. Megatron divides
    the summed micro-batch losses (and so the gradients) by the summed counts, 1 per micro batch."""
    from aligner.models.logprobs import response_mask
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows

    model = _tiny_model("llama").train()
    tokens, prompts, responses = _rollouts(seed=2)
    generator = torch.Generator().manual_seed(3)
    mask = response_mask(responses, 12)
    rows = SequenceRows(tokens=tokens, prompt_lengths=prompts, response_lengths=responses, mask=mask)
    old = torch.where(mask, -torch.rand(5, 12, generator=generator) * 3, 0)
    targets = PolicyTargets(advantages=torch.randn(5, 12, generator=generator) * mask, old_logprobs=old)
    ids = torch.tensor([4, 0, 2, 1, 3])
    results = {}
    for enabled in (False, True):
        planner, objective = _policy_planner([f"packing.enabled={str(enabled).lower()}",
                                              f"loss.aggregation={aggregation}", "packing.share_prompts=false"], model)
        microbatches = planner.scale_losses(planner.policy_microbatches(rows, targets, ids))
        model.zero_grad(set_to_none=True)
        total, reports = 0.0, []
        for microbatch in microbatches:
            loss, _, report = objective.loss(microbatch, objective.forward(model, microbatch))
            loss.backward()
            total += float(loss)
            reports.append(report)
        summed = {key: sum(float(r[key]) for r in reports) for key in ("policy_loss_sum", "entropy_sum", "tokens")}
        count = len(microbatches)
        results[enabled] = (count, total / count, summed,
                            {name: p.grad / count for name, p in model.named_parameters()})
    (padded_count, padded_loss, padded_sums, padded_grads) = results[False]
    (packed_count, packed_loss, packed_sums, packed_grads) = results[True]
    assert (padded_count, packed_count) == (3, 2)  # 5 sequences of 9..14 tokens: 2 per padded micro batch,
    assert packed_loss == pytest.approx(padded_loss, abs=1e-6)  # 2 rows of 24 per packed one
    assert packed_sums == pytest.approx(padded_sums, rel=1e-6)  # fp32 sums over different groupings
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_packed_dpo_micro_batch_gives_the_padded_loss_gradients_and_reference_sums(tmp_path,
                                                                                  arithmetic_tokenizer_dir):
    """Six demo pairs in one micro batch: packed into rows of the batch's padded length, or with each
    pair's prompt held once (`SharedPromptPackingSection`), the DPO loss, its report and the gradients
    equal the padded batch's within 1e-6; so do the reference sums."""
    from aligner.algorithms.dpo import DPOObjective, DPOSection, precompute_reference_logprobs
    from aligner.data.preference import PreferenceDataset, collate_preferences
    from aligner.demo import arithmetic
    from aligner.tokenizer import Tokenizer

    from ..conftest import write_jsonl

    tokenizer = Tokenizer(arithmetic_tokenizer_dir)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(4)
    policy = build_gpt_model(cfg, transformer_config(cfg))
    reference = build_gpt_model(cfg, transformer_config(cfg))
    path = write_jsonl(tmp_path / "pairs.jsonl", arithmetic.preference_records(6, seed=5))
    dataset = PreferenceDataset.from_jsonl(path, tokenizer, 32)
    sums = {}
    layouts = (("padded", None), ("packed", packing.PackingSection()),
               ("shared", packing.SharedPromptPackingSection()))
    for name, section in layouts:
        precompute_reference_logprobs(dataset, [reference], vocab_size=cfg.vocab_size, pad_id=tokenizer.pad_id,
                                      pairs_per_forward=3, packing=section)
        sums[name] = dataset.reference_logprobs.clone()
    torch.testing.assert_close(sums["packed"], sums["padded"], atol=1e-6, rtol=0)
    torch.testing.assert_close(sums["shared"], sums["padded"], atol=1e-6, rtol=0)

    results = {}
    for name, section in layouts:
        batch = collate_preferences([dataset[i] for i in range(len(dataset))], tokenizer.pad_id, 8)
        objective = DPOObjective(DPOSection(beta=0.5, sft_loss_weight=0.3), cfg.vocab_size, section, tokenizer.pad_id)
        policy.zero_grad(set_to_none=True)
        loss_sum, pairs, report = objective.loss(batch, objective.forward(policy, batch))
        loss_sum.backward()
        if section is not None:  # fewer rows than sequences: the padding really went away
            assert batch["packed"].tokens.shape[0] < batch["tokens"].shape[0]
        real = int((batch["prompt_lengths"] + batch["response_lengths"]).sum())
        if name == "shared":  # each pair's prompt once: the tokens run are the real ones less one prompt a pair
            assert batch["packed"].shares_prompts
            assert batch["packed"].real_tokens == real - int(batch["prompt_lengths"][0::2].sum())
        results[name] = (float(loss_sum), {key: float(value) for key, value in report.items()},
                         {key: p.grad.clone() for key, p in policy.named_parameters()})
    for name in ("packed", "shared"):
        assert results[name][0] == pytest.approx(results["padded"][0], abs=1e-6)
        assert results[name][1] == pytest.approx(results["padded"][1], rel=1e-6, abs=1e-6)  # fp32 sums up to ~20
        for key, grad in results["padded"][2].items():
            torch.testing.assert_close(results[name][2][key], grad, atol=1e-6, rtol=1e-5, msg=f"{name} {key}")


@pytest.mark.parametrize("kind", ["ranking", "regression"])
def test_packed_reward_model_micro_batch_gives_the_padded_loss_and_gradients(kind):
    """Reward-model objectives read each sequence's score at its last token: packed equals padded."""
    from aligner.algorithms.reward_model import RankingObjective, RegressionObjective
    from aligner.data.reward import collate_comparisons, collate_regression
    from aligner.models.reward import build_reward_model

    cfg = GPTConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(5)
    attributes = 1 if kind == "ranking" else 2
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=attributes)
    sequences = _sequences([9, 4, 13, 6, 11, 3], seed=6)
    generator = torch.Generator().manual_seed(7)
    if kind == "ranking":
        examples = [{"chosen": sequences[i], "rejected": sequences[i + 1]} for i in range(0, 6, 2)]
        collate, make = collate_comparisons, RankingObjective
    else:
        examples = [{"tokens": sequence, "labels": torch.randn(2, generator=generator),
                     "label_mask": torch.tensor([1.0, float(i % 2)])} for i, sequence in enumerate(sequences)]
        collate, make = collate_regression, lambda section: RegressionObjective(["a", "b"], section)
    results = {}
    for name, section in (("padded", None), ("packed", packing.PackingSection())):
        batch = collate(examples, 0)
        objective = make(section)
        model.zero_grad(set_to_none=True)
        loss_sum, _, report = objective.loss(batch, objective.forward(model, batch))
        loss_sum.backward()
        if section is not None:
            assert batch["packed"].tokens.shape[0] < len(sequences)
        results[name] = (float(loss_sum), {key: float(value) for key, value in report.items()},
                         {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None})
    assert results["packed"][0] == pytest.approx(results["padded"][0], abs=1e-6)
    assert results["packed"][1] == pytest.approx(results["padded"][1], abs=1e-6)
    for key, grad in results["padded"][2].items():
        # Packing sums each entry's terms in another order: fp32 rounds at ~6e-8 of the gradient's scale (the
        # regression head's embedding gradient reaches 153; measured 7.6e-6 apart on an AMD EPYC), which an
        # element-wise rtol misses on the small entries. A wrong boundary is off by the entries themselves.
        scale = float(grad.abs().max())
        torch.testing.assert_close(results["packed"][2][key], grad, atol=1e-6 + 1e-7 * scale, rtol=1e-5, msg=key)


@pytest.mark.parametrize("rollouts", [_rollouts, _group_rollouts])
def test_the_actors_logprob_pass_lays_out_the_first_minibatch_as_its_training_rows(rollouts):
    """A sequence's rounding depends on its place in a packed row: the logprob pass packs the first
    epoch's minibatches, so the first minibatch's training logprobs are bit-equal to the old ones
    (the ratio is exactly 1); so with shared prompts too (`_group_rollouts`)."""
    from aligner.models.logprobs import response_mask
    from aligner.models.packed_logprobs import response_logprobs_and_entropy as packed_response_logprobs_and_entropy
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows

    model = _tiny_model("llama").eval()
    tokens, prompts, responses = rollouts(seed=8)
    count = len(tokens)
    mask = response_mask(responses, 12)
    rows = SequenceRows(tokens=tokens, prompt_lengths=prompts, response_lengths=responses, mask=mask)
    planner, objective = _policy_planner([f"trainer.global_batch_size={count}"], model)
    old = planner.plan_step(3, rows).logprobs([model], VOCAB, 0.7, 12)
    plan = planner.logprob_plan(rows, 3)
    assert sorted(i for micro in plan for row in micro for i in row) == list(range(count))
    first = planner.minibatch_order(3, count, 0)
    assert plan == planner.packed_plan(rows, first)
    targets = PolicyTargets(advantages=torch.zeros(count, 12), old_logprobs=old)
    for microbatch in planner.policy_microbatches(rows, targets, first):
        with torch.no_grad():
            trained, _ = packed_response_logprobs_and_entropy(
                objective.forward(model, microbatch), microbatch.packed, microbatch.prompt_lengths,
                microbatch.response_lengths, vocab_size=VOCAB, temperature=0.7, response_width=12)
        assert torch.equal(trained, microbatch.old_logprobs)
        assert microbatch.packed.shares_prompts


# ----------------------------------------------------------------------------- shared prompts
def test_shared_prompt_rows_hold_each_prompt_once_and_keep_every_sequences_positions():
    tokens, prompts, responses = _group_rollouts()
    lengths = (prompts + responses).tolist()
    keys = packing.prompt_keys(tokens, prompts)
    assert keys[0] == keys[2] == keys[5] and keys[1] == keys[4] and len(set(keys)) == 3
    # 40 tokens a row: prompt 0 (4 tokens) with its three responses (16) in one part, prompt 1 (6) with
    # its two (10) in another, prompt 2's single sequence (14): first fit puts the parts of 20 and 16 together.
    rows = packing.shared_prompt_rows(lengths, prompts.tolist(), keys, 40)
    assert rows == [[0, 2, 5, 1, 4], [3]]
    # 14 tokens a row: prompt 0's responses (9, 5, 2) cut into parts [9] and [5, 2] (13 and 11 tokens),
    # prompt 1's (7, 3) into [7] and [3] (13 and 9), then the parts first fit, longest first
    assert packing.shared_prompt_rows(lengths, prompts.tolist(), keys, 14) == [[3], [2], [1], [0, 5], [4]]
    sequences = [tokens[i, :n] for i, n in enumerate(lengths)]
    packed = packing.pack_rows(sequences, 40, 0, rows=rows, prompt_lengths=prompts.tolist())
    assert packed.shares_prompts and packed.real_tokens == 4 + 16 + 6 + 10 + 14 == 50
    assert int((packed.segment_ids[0] >= 0).sum()) == 36
    for index, sequence in enumerate(sequences):
        assert torch.equal(packed.sequence(index), sequence)
        response = int(packed.response_starts[index])
        flat_positions = packed.position_ids.reshape(-1)
        assert flat_positions[response:response + int(responses[index])].tolist() == list(
            range(int(prompts[index]), lengths[index]))
    assert packed.starts[0] == packed.starts[2] == packed.starts[5] == 0  # one copy of prompt 0
    attend = ~packed.attention_mask()[0, 0]
    # response 2 (of prompt 0) sits after response 0: it sees prompt 0 and itself, not response 0
    first, second = int(packed.response_starts[0]), int(packed.response_starts[2])
    query = second + 3
    assert attend[query].nonzero().squeeze(1).tolist() == [0, 1, 2, 3, *range(second, query + 1)]
    assert not attend[first:first + 5, 4 + 16:].any()  # prompt 0's rows never see prompt 1's
    trimmed = packing.pack_rows(sequences, 40, 0, rows=rows, prompt_lengths=prompts.tolist(), trim=True)
    assert trimmed.tokens.shape == (2, 36)  # the longest row's 36 tokens, not 40 columns in each row
    assert torch.equal(trimmed.attention_mask()[0], packed.attention_mask()[0, :, :36, :36])
    for index, sequence in enumerate(sequences):
        assert torch.equal(trimmed.sequence(index), sequence)
    none, _ = packed_logprobs.response_logprobs_and_entropy(
        torch.zeros(*trimmed.tokens.shape, VOCAB), trimmed, prompts, responses, vocab_size=VOCAB, response_width=0)
    assert none.shape == (6, 0)  # no response columns asked for: nothing read
    with pytest.raises(ValueError, match="THD sequences cannot express"):
        packed.packed_seq_params()
    with pytest.raises(ValueError, match="more than 12 tokens"):
        packing.pack_rows(sequences, 12, 0, rows=[[3]], prompt_lengths=prompts.tolist())


def test_shared_prompt_logprob_pass_and_policy_loss_equal_the_padded_ones():
    """Three prompts' six rollouts: logprobs, the policy loss and every gradient from rows that hold
    each prompt once equal the padded layout's within 1e-6 (float rounding of different sums), while
    the model runs over 50 tokens instead of 64."""
    from aligner.models import logprobs
    from aligner.models.logprobs import response_mask
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows

    model = _tiny_model("llama")
    tokens, prompts, responses = _group_rollouts()
    model.eval()
    padded = logprobs.sequence_logprobs([model], tokens, prompts, responses, vocab_size=VOCAB, temperature=0.7,
                                        response_width=12)
    shared = packed_logprobs.sequence_logprobs(
        [model], tokens, prompts, responses, vocab_size=VOCAB, temperature=0.7, pad_id=0, response_width=12,
        packing=packing.SharedPromptPackingSection(), row_length=48, share_prompts=True)
    torch.testing.assert_close(shared, padded, atol=1e-6, rtol=0)
    assert torch.all(shared[response_mask(responses, 12).logical_not()] == 0)

    model.train()
    generator = torch.Generator().manual_seed(5)
    mask = response_mask(responses, 12)
    rows = SequenceRows(tokens=tokens, prompt_lengths=prompts, response_lengths=responses, mask=mask)
    targets = PolicyTargets(old_logprobs=torch.where(mask, -torch.rand(6, 12, generator=generator), 0),
                            advantages=torch.randn(6, 12, generator=generator) * mask)
    results = {}
    for share in (False, True):
        planner, objective = _policy_planner([f"packing.enabled={str(share).lower()}", "trainer.micro_batch_size=6"],
                                             model)
        microbatches = planner.scale_losses(planner.policy_microbatches(rows, targets,
                                                                        torch.tensor([5, 3, 0, 1, 4, 2])))
        model.zero_grad(set_to_none=True)
        total = 0.0
        for microbatch in microbatches:
            loss, _, report = objective.loss(microbatch, objective.forward(model, microbatch))
            loss.backward()
            total += float(loss)
        count = len(microbatches)
        results[share] = (sum(m.real_tokens for m in microbatches), total / count,
                          {name: p.grad / count for name, p in model.named_parameters()}, microbatches)
    (padded_tokens, padded_loss, padded_grads, _), (shared_tokens, shared_loss, shared_grads, packed) = \
        results[False], results[True]
    assert planner.shares_prompts and planner.row_length == 48 and planner.rows_per_micro_batch == 3
    assert all(m.packed.shares_prompts for m in packed)
    assert (padded_tokens, shared_tokens) == (64, 50)
    assert shared_loss == pytest.approx(padded_loss, abs=1e-6)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_shared_prompts_are_off_where_asked_and_on_transformer_engine_attention():
    model = _tiny_model("llama")
    assert packing.shares_prompts_here(packing.SharedPromptPackingSection(), model)
    assert not packing.shares_prompts_here(packing.PackingSection(), model)  # only the RL actor shares prompts
    assert not packing.shares_prompts_here(packing.SharedPromptPackingSection(share_prompts=False), model)
    assert not packing.shares_prompts_here(packing.SharedPromptPackingSection(enabled=False), model)
    model._aligner_thd_attention = True  # as `uses_thd_attention` finds transformer-engine's attention
    assert not packing.shares_prompts_here(packing.SharedPromptPackingSection(), model)
    model._aligner_thd_attention = False
    for settings in (["packing.share_prompts=false"], ["rollout.samples_per_prompt=1"]):
        planner, _ = _policy_planner(settings, model)  # the padded row's length: no groups to make room for
        assert (planner.row_length, planner.rows_per_micro_batch) == (24, 2)
    assert _policy_planner(["packing.row_length=30"], model)[0].row_length == 30
