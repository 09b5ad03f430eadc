"""Token-budget micro batches (packing.micro_batch_tokens): the plan (balanced across data-parallel
ranks, every micro batch within the budget, as many micro batches on every rank), the config checks,
and losses and gradients equal to the fixed-size micro batches' within 1e-6 (RL policy loss, DPO,
reward models), data-parallel ranks simulated in one process: megatron sums the ranks' gradients and
divides by the count summed over every rank's micro batches, which is what these tests do."""
from __future__ import annotations

import random

import pytest
import torch

from aligner.models import packing
from aligner.runtime.errors import ConfigError

from .test_packing import VOCAB, _actor_config, _policy_planner, _sequences, _tiny_model

pytestmark = pytest.mark.usefixtures("single_process")


def _check_plan(items, ranks, budget, row_length, plan):
    assert len(plan) == ranks
    assert len({len(batches) for batches in plan}) == 1  # as many micro batches on every rank
    planned = sorted(item for batches in plan for batch in batches for item in batch)
    assert planned == list(range(len(items)))
    for batches in plan:
        for batch in batches:  # packed rows within the budget, or one item alone
            lengths = [length for i in batch for length in items[i]]
            assert len(batch) <= 1 or len(packing.first_fit_rows(lengths, row_length)) * row_length <= budget
    sizes = [sum(item) for item in items]
    totals = [sum(sizes[i] for batch in batches for i in batch) for batches in plan]
    assert max(totals) - min(totals) <= max(sizes)


@pytest.mark.parametrize("per_item", [1, 2])  # sequences (RL, regression) or pairs (DPO, ranking)
def test_plans_on_random_lengths_are_balanced_within_the_longest_item_and_keep_the_budget(per_item):
    rng = random.Random(per_item)
    for _ in range(300):
        count, ranks = rng.randint(1, 40), rng.randint(1, 5)
        row_length = rng.choice([8, 64, 512])
        items = [[rng.randint(1, row_length) for _ in range(per_item)] for _ in range(count)]
        budget = rng.randint(row_length, 4 * row_length)
        _check_plan(items, ranks, budget, row_length, packing.plan_token_budget(items, ranks, budget, row_length))
        sizes = [sum(item) for item in items]
        totals = [sum(sizes[i] for i in part) for part in packing.balanced_partition(sizes, ranks)]
        assert max(totals) - min(totals) <= max(sizes)


def test_a_budget_counts_the_packed_rows_with_their_tail_padding():
    # 3 + 3 + 3 tokens fit 12 real tokens, but rows of 4 hold one each: 3 rows = 12 cells.
    assert packing.token_budget_micro_batches([[3], [3], [3], [3]], 8, 4) == [[0, 1], [2, 3]]
    assert packing.token_budget_micro_batches([[2, 2], [4, 4]], 8, 4) == [[1], [0]]


def test_uneven_counts_split_the_largest_micro_batch_then_add_empty_ones():
    items = [[3], [1], [1], [1], [1], [1]]
    assert packing.even_micro_batch_counts([[[0, 1, 2]], [[3], [4], [5]]], items, 8, 8) == [
        [[0], [1], [2]], [[3], [4], [5]]]
    assert packing.even_micro_batch_counts([[[0]], [[1, 2], [3, 4], [5]]], items, 8, 8) == [
        [[0], [], []], [[1, 2], [3, 4], [5]]]
    # Pairs: rank 0 holds one pair of two full rows (over the budget: alone), rank 1 six short pairs,
    # three per row of 6 = one row per micro batch.
    plan = packing.plan_token_budget([[6, 6], *[[1, 1]] * 6], 2, 6, 6)
    assert plan[0] == [[0], []] and sorted(map(sorted, plan[1])) == [[1, 2, 3], [4, 5, 6]]


