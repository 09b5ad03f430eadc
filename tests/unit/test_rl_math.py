"""Reward shaping, KL, GAE and the value loss (aligner.rl.shaping) against straightforward float64 references
written as loops."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.rl import masked as S  # the masked statistics
from aligner.rl import shaping as M
from aligner.rl.policy_losses import aggregate_loss

LENGTHS = [6, 3, 1, 4]  # one full row, one single-token row
T = 6


def make_mask(lengths=LENGTHS, width=T) -> torch.Tensor:
    return torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)  # [batch, T] bool, right-padded


def random_tokens(seed: int, scale: float = 1.0, shift: float = 0.0, pad=float("nan")) -> torch.Tensor:
    """[batch, T] float32 values with `pad` off the mask (nan by default: it must never leak)."""
    values = torch.randn(len(LENGTHS), T, generator=torch.Generator().manual_seed(seed)) * scale + shift
    return torch.where(make_mask(), values, torch.tensor(pad))


def on_mask(values: torch.Tensor, lengths=LENGTHS) -> list[float]:
    """The response entries, row by row, as Python floats (float64)."""
    return [float(values[b, t]) for b, n in enumerate(lengths) for t in range(n)]


def ref_mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def ref_var(xs: list[float], unbiased: bool = False) -> float:
    mean = ref_mean(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - (1 if unbiased else 0))


# ----------------------------------------------------------------------------- masked statistics
def test_zero_off_mask_replaces_garbage_and_checks_shapes():
    values = random_tokens(40, pad=float("inf"))
    zeroed = S.zero_off_mask(values, make_mask())
    for b, n in enumerate(LENGTHS):
        for t in range(T):
            assert float(zeroed[b, t]) == (float(values[b, t]) if t < n else 0.0)
    with pytest.raises(ValueError, match="does not match"):
        S.zero_off_mask(values, make_mask()[:, :3])


def test_response_lengths_and_right_padding_check():
    assert S.response_lengths(make_mask()).tolist() == LENGTHS
    holey = make_mask().clone()
    holey[0, 2] = False
    with pytest.raises(ValueError, match=r"rows \[0\] are not right-padded"):
        S.response_lengths(holey)


def test_masked_sum_and_mean_match_loops_and_ignore_padding():
    values = random_tokens(0)
    mask = make_mask()
    assert float(S.masked_sum(values, mask)) == pytest.approx(sum(on_mask(values)), rel=1e-6)
    assert float(S.masked_mean(values, mask)) == pytest.approx(ref_mean(on_mask(values)), rel=1e-6)
    per_row = S.masked_mean(values, mask.float(), dim=-1)  # a 0/1 float mask works the same
    for b, n in enumerate(LENGTHS):
        assert float(per_row[b]) == pytest.approx(ref_mean([float(values[b, t]) for t in range(n)]), rel=1e-6)


def test_masked_mean_empty_mask_raises():
    values = torch.ones(2, 3)
    with pytest.raises(ValueError, match="mask is empty"):
        S.masked_mean(values, torch.zeros(2, 3, dtype=torch.bool))
    row_empty = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    with pytest.raises(ValueError, match="some slice along dim 1"):
        S.masked_mean(values, row_empty, dim=1)
    with pytest.raises(ValueError, match="does not match"):
        S.masked_mean(values, torch.ones(3, 2))


@pytest.mark.parametrize("unbiased", [False, True])
def test_masked_var_matches_loop(unbiased):
    values = random_tokens(1, scale=2.0, shift=5.0)
    expected = ref_var(on_mask(values), unbiased)
    assert float(S.masked_var(values, make_mask(), unbiased=unbiased)) == pytest.approx(expected, rel=1e-6)


def test_masked_var_needs_enough_entries():
    one = torch.tensor([[3.0, 0.0]])
    mask = torch.tensor([[True, False]])
    assert float(S.masked_var(one, mask)) == 0.0
    with pytest.raises(ValueError, match="at least 2 masked entries for the unbiased variance"):
        S.masked_var(one, mask, unbiased=True)


def test_masked_var_is_accurate_for_a_large_mean():
    # sum_sq - n mean^2 in float32 would lose every digit here; the float64 sums keep them.
    values = random_tokens(2, scale=1e-2, shift=1e3)
    assert float(S.masked_var(values.double(), make_mask())) == pytest.approx(ref_var(on_mask(values)), rel=1e-9)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_loop(shift_mean):
    values = random_tokens(3, scale=3.0, shift=-2.0).double()
    mask = make_mask()
    xs = on_mask(values)
    mean, var = ref_mean(xs), ref_var(xs)
    whitened = S.masked_whiten(values, mask, shift_mean=shift_mean)
    for b in range(len(LENGTHS)):
        for t in range(T):
            if t < LENGTHS[b]:
                expected = (float(values[b, t]) - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
                assert float(whitened[b, t]) == pytest.approx(expected, rel=1e-10, abs=1e-12)
            else:
                assert float(whitened[b, t]) == 0.0  # padding does not leak (it holds nan)


def test_whitening_invariances():
    values = random_tokens(4, scale=5.0, shift=7.0)
    mask = make_mask()
    whitened = S.masked_whiten(values, mask)
    assert float(S.masked_mean(whitened, mask)) == pytest.approx(0.0, abs=1e-6)
    assert float(S.masked_var(whitened, mask)) == pytest.approx(1.0, rel=1e-5)
    kept = S.masked_whiten(values, mask, shift_mean=False)
    assert float(S.masked_mean(kept, mask)) == pytest.approx(ref_mean(on_mask(values)), rel=1e-6)
    assert float(S.masked_var(kept, mask)) == pytest.approx(1.0, rel=1e-5)
    # The unbiased option divides by n - 1: its whitened values have unbiased variance 1.
    unbiased = S.masked_whiten(values, mask, unbiased=True)
    assert float(S.masked_var(unbiased, mask, unbiased=True)) == pytest.approx(1.0, rel=1e-5)


def test_moment_sums_of_shards_combine_to_the_global_batch():
    """What the all-reduce does across data-parallel ranks, done by hand on two halves of a batch."""
    values = random_tokens(5, scale=2.0, shift=1.0).double()
    mask = make_mask()
    first, second = (values[:2], mask[:2]), (values[2:], mask[2:])
    # Pass 1 (center 0) gives the global mean, pass 2 the spread around it: each an addition of shards.
    combined = S.masked_moment_sums(*first) + S.masked_moment_sums(*second)
    torch.testing.assert_close(combined, S.masked_moment_sums(values, mask))
    mean, _ = S.moments_from_sums(combined)
    combined = S.masked_moment_sums(*first, center=mean) + S.masked_moment_sums(*second, center=mean)
    torch.testing.assert_close(combined, S.masked_moment_sums(values, mask, center=mean))
    mean, var = S.moments_from_sums(combined, center=mean)
    assert float(mean) == pytest.approx(ref_mean(on_mask(values)), rel=1e-12)
    assert float(var) == pytest.approx(ref_var(on_mask(values)), rel=1e-12)
    # Each half whitened with the global statistics is the matching half of the whole batch whitened.
    whole = S.masked_whiten(values, mask)
    half = torch.where(first[1], (first[0] - mean) * torch.rsqrt(var + 1e-8), 0.0)
    torch.testing.assert_close(half, whole[:2])


def test_group_path_equals_the_local_one(world_group):
    values = random_tokens(6, scale=2.0, shift=3.0)
    mask = make_mask()
    torch.testing.assert_close(S.masked_mean(values, mask, group=world_group), S.masked_mean(values, mask))
    torch.testing.assert_close(S.masked_var(values, mask, group=world_group), S.masked_var(values, mask))
    for shift_mean in (True, False):
        torch.testing.assert_close(S.masked_whiten(values, mask, shift_mean=shift_mean, group=world_group),
                                   S.masked_whiten(values, mask, shift_mean=shift_mean))
    returns = random_tokens(7)
    torch.testing.assert_close(S.explained_variance(values, returns, mask, group=world_group),
                               S.explained_variance(values, returns, mask))
    with pytest.raises(ValueError, match="only supported with dim=None"):
        S.masked_mean(values, mask, dim=1, group=world_group)


# ----------------------------------------------------------------------------- scores -> rewards
def test_score_shaping_helpers():
    scores = torch.tensor([0.5, -2.0, 3.0])
    ended = torch.tensor([True, False, True])
    assert M.apply_missing_stop_penalty(scores, ended, -1.0).tolist() == [0.5, -1.0, 3.0]
    torch.testing.assert_close(M.normalize_scores(scores, 1.0, 2.0), torch.tensor([-0.25, -1.5, 1.0]))
    assert M.clip_scores(scores, 1.0).tolist() == [0.5, -1.0, 1.0]
    with pytest.raises(ValueError, match="std must be a positive"):
        M.normalize_scores(scores, 0.0, 0.0)
    with pytest.raises(ValueError, match="limit must be > 0"):
        M.clip_scores(scores, 0.0)
    with pytest.raises(ValueError, match="ended_with_stop shape"):
        M.apply_missing_stop_penalty(scores, ended[:2], -1.0)


def test_overlong_penalty_edges():
    # max_length 10, buffer 4: free up to 6 tokens, then -penalty * (L - 6) / 4, -penalty at 10 and beyond.
    lengths = torch.tensor([0, 5, 6, 7, 8, 9, 10, 11, 40])
    expected = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    got = M.overlong_penalty(lengths, max_length=10, buffer=4, penalty=1.0)
    assert got.dtype == torch.float32
    for length, value, want in zip(lengths.tolist(), got.tolist(), expected):
        assert value == pytest.approx(want, abs=1e-7), length
    scaled = M.overlong_penalty(lengths, max_length=10, buffer=4, penalty=0.5)
    torch.testing.assert_close(scaled, 0.5 * got)
    # buffer == max_length: the penalty ramps from the first token.
    whole = M.overlong_penalty(torch.tensor([0, 1, 3]), max_length=3, buffer=3, penalty=3.0)
    assert whole.tolist() == pytest.approx([0.0, -1.0, -3.0])
    for buffer, max_length in [(0, 10), (11, 10), (-1, 10)]:
        with pytest.raises(ValueError, match="0 < buffer <= max_length"):
            M.overlong_penalty(lengths, max_length=max_length, buffer=buffer, penalty=1.0)
    with pytest.raises(ValueError, match="penalty must be >= 0"):
        M.overlong_penalty(lengths, max_length=10, buffer=4, penalty=-1.0)


def test_token_rewards_match_loop():
    kl = random_tokens(8)
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0])
    kl_coef = 0.1
    rewards = M.token_rewards(scores, kl, make_mask(), kl_coef)
    for b, n in enumerate(LENGTHS):
        for t in range(T):
            expected = 0.0
            if t < n:
                expected = -kl_coef * float(kl[b, t]) + (float(scores[b]) if t == n - 1 else 0.0)
            assert float(rewards[b, t]) == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_token_rewards_rejects_empty_responses_and_wrong_shapes():
    kl = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"responses \[1\] are empty"):
        M.token_rewards(torch.zeros(2), kl, make_mask([2, 0], 3), 0.1)
    with pytest.raises(ValueError, match="scores shape"):
        M.token_rewards(torch.zeros(3), kl, make_mask([2, 1], 3), 0.1)


# An agent episode's mask: the model's turns at 1, the environment's and the template's tokens between them at 0.
HOLEY = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 1, 1], [0, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)


def holey_tokens(seed: int) -> torch.Tensor:
    """[batch, T] values on HOLEY, nan in its holes and after it (nothing there may leak into a result)."""
    values = torch.randn(HOLEY.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.where(HOLEY, values, torch.tensor(float("nan"), dtype=torch.float64))


def test_last_positions_allow_holes():
    assert S.last_positions(HOLEY).tolist() == [4, 5, 3, 2]
    assert S.last_positions(make_mask()).tolist() == [n - 1 for n in LENGTHS]
    assert S.last_positions(torch.zeros(2, 3, dtype=torch.bool)).tolist() == [-1, -1]


def test_token_rewards_put_the_score_on_the_last_model_token_of_an_episode():
    kl = holey_tokens(8)
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0])
    rewards = M.token_rewards(scores, kl, HOLEY, 0.1)
    for b in range(len(scores)):
        last = max(t for t in range(T) if HOLEY[b, t])
        for t in range(T):
            expected = (-0.1 * float(kl[b, t]) + (float(scores[b]) if t == last else 0.0)) if HOLEY[b, t] else 0.0
            assert float(rewards[b, t]) == pytest.approx(expected, rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------- KL
def test_kl_estimators_match_formulas():
    logprobs = -torch.rand(len(LENGTHS), T, generator=torch.Generator().manual_seed(9)) * 4
    ref_logprobs = -torch.rand(len(LENGTHS), T, generator=torch.Generator().manual_seed(10)) * 4
    formulas = {
        "k1": lambda lp, ref: lp - ref,
        "abs": lambda lp, ref: abs(lp - ref),
        "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
        "k3": lambda lp, ref: (math.exp(ref - lp) - 1) - (ref - lp),
    }
    assert set(formulas) == set(M.KL_ESTIMATORS)
    for name, formula in formulas.items():
        kl = M.kl_penalty(logprobs, ref_logprobs, name)
        for b in range(len(LENGTHS)):
            for t in range(T):
                expected = formula(float(logprobs[b, t]), float(ref_logprobs[b, t]))
                assert float(kl[b, t]) == pytest.approx(expected, rel=1e-5, abs=1e-6), (name, b, t)
        assert float(M.kl_penalty(logprobs, logprobs, name).abs().max()) == 0.0  # same policy: no KL
    assert float(M.kl_penalty(logprobs, ref_logprobs, "k3").min()) >= 0.0
    masked = M.kl_penalty(random_tokens(11), random_tokens(12), "k1", mask=make_mask())
    assert not masked.isnan().any() and float(masked[2, 1:].abs().sum()) == 0.0


def test_k3_is_accurate_for_tiny_log_ratios():
    kl = M.kl_penalty(torch.tensor([0.0]), torch.tensor([1e-4]), "k3")
    assert float(kl) == pytest.approx(0.5e-8, rel=1e-3)  # (r - 1) - log r ~ x^2 / 2


def test_unknown_kl_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; choose one of k1, abs, k2, k3"):
        M.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


def test_adaptive_kl_controller_hand_computed():
    controller = M.AdaptiveKLController(init_kl_coef=0.15, target=6.0, horizon=10000)
    # error = 6.6 / 6 - 1 = 0.1; mult = 1 + 0.1 * 512 / 10000 = 1.00512
    assert controller.update(6.6, n_steps=512) == pytest.approx(0.15 * 1.00512, rel=1e-12)
    # error = 30 / 6 - 1 = 4, clipped to 0.2; mult = 1 + 0.2 * 1000 / 10000 = 1.02
    assert controller.update(torch.tensor(30.0), n_steps=1000) == pytest.approx(0.15 * 1.00512 * 1.02, rel=1e-12)
    # error = 0 / 6 - 1 = -1, clipped to -0.2; mult = 1 - 0.2 * 2500 / 10000 = 0.95
    assert controller.update(0.0, n_steps=2500) == pytest.approx(0.15 * 1.00512 * 1.02 * 0.95, rel=1e-12)
    # on target: unchanged
    value = controller.value
    assert controller.update(6.0, n_steps=512) == pytest.approx(value, rel=1e-12)
    with pytest.raises(ValueError, match="target > 0"):
        M.AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_kl_controller_state_dict_round_trip():
    controller = M.AdaptiveKLController(0.2, target=4.0, horizon=100)
    controller.update(5.0, n_steps=10)
    resumed = M.AdaptiveKLController(0.2, target=4.0, horizon=100)
    resumed.load_state_dict(controller.state_dict())
    assert resumed.value == controller.value
    assert resumed.update(3.0, n_steps=7) == controller.update(3.0, n_steps=7)

    fixed = M.FixedKLController(0.05)
    assert fixed.update(100.0, n_steps=1000) == 0.05
    fixed.load_state_dict({"value": 1.0})  # the config's coefficient wins on resume
    assert fixed.state_dict() == {"value": 0.05}


# ----------------------------------------------------------------------------- GAE
def reference_gae(rewards, values, lengths, gamma, lam):
    """Textbook GAE per row in float64: V after the last response token is 0."""
    advantages = [[0.0] * T for _ in lengths]
    returns = [[0.0] * T for _ in lengths]
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            next_value = float(values[b, t + 1]) if t + 1 < n else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            advantages[b][t] = running
            returns[b][t] = running + float(values[b, t])
    return torch.tensor(advantages, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_double_loop(gamma, lam):
    rewards, values = random_tokens(13).double(), random_tokens(14).double()
    advantages, returns = M.gae_advantages(rewards, values, make_mask(), gamma, lam)
    expected_advantages, expected_returns = reference_gae(rewards, values, LENGTHS, gamma, lam)
    torch.testing.assert_close(advantages, expected_advantages, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(returns, expected_returns, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_over_an_episode_is_gae_over_its_model_tokens_alone(gamma, lam):
    """Holes (environment and template tokens) are not steps: the same as compacting the model tokens."""
    rewards, values = holey_tokens(13), holey_tokens(14)
    advantages, returns = M.gae_advantages(rewards, values, HOLEY, gamma, lam)
    for b in range(HOLEY.shape[0]):
        columns = HOLEY[b].nonzero().flatten()
        n = len(columns)
        compact_rewards, compact_values = torch.zeros(1, T, dtype=torch.float64), torch.zeros(1, T, dtype=torch.float64)
        compact_rewards[0, :n], compact_values[0, :n] = rewards[b, columns], values[b, columns]
        expected_advantages, expected_returns = reference_gae(compact_rewards, compact_values, [n], gamma, lam)
        torch.testing.assert_close(advantages[b, columns], expected_advantages[0, :n], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(returns[b, columns], expected_returns[0, :n], rtol=1e-12, atol=1e-12)
        assert float(advantages[b, ~HOLEY[b]].abs().sum()) == 0.0 and float(returns[b, ~HOLEY[b]].abs().sum()) == 0.0


def test_gae_special_cases():
    rewards, values = random_tokens(15), random_tokens(16)
    mask = make_mask()
    # gamma = lam = 1: advantage = rewards still to come - V(t); returns = rewards still to come.
    advantages, returns = M.gae_advantages(rewards, values, mask, 1.0, 1.0)
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            to_come = sum(float(rewards[b, k]) for k in range(t, n))
            assert float(returns[b, t]) == pytest.approx(to_come, rel=1e-5, abs=1e-5)
            assert float(advantages[b, t]) == pytest.approx(to_come - float(values[b, t]), rel=1e-5, abs=1e-5)
    # bf16 inputs are computed in float32; gradients never flow into targets.
    values_with_grad = torch.where(mask, values, 0.0).requires_grad_()
    advantages, returns = M.gae_advantages(rewards.bfloat16(), values_with_grad, mask, 1.0, 0.95)
    assert advantages.dtype == torch.float32 and not returns.requires_grad
    with pytest.raises(ValueError, match="gamma and lam must lie in"):
        M.gae_advantages(rewards, values, mask, 1.5, 0.95)


# ----------------------------------------------------------------------------- value loss
@pytest.mark.parametrize("clip_value", [0.2, None])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean"])
def test_value_loss_matches_loop(clip_value, aggregation):
    values = random_tokens(25).requires_grad_()
    old_values, returns = random_tokens(26), random_tokens(27)
    loss, stats = M.value_loss(values, old_values, returns, make_mask(), clip_value, aggregation)
    per_row, clipped = [], []
    for b, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            v, old, target = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            error = (v - target) ** 2
            if clip_value is None:
                clipped_error = error
            else:
                clipped_error = (old + min(max(v - old, -clip_value), clip_value) - target) ** 2
            row.append(0.5 * max(error, clipped_error))
            clipped.append(clipped_error > error)
        per_row.append(row)
    expected = (ref_mean([x for row in per_row for x in row]) if aggregation == "token_mean"
                else ref_mean([ref_mean(row) for row in per_row]))
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(stats["clip_fraction"]) == pytest.approx(sum(clipped) / len(clipped), rel=1e-6)
    if clip_value is not None:
        assert 0 < sum(clipped) < len(clipped)
    loss.backward()
    assert not values.grad.isnan().any() and float(values.grad[~make_mask()].abs().max()) == 0.0
    with pytest.raises(ValueError, match="clip_value must be > 0"):
        M.value_loss(values, old_values, returns, make_mask(), 0.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean_token_mean"])
def test_value_loss_sum_is_the_policy_losses_aggregation_of_the_clipped_error(aggregation):
    """The critic trains on (sum, count): aggregate_loss of the per-token clipped error, whose ratio is
    value_loss; summed over two halves of the batch (micro batches) it gives the whole batch's."""
    values, old_values, returns, mask = random_tokens(25), random_tokens(26), random_tokens(27), make_mask()
    loss_sum, count, clipped = M.value_loss_sum(values, old_values, returns, mask, 0.2, aggregation)
    zeroed = [S.zero_off_mask(x, mask) for x in (values, old_values, returns)]
    per_token, clipped_tokens = M.clipped_value_error(*zeroed, 0.2)
    expected_sum, expected_count = aggregate_loss(per_token, mask, aggregation)
    torch.testing.assert_close(loss_sum, expected_sum)
    assert int(count) == int(expected_count)
    loss, stats = M.value_loss(values, old_values, returns, mask, 0.2, aggregation)
    torch.testing.assert_close(loss_sum / count, loss)
    assert int(clipped) == int((clipped_tokens & mask.bool()).sum()) and 0 < int(clipped) < int(mask.sum())
    torch.testing.assert_close(clipped / mask.sum(), stats["clip_fraction"])
    halves = [M.value_loss_sum(values[rows], old_values[rows], returns[rows], mask[rows], 0.2, aggregation)
              for rows in (slice(0, 2), slice(2, None))]
    torch.testing.assert_close(sum(h[0] for h in halves), loss_sum)
    assert sum(int(h[1]) for h in halves) == int(count) and sum(int(h[2]) for h in halves) == int(clipped)


def test_explained_variance():
    returns = random_tokens(28, scale=2.0)
    values = random_tokens(29)
    mask = make_mask()
    xs, ys = on_mask(values), on_mask(returns)
    expected = 1 - ref_var([y - x for x, y in zip(xs, ys)]) / ref_var(ys)
    assert float(S.explained_variance(values, returns, mask)) == pytest.approx(expected, rel=1e-5)
    assert float(S.explained_variance(returns, returns, mask)) == pytest.approx(1.0)
    constant = torch.full_like(returns, ref_mean(ys))
    assert float(S.explained_variance(constant, returns, mask)) == pytest.approx(0.0, abs=1e-6)
    assert math.isnan(float(S.explained_variance(values, torch.ones_like(returns), mask)))
