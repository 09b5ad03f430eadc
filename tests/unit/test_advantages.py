"""The advantage estimators (aligner.rl.advantages) against float64 loops over rows and tokens."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import advantages as A
from aligner.rl import masked as S  # the masked statistics
from aligner.rl import shaping as M

# Three prompts, k = 2, uneven responses (one full row, one single-token row).
LENGTHS = [5, 2, 1, 4, 3, 5]
T = 5
KL_COEF = 0.1


def make_mask(lengths=LENGTHS, width=T) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)  # [B, T] bool


def garbage_tokens(seed: int, lengths=LENGTHS, pad=float("nan")) -> torch.Tensor:
    """[B, T] float64 values with `pad` off the mask (it must never reach a result)."""
    values = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.where(make_mask(lengths), values, torch.tensor(pad, dtype=torch.float64))


def make_inputs(seed: int, group_size: int = 2, lengths=LENGTHS, values: bool = False, **overrides):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(len(lengths), generator=generator, dtype=torch.float64)
    kl = garbage_tokens(seed + 1, lengths, pad=float("inf")).abs()
    fields = dict(scores=scores, kl=kl, kl_coef=KL_COEF, mask=make_mask(lengths), group_size=group_size,
                  values=garbage_tokens(seed + 2, lengths) if values else None)
    fields.update(overrides)
    return A.AdvantageInputs(**fields)


# ----------------------------------------------------------------------------- float64 references
def ref_sequence_rewards(inputs, lengths=LENGTHS) -> list[float]:
    return [float(inputs.scores[b]) - inputs.kl_coef * sum(float(inputs.kl[b, t]) for t in range(n))
            for b, n in enumerate(lengths)]


def ref_group_advantages(rewards: list[float], k: int, baseline: str, normalize: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), k):
        group = rewards[start:start + k]
        mean = sum(group) / k
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (k - 1)) if k > 1 else 0.0
        for i, r in enumerate(group):
            if baseline == "rloo":
                b = sum(group[j] for j in range(k) if j != i) / (k - 1)
            elif baseline == "mean":
                b = mean
            else:
                b = 0.0
            out.append((r - b) / (std + eps) if normalize else r - b)
    return out


def ref_token_rewards(inputs, lengths=LENGTHS) -> list[list[float]]:
    return [[-inputs.kl_coef * float(inputs.kl[b, t]) + (float(inputs.scores[b]) if t == n - 1 else 0.0)
             for t in range(n)] for b, n in enumerate(lengths)]


def ref_whiten(rows: list[list[float]], shift_mean: bool = True, eps: float = 1e-8) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / len(flat)
    return [[(x - mean) / math.sqrt(var + eps) + (0.0 if shift_mean else mean) for x in row] for row in rows]


def ref_gae(rewards: list[list[float]], values, gamma: float, lam: float):
    advantages, returns = [], []
    for b, row in enumerate(rewards):
        n = len(row)
        adv, ret, running = [0.0] * n, [0.0] * n, 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            running = row[t] + gamma * next_value - float(values[b, t]) + gamma * lam * running
            adv[t], ret[t] = running, running + float(values[b, t])
        advantages.append(adv)
        returns.append(ret)
    return advantages, returns


def ref_return_to_go(rewards: list[list[float]], gamma: float) -> list[list[float]]:
    return [[sum(gamma ** (s - t) * row[s] for s in range(t, len(row))) for t in range(len(row))] for row in rewards]


def assert_tokens(got: torch.Tensor, rows, lengths=LENGTHS, tol: float = 1e-10):
    """got [B, T] equals rows (a list per row, or one number per row broadcast) on the mask and is 0 off it."""
    for b, n in enumerate(lengths):
        for t in range(T):
            expected = 0.0
            if t < n:
                expected = rows[b] if isinstance(rows[b], float) else rows[b][t]
            assert float(got[b, t]) == pytest.approx(expected, rel=tol, abs=tol), (b, t)


# ----------------------------------------------------------------------------- sequence estimators
SEQUENCE_ESTIMATORS = {  # name -> (baseline, divide by the group std)
    "rloo": ("rloo", False), "grpo": ("mean", True), "dr_grpo": ("mean", False), "reinforce": ("none", False),
}


@pytest.mark.parametrize("name", SEQUENCE_ESTIMATORS)
@pytest.mark.parametrize("k", [2, 3])
def test_sequence_estimators_match_loops(name, k):
    inputs = make_inputs(seed=10 + k, group_size=k)
    settings = A.AdvantageSettings(std_eps=1e-6)
    result = A.compute_advantages(name, inputs, settings)
    rewards = ref_sequence_rewards(inputs)
    baseline, normalize = SEQUENCE_ESTIMATORS[name]
    if normalize:  # GRPO divides the scores by their group std, and subtracts the centred KL penalty as it is
        scores = [float(score) for score in inputs.scores]
        penalties = [score - reward for score, reward in zip(scores, rewards)]
        expected = [a - b for a, b in zip(ref_group_advantages(scores, k, baseline, True, 1e-6),
                                          ref_group_advantages(penalties, k, baseline, False, 1e-6))]
    else:
        expected = ref_group_advantages(rewards, k, baseline, normalize, 1e-6)
    assert result.returns is None
    torch.testing.assert_close(result.sequence_rewards, torch.tensor(rewards, dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)
    assert_tokens(result.advantages, expected)  # the sequence's advantage on every one of its tokens


def test_grpo_without_group_std_is_dr_grpo_and_rloo_is_a_scaled_group_mean():
    inputs = make_inputs(seed=20, group_size=3)
    unscaled = A.compute_advantages("grpo", inputs, A.AdvantageSettings(group_std=False)).advantages
    dr = A.compute_advantages("dr_grpo", inputs, A.AdvantageSettings()).advantages
    torch.testing.assert_close(unscaled, dr)
    rloo = A.compute_advantages("rloo", inputs, A.AdvantageSettings()).advantages
    torch.testing.assert_close(rloo, 1.5 * dr)  # RLOO = k / (k - 1) times the group-mean advantage


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr_grpo"])
def test_a_uniform_group_has_no_advantage(name):
    inputs = make_inputs(seed=21, group_size=2, kl_coef=0.0)
    inputs.scores[2:4] = 0.7  # the second prompt's two samples scored the same
    advantages = A.compute_advantages(name, inputs, A.AdvantageSettings(group_std=True, std_eps=1e-6)).advantages
    assert float(advantages[2:4].abs().max()) == 0.0  # std 0: still exactly 0, not 0 / eps blown up
    assert float(advantages[:2].abs().max()) > 0.0


def test_grpo_keeps_the_kl_penalty_unscaled_in_a_group_whose_scores_tie():
    # Dividing the penalised rewards by their std made a tied group's tiny KL differences into +-1 advantages.
    inputs = make_inputs(seed=22, group_size=2, kl_coef=0.01)
    inputs.scores[2:4] = 0.7
    advantages = A.compute_advantages("grpo", inputs, A.AdvantageSettings(group_std=True, std_eps=1e-6)).advantages
    kl_sums = [0.01 * sum(float(inputs.kl[b, t]) for t in range(LENGTHS[b])) for b in (2, 3)]
    for row, other in ((2, 3), (3, 2)):
        expected = -(kl_sums[row - 2] - kl_sums[other - 2]) / 2
        assert abs(expected) > 1e-4
        assert float(advantages[row, 0]) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_refuse_one_sample_per_prompt(name):
    inputs = make_inputs(seed=22, group_size=1)
    with pytest.raises(ValueError, match=f"'{name}' needs at least 2 samples per prompt, got 1"):
        A.compute_advantages(name, inputs, A.AdvantageSettings(group_std=True))


# ----------------------------------------------------------------------------- gae and REINFORCE++
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("whiten_advantages", [False, True])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_matches_loop(whiten_rewards, whiten_advantages, gamma, lam):
    inputs = make_inputs(seed=30, values=True)
    settings = A.AdvantageSettings(gamma=gamma, lam=lam, whiten_rewards=whiten_rewards,
                                   whiten_advantages=whiten_advantages)
    result = A.compute_advantages("gae", inputs, settings)
    rewards = ref_token_rewards(inputs)
    if whiten_rewards:
        rewards = ref_whiten(rewards, shift_mean=False)
    advantages, returns = ref_gae(rewards, inputs.values, gamma, lam)
    if whiten_advantages:
        advantages = ref_whiten(advantages)
    assert_tokens(result.advantages, advantages)
    assert_tokens(result.returns, returns)  # the critic's targets: before whitening
    torch.testing.assert_close(result.sequence_rewards, torch.tensor(ref_sequence_rewards(inputs), dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_gae_is_exactly_the_ppo_path():
    """The same shaping calls in the same order, bit for bit in float32: PPO's metrics stay what they were."""
    inputs = make_inputs(seed=31, values=True)
    inputs.scores, inputs.kl, inputs.values = inputs.scores.float(), inputs.kl.float(), inputs.values.float()
    settings = A.AdvantageSettings(gamma=0.99, lam=0.95, whiten_rewards=True, whiten_advantages=True)
    result = A.compute_advantages("gae", inputs, settings)
    rewards = M.token_rewards(inputs.scores, inputs.kl, inputs.mask, inputs.kl_coef)
    rewards = S.masked_whiten(rewards, inputs.mask, shift_mean=False)
    advantages, returns = M.gae_advantages(rewards, inputs.values, inputs.mask, 0.99, 0.95)
    advantages = S.masked_whiten(advantages, inputs.mask)
    assert torch.equal(result.advantages, advantages) and torch.equal(result.returns, returns)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop(gamma):
    inputs = make_inputs(seed=40, group_size=3)
    result = A.compute_advantages("reinforce_plus_plus", inputs, A.AdvantageSettings(gamma=gamma))
    expected = ref_whiten(ref_return_to_go(ref_token_rewards(inputs), gamma))
    assert_tokens(result.advantages, expected)
    assert result.returns is None
    torch.testing.assert_close(result.sequence_rewards, torch.tensor(ref_sequence_rewards(inputs), dtype=torch.float64),
                               rtol=1e-12, atol=1e-12)


