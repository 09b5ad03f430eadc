"""Sampling functions against straightforward float64 references (single shard; the vocab-parallel
versions are checked against these in tests/distributed/test_native_engine_parallel.py)."""
from __future__ import annotations

import math

import pytest
import torch

from aligner.generation import sampling as S


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return 2.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_apply_temperature_divides_and_leaves_greedy_alone():
    logits = _logits()
    assert torch.equal(S.apply_temperature(logits, 0.5), logits / 0.5)
    assert torch.equal(S.apply_temperature(logits, 1.0), logits)
    assert torch.equal(S.apply_temperature(logits, 0.0), logits)
    assert S.apply_temperature(logits.double(), 2.0).dtype == torch.float32


def test_top_p_filter_keeps_the_smallest_nucleus():
    logits = _logits(rows=20, vocab=30, seed=1)
    for p in (0.05, 0.3, 0.9, 0.999):
        filtered = S.top_p_filter(logits, p)
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row].double(), dim=0).tolist()
            order = sorted(range(len(probs)), key=lambda i: -probs[i])
            kept, mass = set(), 0.0
            for index in order:  # reference: add tokens by probability until the mass reaches p
                kept.add(index)
                mass += probs[index]
                if mass >= p:
                    break
            assert set(torch.isfinite(filtered[row]).nonzero().flatten().tolist()) == kept, (p, row)
            assert torch.equal(filtered[row][list(kept)], logits[row][list(kept)])
    assert torch.equal(S.top_p_filter(logits, 1.0), logits)


def test_token_logprobs_match_float64_log_softmax():
    logits, tokens = _logits(), torch.tensor([0, 5, 49, 3, 3, 17])
    expected = [row[t] - math.log(sum(math.exp(v) for v in row))
                for row, t in zip(logits.double().tolist(), tokens.tolist())]
    assert torch.allclose(S.token_logprobs(logits, tokens).double(), torch.tensor(expected, dtype=torch.float64),
                          atol=1e-6)
    # Masked (-inf) entries take no probability mass.
    masked = logits.clone()
    masked[:, 40:] = float("-inf")
    assert torch.allclose(S.token_logprobs(masked, tokens.clamp(max=39)),
                          torch.log_softmax(logits[:, :40].double(), -1).gather(1, tokens.clamp(max=39)[:, None])
                          .squeeze(1).float(), atol=1e-6)


def test_uniforms_are_deterministic_per_sample_and_step_and_spread_evenly():
    keys = S.sample_keys(7, torch.arange(100))
    draws = S.uniforms(keys, torch.arange(200))  # [100, 200]
    assert draws.dtype == torch.float32 and (draws > 0).all() and (draws < 1).all()
    # A sample's stream depends on its index only: the same alone, in another batch, or shifted.
    alone = S.uniforms(S.sample_keys(7, torch.tensor([42])), torch.arange(200))
    assert torch.equal(alone[0], draws[42])
    assert torch.equal(S.uniforms(keys, torch.arange(50, 60)), draws[:, 50:60])
    assert not torch.equal(S.uniforms(S.sample_keys(8, torch.arange(100)), torch.arange(200)), draws)
    # Even spread: 20 bins of 20000 draws, chi-square far below the 0.1 % critical value (43.8, 19 dof).
    counts = torch.histc(draws.flatten(), bins=20, min=0.0, max=1.0)
    expected = draws.numel() / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 43.8
    # No correlation between neighbouring samples or steps.
    centered = draws - 0.5
    assert abs(float((centered[:-1] * centered[1:]).mean())) < 0.005
    assert abs(float((centered[:, :-1] * centered[:, 1:]).mean())) < 0.005
    with pytest.raises(ValueError, match="seed"):
        S.sample_keys(-1, torch.arange(3))


