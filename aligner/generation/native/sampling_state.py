"""Sampling for one generate call or stream of the native engine: random streams, stop rules, rollout tensors."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from aligner.generation import sampling as S
from aligner.generation.engine import Rollout, SamplingParams
from aligner.generation.native.state import EngineState


class SamplingState:
    """Sampling for one generate call or stream: the samples' random streams, stop rules and rollout tensors.

    Everything is per sample (a prompt of a request, numbered in arrival order): a batch row says
    which sample it holds and which step of that sample's response it is at, so any assignment of
    samples to rows and steps gives the same draws.
    """

    def __init__(self, state: EngineState, sampling: SamplingParams, *, pad_id: int, eos_id: int,
                 decode: Optional[Callable[[list], str]]):
        device = state.device
        self.state, self.sampling = state, sampling
        self.pad_id, self.decode = pad_id, decode
        self.greedy = sampling.is_greedy
        self.temperature = 1.0 if self.greedy else sampling.temperature
        # A draw from the whole unfiltered distribution on one shard: its logprob comes with it.
        self.plain_draw = (not self.greedy and sampling.top_k == 0 and sampling.top_p >= 1.0
                           and state.tp_group_or_none is None)
        self.stop_ids = torch.tensor(sampling.stop_token_ids or [eos_id], dtype=torch.long, device=device)
        new_tokens = sampling.max_new_tokens
        # [samples, new_tokens]: sample i of a request draws from the stream of (its seed, i)
        self.uniforms = torch.zeros(0, new_tokens, dtype=torch.float32, device=device)
        self.responses = torch.zeros(0, new_tokens, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(0, new_tokens, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(0, dtype=torch.long, device=device)
        self.ended = torch.zeros(0, dtype=torch.bool, device=device)
        self._stop_columns = None  # [vocab_shard] bool: this shard's stop tokens (min_new_tokens), built once

    def add(self, prompts: list, seed: int, first_stream: int = 0) -> int:
        """Room for a request's samples, row r drawing from (seed, first_stream + r); returns the number of its
        first sample."""
        first, count, device = self.lengths.shape[0], len(prompts), self.lengths.device
        new_tokens = self.sampling.max_new_tokens
        if not self.greedy:
            keys = S.sample_keys(seed, torch.arange(first_stream, first_stream + count, device=device))
            self.uniforms = torch.cat([self.uniforms, S.uniforms(keys, torch.arange(new_tokens, device=device))])
        self.responses = torch.cat([self.responses, torch.full((count, new_tokens), self.pad_id,
                                                               dtype=torch.long, device=device)])
        self.logprobs = torch.cat([self.logprobs, self.logprobs.new_zeros(count, new_tokens)])
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(count)])
        self.ended = torch.cat([self.ended, self.ended.new_zeros(count)])
        return first

    def restart(self, sample: int, seed: int, stream: int = 0) -> None:
        """Sample `sample` starts over, drawing from (seed, stream) (`generate_turns` gives the sample of a
        finished turn to the next one, so its state stays as many samples as cache rows)."""
        if not self.greedy:
            device = self.uniforms.device
            keys = S.sample_keys(seed, torch.full((1,), stream, dtype=torch.long, device=device))
            self.uniforms[sample] = S.uniforms(keys, torch.arange(self.sampling.max_new_tokens, device=device))[0]
        self.responses[sample] = self.pad_id
        self.logprobs[sample] = 0.0
        self.lengths[sample] = 0
        self.ended[sample] = False

    def sample(self, logits, samples, steps, first_step: int):
        """(tokens, logprobs) [batch] from the last stage's logits [batch, vocab_shard]; row b holds sample
        samples[b] at step steps[b] of its response; first_step = min(steps)."""
        state, sampling = self.state, self.sampling
        logits = logits.float()
        if state.has_vocab_padding:
            logits = logits.masked_fill(state.vocab_padding, float("-inf"))
        scaled = S.apply_temperature(logits, self.temperature)
        uniform = None if self.greedy else self.uniforms[samples, steps]
        if self.plain_draw and first_step >= sampling.min_new_tokens:  # one pass for the draw and its logprob
            return S.sample_with_logprobs(scaled, uniform)
        candidates = scaled
        if first_step < sampling.min_new_tokens:  # stop tokens masked on the rows still short of it
            if self._stop_columns is None:
                local = self.stop_ids - state.vocab_start
                local = local[(local >= 0) & (local < scaled.shape[-1])]
                self._stop_columns = torch.zeros(scaled.shape[-1], dtype=torch.bool, device=scaled.device)
                self._stop_columns[local] = True
            early = (steps < sampling.min_new_tokens).unsqueeze(1)
            candidates = scaled.masked_fill(early & self._stop_columns, float("-inf"))
        token = S.select_tokens(
            candidates, greedy=self.greedy, top_k=sampling.top_k, top_p=sampling.top_p, uniform=uniform,
            vocab_start=state.vocab_start, group=state.tp_group_or_none,
        )
        # The logprob of the unfiltered distribution: what the training forward recomputes.
        logprob = S.vocab_parallel_token_logprobs(scaled, token, state.vocab_start, state.tp_group_or_none)
        return token, logprob

    def record(self, samples, steps, token, logprob) -> torch.Tensor:
        """Store the rows' tokens; returns [batch] bool: the rows whose response is complete."""
        sampling = self.sampling
        is_stop = torch.isin(token, self.stop_ids)
        self.responses[samples, steps] = token
        self.logprobs[samples, steps] = logprob
        self.lengths[samples] = steps + 1
        last = steps + 1 >= sampling.max_new_tokens
        if sampling.fixed_length:
            self.ended[samples] |= is_stop
            return last
        if sampling.stop_strings:
            is_stop = is_stop | self._stop_string_hits(samples)
        self.ended[samples] = is_stop
        return is_stop | last

    def _stop_string_hits(self, samples) -> torch.Tensor:
        """Rows whose decoded response now contains a stop string (every rank decodes alike)."""
        responses, lengths = self.responses[samples].cpu(), self.lengths[samples].tolist()
        hits = [any(stop in self.decode(responses[row, :length].tolist()) for stop in self.sampling.stop_strings)
                for row, length in enumerate(lengths)]
        return torch.tensor(hits, dtype=torch.bool, device=samples.device)

    def rollout(self, first: int, count: int, prompts: list) -> Rollout:
        """The Rollout of samples first .. first + count - 1 (one request's prompts)."""
        rows = slice(first, first + count)
        return Rollout(prompt_tokens=[list(p) for p in prompts], response_tokens=self.responses[rows].cpu(),
                       logprobs=self.logprobs[rows].cpu(), response_lengths=self.lengths[rows].cpu(),
                       ended_with_stop=self.ended[rows].cpu())