def test_discounted_returns_match_loop():
    rewards = garbage_tokens(41)
    expected = ref_return_to_go([[float(rewards[b, t]) for t in range(n)] for b, n in enumerate(LENGTHS)], 0.8)
    assert_tokens(A.discounted_returns(rewards, make_mask(), 0.8), expected)


@pytest.mark.parametrize("name,values", [("gae", True), ("reinforce_plus_plus", False), ("grpo", False)])
def test_group_path_equals_the_local_one(world_group, name, values):
    inputs = make_inputs(seed=50, values=values)
    local = A.compute_advantages(name, inputs, A.AdvantageSettings(whiten_rewards=True))
    inputs.group = world_group
    grouped = A.compute_advantages(name, inputs, A.AdvantageSettings(whiten_rewards=True))
    torch.testing.assert_close(grouped.advantages, local.advantages, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- helpers, registry, errors
def test_leave_one_out_baseline_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 5.0], dtype=torch.float64)
    assert A.leave_one_out_baseline(rewards, 3).tolist() == [0.0, 0.5, 0.5, 4.0, 3.0, 2.0]
    assert A.group_mean_baseline(rewards, 3).tolist() == [1 / 3] * 3 + [3.0] * 3
    assert A.group_std(rewards, 3).tolist() == pytest.approx([math.sqrt(1 / 3)] * 3 + [2.0] * 3)