def test_inverse_cdf_sample_matches_a_float64_reference():
    logits = _logits(rows=64, vocab=40, seed=2)
    logits[:, 30:35] = float("-inf")  # zero-probability tokens
    uniform = S.uniforms(S.sample_keys(0, torch.arange(64)), torch.tensor([0]))[:, 0]
    tokens = S.vocab_parallel_sample(logits, uniform)
    for row in range(64):
        probs = torch.softmax(logits[row].double(), dim=0).tolist()
        cumulative, expected = 0.0, None
        for index, p in enumerate(probs):
            cumulative += p
            if cumulative > float(uniform[row]):
                expected = index
                break
        assert int(tokens[row]) == expected, row
    assert not ((tokens >= 30) & (tokens < 35)).any()


def test_sampling_never_picks_zero_probability_tokens_at_the_edges():
    logits = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]] * 3)
    edges = torch.tensor([0.5 / 2**24, 0.5, 1 - 0.5 / 2**24])
    assert S.vocab_parallel_sample(logits, edges).tolist() == [1, 2, 2]
    assert S.vocab_parallel_sample(logits, edges, vocab_start=100).tolist() == [101, 102, 102]


def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_select_tokens_draws_from_the_filtered_softmax():
    torch.manual_seed(0)
    vocab, draws = 8, 40000
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = row.expand(draws, -1)
    uniform = S.uniforms(S.sample_keys(3, torch.arange(draws)), torch.tensor([0]))[:, 0]
    probs = torch.softmax(row.double(), 0)

    plain = S.select_tokens(logits, greedy=False, uniform=uniform)
    assert (_frequencies(plain, vocab) - probs).abs().max() < 0.01

    top_k = S.select_tokens(logits, greedy=False, top_k=3, uniform=uniform)
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[:3] = torch.softmax(row[:3].double(), 0)
    assert set(top_k.tolist()) == {0, 1, 2}
    assert (_frequencies(top_k, vocab) - expected).abs().max() < 0.01

    # Nucleus at 0.6: tokens 0 (0.38) and 1 (0.23) reach it.
    top_p = S.select_tokens(logits, greedy=False, top_p=0.6, uniform=uniform)
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[:2] = probs[:2] / probs[:2].sum()
    assert (_frequencies(top_p, vocab) - expected).abs().max() < 0.01

    # Top-k then top-p, both on the same candidates.
    both = S.select_tokens(logits, greedy=False, top_k=4, top_p=0.75, uniform=uniform)
    renormalized = torch.softmax(row[:4].double(), 0)  # 0.45, 0.27, 0.17, 0.10: nucleus {0, 1, 2}
    expected = torch.zeros(vocab, dtype=torch.float64)
    expected[:3] = renormalized[:3] / renormalized[:3].sum()
    assert (_frequencies(both, vocab) - expected).abs().max() < 0.01

    greedy = S.select_tokens(_logits(), greedy=True)
    assert torch.equal(greedy, _logits().argmax(-1))


def test_top_k_candidates_are_the_largest_logits_with_their_ids():
    logits = _logits(rows=4, vocab=30, seed=5)
    values, ids = S.vocab_parallel_top_k(logits, 5, vocab_start=10)
    reference = torch.topk(logits, 5, dim=-1)
    assert torch.equal(values, reference.values) and torch.equal(ids, reference.indices + 10)
    values, ids = S.vocab_parallel_top_k(logits, 100)  # k beyond the vocabulary: everything, sorted
    assert values.shape == (4, 30) and torch.equal(values, logits.sort(-1, descending=True).values)


def test_single_shard_helpers_equal_their_plain_versions():
    logits = _logits()
    assert torch.equal(S.vocab_parallel_argmax(logits), logits.argmax(-1))
    assert torch.equal(S.vocab_parallel_argmax(logits, vocab_start=7), logits.argmax(-1) + 7)
    assert torch.allclose(S.vocab_parallel_logsumexp(logits), torch.logsumexp(logits, -1))
    tokens = torch.tensor([1, 2, 3, 4, 5, 6])
    assert torch.equal(S.vocab_parallel_token_logprobs(logits, tokens), S.token_logprobs(logits, tokens))
    assert torch.equal(S.gather_vocab(logits), logits)