def test_sequences_of_one_prompt_are_planned_with_the_prompt_once():
    # Four samples of one prompt (6 prompt + 2 response tokens each), rows of 16, a budget of one row:
    # shared they fill one row (6 + 4 x 2 = 14 tokens), unshared two (4 x 8).
    items, prompts = [[8]] * 4, [[(6, "p")]] * 4
    assert packing.plan_token_budget(items, 1, 16, 16, prompts) == [[[0, 1, 2, 3]]]
    assert len(packing.plan_token_budget(items, 1, 16, 16)[0]) == 2
    # The samples as one item (as the RL actor plans a prompt's samples): one prompt, 6 + 8 x 2 tokens,
    # is cut by the rows (`shared_prompt_parts`), not by the budget.
    assert packing.shared_prompt_parts([8] * 8, [6] * 8, ["p"] * 8, 16) == [[0, 1, 2, 3, 4], [5, 6, 7]]


@pytest.mark.parametrize("per_item", [1, 2])  # samples (RL) or a pair's two sequences (DPO)
def test_plans_sharing_prompts_keep_the_budget_as_the_rows_are_laid_out_and_need_fewer_micro_batches(per_item):
    rng = random.Random(10 + per_item)
    shared_total = unshared_total = 0
    for _ in range(200):
        count, ranks, row_length = rng.randint(1, 30), rng.randint(1, 4), rng.choice([16, 64])
        budget = rng.randint(row_length, 4 * row_length)
        items, prompts = [], []
        for _ in range(count):
            prompt = rng.randint(1, row_length // 2)
            key = (prompt, rng.randint(0, 3))  # a few prompts of each length: groups
            items.append([prompt + rng.randint(1, row_length - prompt) for _ in range(per_item)])
            prompts.append([(prompt, key)] * per_item)
        plan = packing.plan_token_budget(items, ranks, budget, row_length, prompts)
        assert len({len(batches) for batches in plan}) == 1
        assert sorted(i for batches in plan for batch in batches for i in batch) == list(range(count))
        for batches in plan:
            for batch in batches:  # the rows `packed_rows_plan` lays out, within the budget, or one item alone
                lengths = [n for i in batch for n in items[i]]
                layout = packing.packed_rows_plan(lengths, row_length, (
                    [length for i in batch for length, _ in prompts[i]], [key for i in batch for _, key in prompts[i]]),
                    no_more_rows=True)
                assert len(batch) <= 1 or len(layout) * row_length <= budget
        shared_total += len(plan[0])
        unshared_total += len(packing.plan_token_budget(items, ranks, budget, row_length)[0])
    assert shared_total < unshared_total


def test_config_errors_name_the_key():
    from aligner.algorithms.dpo import DPOConfig
    from aligner.config import CONF_DIR, load_config

    data = ["data.train=[{path: x.jsonl}]"]
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens=0"):
        load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml", [*data, "packing.micro_batch_tokens=0"])
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens .*packing.enabled=true"):
        load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml", [*data, "packing.micro_batch_tokens=64",
                                                           "packing.enabled=false"])
    cfg = load_config(DPOConfig, CONF_DIR / "gpt_dpo.yaml", [*data, "packing.micro_batch_tokens=64",
                                                             "data.max_seq_length=60", "data.pad_to_multiple_of=8"])
    cfg.packing.check_layout(1, *cfg.data.longest_row)
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens needs parallel.pipeline_model_parallel_size=1"):
        cfg.packing.check_layout(2, *cfg.data.longest_row)
    cfg.data.max_seq_length = 61  # padded to 64 tokens: still one row
    cfg.packing.check_layout(1, *cfg.data.longest_row)
    cfg.data.max_seq_length = 65
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens=64 must hold one packed row: at least "
                                          "data.max_seq_length rounded up to data.pad_to_multiple_of = 72"):
        cfg.packing.check_layout(1, *cfg.data.longest_row)
    cfg.packing.row_length = 80
    with pytest.raises(ConfigError, match="at least packing.row_length = 80"):
        cfg.packing.check_layout(1, *cfg.data.longest_row)
    cfg.data.pad_to_multiple_of, cfg.packing.row_length = None, None  # null on a CPU: no rounding
    assert cfg.data.longest_row[0] == 65
    with pytest.raises(ConfigError, match="data.max_seq_length rounded up to data.pad_to_multiple_of = 65"):
        cfg.packing.check_layout(1, *cfg.data.longest_row)
    cfg.data.max_seq_length = 64  # exactly one row of the budget
    cfg.packing.check_layout(1, *cfg.data.longest_row)
    rl_cfg = _actor_config(["packing.micro_batch_tokens=64", "parallel.pipeline_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens needs parallel.pipeline_model_parallel_size"):
        rl_cfg.validate(1)
    rl_cfg = _actor_config(["packing.micro_batch_tokens=64", "data.max_prompt_length=60"])
    with pytest.raises(ConfigError, match="packing.micro_batch_tokens=64 must hold one packed row: at least "
                                          "data.max_prompt_length \\+ generation.max_new_tokens"):
        rl_cfg.validate(1)


# ----------------------------------------------------------------------------- RL policy loss
def _experience(rows, seed, samples=1):
    """(SequenceRows, PolicyTargets) of `rows` rollouts (prompt 2..9, response 1..12 tokens) right-padded to 24
    columns; each `samples` consecutive rollouts of one prompt."""
    from aligner.models.logprobs import response_mask
    from aligner.training.microbatch_plan import PolicyTargets, SequenceRows

    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, 10, (rows // samples,), generator=generator).repeat_interleave(samples)
    responses = torch.randint(1, 13, (rows,), generator=generator)
    tokens = torch.zeros(rows, 24, dtype=torch.long)
    for row, sequence in enumerate(_sequences((prompts + responses).tolist(), seed)):
        tokens[row, :len(sequence)] = sequence
        first = row - row % samples
        tokens[row, :prompts[row]] = tokens[first, :prompts[row]]
    mask = response_mask(responses, 12)
    old = torch.where(mask, -torch.rand(rows, 12, generator=generator) * 3, 0)
    return (SequenceRows(tokens=tokens, prompt_lengths=prompts, response_lengths=responses, mask=mask),
            PolicyTargets(advantages=torch.randn(rows, 12, generator=generator) * mask, old_logprobs=old))


def _minibatch_loss_and_gradients(model, planned, microbatches):
    """Megatron's result for micro batches of every rank: sum of losses and gradients / micro batches.
    planned: (the planner that scales the losses, the objective)."""
    planner, objective = planned
    microbatches = planner.scale_losses(microbatches)
    model.zero_grad(set_to_none=True)
    total = 0.0
    for microbatch in microbatches:
        loss, count, _ = objective.loss(microbatch, objective.forward(model, microbatch))
        assert int(count) == 1
        loss.backward()
        total += float(loss)
    count = len(microbatches)
    return total / count, {name: p.grad / count for name, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_token_budget_policy_micro_batches_give_the_fixed_size_loss_and_gradients(aggregation, ranks):
    """A minibatch of 8 rollouts per rank: fixed micro batches of 2 padded rollouts against token
    budgets of 40 tokens balanced across `ranks` ranks (one process plays every rank)."""
    model = _tiny_model("llama").train()
    per_rank = 8
    rows, targets = _experience(per_rank * ranks, seed=ranks)
    settings = [f"loss.aggregation={aggregation}", f"trainer.global_batch_size={per_rank * ranks}"]
    fixed = _policy_planner(["packing.enabled=false", *settings])
    fixed_batches = fixed[0].policy_microbatches(rows, targets, torch.arange(per_rank * ranks))
    budget_batches, counts = [], set()
    for rank in range(ranks):
        budget = _policy_planner(["packing.micro_batch_tokens=40", *settings], model, rank=rank, ranks=ranks)
        plan = budget[0].budget_plan(rows, step=0, epoch=0, minibatch=0)
        counts.add(len(plan))
        for micro in plan:
            assert sum(int(rows.prompt_lengths[i] + rows.response_lengths[i]) for row in micro for i in row) <= 40
        budget_batches += budget[0].policy_microbatches(rows, targets, torch.arange(0), plan)
    assert len(counts) == 1
    fixed_loss, fixed_grads = _minibatch_loss_and_gradients(model, fixed, fixed_batches)
    budget_loss, budget_grads = _minibatch_loss_and_gradients(model, budget, budget_batches)
    assert budget_loss == pytest.approx(fixed_loss, abs=1e-6)
    for name, grad in fixed_grads.items():
        torch.testing.assert_close(budget_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("ranks", [1, 2])
def test_token_budgets_plan_a_prompts_samples_with_the_prompt_once_and_give_the_fixed_size_loss(ranks):
    """Groups of 4 samples of one prompt, budgets of 2 rows of 24 tokens: planned with the prompt held
    once, they need fewer packed rows (and no more micro batches) than planned unshared, each at most 2
    rows, and the loss and gradients equal the padded micro batches' within 1e-6."""
    model = _tiny_model("llama").train()
    per_rank = 8
    rows, targets = _experience(per_rank * ranks, seed=11, samples=4)
    settings = [f"trainer.global_batch_size={per_rank * ranks}"]
    fixed = _policy_planner(["packing.enabled=false", *settings])
    fixed_batches = fixed[0].policy_microbatches(rows, targets, torch.arange(per_rank * ranks))
    counts = {}
    for share in (True, False):
        plans = []
        for rank in range(ranks):
            shared = _policy_planner(["packing.micro_batch_tokens=48", f"packing.share_prompts={str(share).lower()}",
                                      *settings], model, rank=rank, ranks=ranks)
            planner = shared[0]
            assert planner.shares_prompts == share and planner.row_length == 24
            plans.append(planner.budget_plan(rows, step=0, epoch=0, minibatch=0))
        assert len({len(plan) for plan in plans}) == 1
        assert sorted(i for plan in plans for micro in plan for row in micro for i in row) == list(
            range(per_rank * ranks))
        assert all(len(micro) * 24 <= 48 for plan in plans for micro in plan)  # packed rows x their length
        counts[share] = (len(plans[0]), sum(len(micro) for plan in plans for micro in plan))  # micro batches, rows
        if share:
            shared_planner = shared
            batches = [batch for plan in plans for batch in planner.policy_microbatches(
                rows, targets, torch.arange(0), plan)]
    assert counts[True][0] <= counts[False][0] and counts[True][1] < counts[False][1]
    assert shared_planner[0].prompts_of(rows, []) == ([], [])  # an evened, empty micro batch
    assert sum(b.packed.real_tokens for b in batches) < int((rows.prompt_lengths + rows.response_lengths).sum())
    _assert_same(_minibatch_loss_and_gradients(model, shared_planner, batches),
                 _minibatch_loss_and_gradients(model, fixed, fixed_batches))


def test_an_empty_policy_micro_batch_has_zero_loss_and_gradient():
    model = _tiny_model("llama").train()
    planner, objective = _policy_planner(["packing.micro_batch_tokens=40"])
    rows, targets = _experience(4, seed=5)
    (empty,) = planner.policy_microbatches(rows, targets, torch.arange(0), plan=[[]])
    loss, count, report = objective.loss(empty, objective.forward(model, empty))
    loss.backward()
    assert float(loss) == 0 and int(count) == 1 and report == {}
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


def test_with_token_budgets_the_first_minibatch_trains_on_the_logprob_pass_rows_bit_for_bit():
    """The logprob pass plans the first epoch's token-budget micro batches, so the first minibatch's
    training logprobs (the output layer deferred, as the trainer runs it) equal the old ones exactly."""
    from aligner.models.deferred_output import forward_deferred
    from aligner.models.packed_logprobs import response_logprobs_and_entropy

    model = _tiny_model("llama").eval()
    rows, targets = _experience(12, seed=9)
    planner, objective = _policy_planner(["trainer.global_batch_size=6", "trainer.micro_batch_size=1",
                                          "packing.micro_batch_tokens=30"], model)
    old = planner.plan_step(3, rows).logprobs([model], VOCAB, 0.7, 12)
    plan = planner.logprob_plan(rows, 3)
    assert sorted(i for micro in plan for row in micro for i in row) == list(range(12))
    targets.old_logprobs = old
    first = planner.budget_plan(rows, 3, 0, 0)
    assert len(first) > 1
    for microbatch in planner.policy_microbatches(rows, targets, torch.arange(0), first):
        with torch.no_grad():
            trained, _ = response_logprobs_and_entropy(
                forward_deferred(model, objective.forward, microbatch), microbatch.packed,
                microbatch.prompt_lengths, microbatch.response_lengths, vocab_size=VOCAB, temperature=0.7,
                response_width=12)
        assert torch.equal(trained, microbatch.old_logprobs)


# ----------------------------------------------------------------------------- DPO and reward models
def _loader_steps(dataset, collate, ranks, budget, micro_batch_size=2, global_batch_size=8, section=None):
    """Every rank's micro batches of the first step (budget None: micro_batch_size items each)."""
    from aligner.data.loader import MicroBatchLoader

    steps = []
    for rank in range(ranks):
        loader = MicroBatchLoader(dataset, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                  data_parallel_rank=rank, data_parallel_size=ranks, seed=3, shuffle=True, pad_id=0,
                                  pad_to_multiple_of=8, collate_fn=collate,
                                  packing=section or packing.PackingSection(micro_batch_tokens=budget))
        steps.append(next(loader.iterate(0)))
    return steps


def _global_loss_and_gradients(model, objective, steps):
    """Megatron's result over every rank's micro batches: summed losses and gradients / summed counts."""
    model.zero_grad(set_to_none=True)
    total, counted = 0.0, 0
    for microbatches in steps:
        for batch in microbatches:
            loss, count, _ = objective.loss(batch, objective.forward(model, batch))
            loss.backward()
            total += float(loss)
            counted += int(count)
    return total / counted, {name: p.grad / counted for name, p in model.named_parameters() if p.grad is not None}


def _assert_same(first, second):
    assert first[0] == pytest.approx(second[0], abs=1e-6)
    for name, grad in second[1].items():
        torch.testing.assert_close(first[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def _dpo_setup(tmp_path, tokenizer_dir):
    """(a 2-layer policy, a DPO objective for a packing section, 16 arithmetic pairs with reference logprobs)."""
    from aligner.algorithms.dpo import DPOObjective, DPOSection
    from aligner.data.preference import PreferenceDataset
    from aligner.demo import arithmetic
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.tokenizer import Tokenizer

    from ..conftest import write_jsonl

    tokenizer = Tokenizer(tokenizer_dir)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(4)
    policy = build_gpt_model(cfg, transformer_config(cfg))
    dataset = PreferenceDataset.from_jsonl(write_jsonl(tmp_path / "pairs.jsonl",
                                                       arithmetic.preference_records(16, seed=5)), tokenizer, 32)
    generator = torch.Generator().manual_seed(6)
    dataset.reference_logprobs = -torch.rand(len(dataset), 2, generator=generator) * 10

    def objective(section):
        return DPOObjective(DPOSection(beta=0.5, sft_loss_weight=0.3), cfg.vocab_size, section, tokenizer.pad_id)

    return policy, objective, dataset


@pytest.mark.parametrize("ranks", [1, 2])
def test_token_budget_dpo_micro_batches_give_the_fixed_size_loss_and_gradients(tmp_path, arithmetic_tokenizer_dir,
                                                                               ranks):
    from aligner.data.preference import collate_preferences

    policy, make_objective, dataset = _dpo_setup(tmp_path, arithmetic_tokenizer_dir)
    objective = make_objective(packing.PackingSection())
    fixed = _global_loss_and_gradients(policy, objective, _loader_steps(dataset, collate_preferences, ranks, None))
    steps = _loader_steps(dataset, collate_preferences, ranks, 40)
    assert len({len(microbatches) for microbatches in steps}) == 1
    for microbatches in steps:
        for batch in microbatches:
            lengths = batch["prompt_lengths"] + batch["response_lengths"]
            assert int(lengths.sum()) <= 40 or len(lengths) == 2
    _assert_same(_global_loss_and_gradients(policy, objective, steps), fixed)


@pytest.mark.parametrize("ranks", [1, 2])
def test_token_budget_dpo_pairs_sharing_their_prompt_are_planned_with_it_once(tmp_path, arithmetic_tokenizer_dir,
                                                                             ranks):
    """DPO with shared prompts: the loader plans each pair's prompt once, as the objective packs it, so a
    micro batch's packed rows keep the budget (rows x length) while holding more than the budget of unshared
    tokens; loss and gradients equal the fixed-size micro batches' within 1e-6."""
    from aligner.data.preference import collate_preferences

    policy, make_objective, dataset = _dpo_setup(tmp_path, arithmetic_tokenizer_dir)
    fixed = _global_loss_and_gradients(policy, make_objective(packing.SharedPromptPackingSection()),
                                       _loader_steps(dataset, collate_preferences, ranks, None))
    budget = 32
    section = packing.SharedPromptPackingSection(micro_batch_tokens=budget)
    steps = _loader_steps(dataset, collate_preferences, ranks, budget, section=section)
    shared = _global_loss_and_gradients(policy, make_objective(section), steps)
    assert len({len(microbatches) for microbatches in steps}) == 1
    over_unshared = 0
    for microbatches in steps:
        for batch in microbatches:
            rows, width = batch["packed"].tokens.shape[0], batch["tokens"].shape[1]
            assert rows * width <= budget or len(batch["tokens"]) == 2  # one pair alone may need more
            over_unshared += int((batch["prompt_lengths"] + batch["response_lengths"]).sum()) > budget
    assert over_unshared > 0  # planned unshared, no micro batch would hold more than the budget of tokens
    _assert_same(shared, fixed)


@pytest.mark.parametrize("kind", ["ranking", "regression"])
def test_token_budget_reward_model_micro_batches_give_the_fixed_size_loss_and_gradients(kind):
    from aligner.algorithms.reward_model import RankingObjective, RegressionObjective
    from aligner.data.reward import collate_comparisons, collate_regression
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import build_reward_model

    cfg = GPTConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    torch.manual_seed(5)
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=1 if kind == "ranking" else 2)
    generator = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 30, (16,), generator=generator).tolist()
    sequences = _sequences(lengths, seed=6)
    if kind == "ranking":
        dataset = [{"chosen": sequences[i], "rejected": sequences[i + 1]} for i in range(0, 16, 2)]
        collate, objective = collate_comparisons, RankingObjective(packing.PackingSection())
    else:
        dataset = [{"tokens": sequence, "labels": torch.randn(2, generator=generator),
                    "label_mask": torch.tensor([1.0, float(i % 2)])} for i, sequence in enumerate(sequences)]
        collate, objective = collate_regression, RegressionObjective(["a", "b"], packing.PackingSection())
    size, budget = len(dataset), 70 if kind == "ranking" else 40  # micro batches of one to three items
    fixed = _global_loss_and_gradients(model, objective, _loader_steps(dataset, collate, 2, None, 2, size))
    steps = _loader_steps(dataset, collate, 2, budget, 2, size)
    assert len({len(microbatches) for microbatches in steps}) == 1
    _assert_same(_global_loss_and_gradients(model, objective, steps), fixed)


def test_empty_dpo_and_reward_model_micro_batches_have_zero_loss_count_and_gradient():
    from aligner.algorithms.dpo import DPOObjective, DPOSection
    from aligner.algorithms.reward_model import RankingObjective
    from aligner.data.reward import collate_comparisons
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import build_reward_model

    policy = _tiny_model("llama").train()
    empty = {"tokens": torch.zeros(0, 24, dtype=torch.long), "prompt_lengths": torch.zeros(0, dtype=torch.long),
             "response_lengths": torch.zeros(0, dtype=torch.long), "reference_logprobs": torch.zeros(0)}
    dpo = DPOObjective(DPOSection(), VOCAB, packing.PackingSection(), 0)
    cfg = GPTConfig.llama(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                          make_vocab_size_divisible_by=8, max_position_embeddings=64)
    scorer = build_reward_model(cfg, transformer_config(cfg), num_attributes=1)
    comparisons = collate_comparisons([{"chosen": torch.tensor([3, 4]), "rejected": torch.tensor([5])}], 0)
    no_rows = {key: value[:0] for key, value in comparisons.items() if value is not None}
    for model, objective, batch in ((policy, dpo, empty),
                                    (scorer, RankingObjective(packing.PackingSection()), no_rows)):
        loss, count, report = objective.loss(batch, objective.forward(model, batch))
        loss.backward()
        assert float(loss) == 0 and int(count) == 0 and report == {}
        assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters() if p.grad is not None)