def test_informative_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, -1.0, -1.0, -1.0 + 1e-6])
    assert A.informative_groups(scores, 3).tolist() == [False, True, False, True]
    assert A.informative_groups(scores, 1).tolist() == [False] * 12  # one sample: nothing to compare
    with pytest.raises(ValueError, match="groups of 5"):
        A.informative_groups(scores, 5)


def test_token_advantages_broadcast_the_sequence_advantage_over_its_response():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    got = A.token_advantages(torch.tensor([0.5, -2.0], dtype=torch.float64), mask)
    assert got.tolist() == [[0.5, 0.5, 0.0], [-2.0, 0.0, 0.0]] and got.dtype == torch.float64


def test_registry_and_errors(monkeypatch):
    assert set(A.ADVANTAGE_ESTIMATORS) == {"gae", "rloo", "grpo", "dr_grpo", "reinforce", "reinforce_plus_plus",
                                           "on_policy_distillation"}
    assert A.ADVANTAGE_ESTIMATORS["gae"].needs_values and A.ADVANTAGE_ESTIMATORS["rloo"].min_group_size == 2
    settings = A.AdvantageSettings()
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; choose one of gae, rloo, grpo"):
        A.compute_advantages("ppo", make_inputs(0), settings)
    with pytest.raises(ValueError, match="'gae' needs the critic's values"):
        A.compute_advantages("gae", make_inputs(0), settings)
    with pytest.raises(ValueError, match="'rloo' needs at least 2 samples per prompt, got 1"):
        A.compute_advantages("rloo", make_inputs(0, group_size=1), settings)
    with pytest.raises(ValueError, match="6 samples cannot be split into groups of 4"):
        A.compute_advantages("reinforce", make_inputs(0, group_size=4), settings)
    with pytest.raises(ValueError, match="one value per sample"):
        A.groups(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="scores shape"):
        A.sequence_rewards(torch.zeros(3), torch.zeros(2, 4), torch.ones(2, 4, dtype=torch.bool), 0.1)

    # A new estimator is a registered function; its name is then accepted.
    monkeypatch.setattr(A, "ADVANTAGE_ESTIMATORS", dict(A.ADVANTAGE_ESTIMATORS))

    @A.register_advantage_estimator("zero")
    def zero(inputs, settings):
        return A.Advantages(torch.zeros(inputs.mask.shape), None, inputs.scores)

    assert float(A.compute_advantages("zero", make_inputs(0), settings).advantages.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="'zero' is already registered"):
        A.register_advantage_estimator("zero")(zero)


def test_on_policy_distillation_credits_each_token_its_own_reward():
    """advantage[b, t] = score_b - kl_coef * kl[b, t] on the mask (no baseline, no discount), 0 off it."""
    inputs = make_inputs(3)
    out = A.compute_advantages("on_policy_distillation", inputs, A.AdvantageSettings())
    for b, n in enumerate(LENGTHS):
        for t in range(T):
            expected = float(inputs.scores[b]) - KL_COEF * float(inputs.kl[b, t]) if t < n else 0.0
            assert float(out.advantages[b, t]) == pytest.approx(expected, abs=1e-14), (b, t)
    assert out.sequence_rewards.tolist() == pytest.approx(ref_sequence_rewards(inputs), abs=1e-14)
    assert out.returns is None
