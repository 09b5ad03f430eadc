"""The native generation engine: KV-cached decoding on the actor's own megatron-core weights.

Hybrid-engine idea: the engine holds references to the training parameters of the megatron
`GPTModel` chunks, so generation always sees the latest weights; the one copy is the products'
oneDNN-packed weights on CPU (`pack_weights`), remade for the weights that changed. The forward
is a lean re-implementation of megatron's local-spec layer math (the tests check it against
megatron's own forward) in one tight loop over preallocated state:

- KV cache per layer, keys [batch, groups, head_dim, len] (stored transposed: q @ K^T then
  reads contiguous blocks) and values [batch, groups, len, head_dim], sized by what a generate
  call needs (its rows, at most max_batch_size, x its longest prompt + max_new_tokens), kept and
  reused by later calls that fit, and replaced (the old one dropped first) by one that does not:
  max_sequence_length is a limit, not an allocation (free() drops the cache);
- continuous batching (`_generate_continuous`): each cache row holds one sequence from column 0
  (its first token at position 0, the training-side layout of `aligner.models.logprobs`) at
  its own length; a decode step writes each row's new keys and values at the row's own column and
  masks the columns beyond it, so a row's numbers do not depend on the other rows. A row that
  stops leaves the decode batch at once and a waiting prompt takes its cache row (prefilled into
  it, right-padded with the other prompts admitted at that step); `generate_stream` keeps doing so
  across requests (rollout micro-batches), pulling the next one as rows free up. Sampling is keyed
  by (sample, step of its own response), so the schedule never changes a row's draws;
- multi-turn episodes (`generate_turns`): an episode keeps its cache row from its first prefill to its end.
  When its turn ends, the row leaves the decode batch with its cache (swapped behind the live rows) while
  the environment answers; the answer is prefilled into the same row from the row's own column (the
  reply's last token, sampled but not yet in the cache, then the appended tokens: `Forward.prefill_forward`
  with continued=True), and the row joins the decode batch of the other episodes at whatever turn they
  are. A turn draws from the stream of its (episode, turn) seed (`engine.turn_sampling`), so the tokens
  are those of generating the whole history again (the protocol's default);
- continuous_batching=False keeps the static-batch loop as a reference (tests, benchmarks):
  chunks of max_batch_size prompts left-padded to the longest, every row at one shared column
  until the chunk's longest row ends;
- prefills compute logits only for each prompt's last token, and run a prompt admitted several times
  at once (a group's samples) only once, copying its cache rows; decode steps are single-token and
  run feature-major ([features, batch] activations, see `Forward.decode_forward`) because small-batch
  BLAS products are much faster that way round; on CPU the products are oneDNN's (`cpu_products`),
  on packed copies of the weights by default, except a single sequence's decode products where BLAS
  is the preferred library (`cpu_products.preferred_library`).

The decode step is bound by per-op overhead, not arithmetic or memory, at small sizes, so it is
written to issue few, cheap torch calls: all heads of a layer in one baddbmm and one bmm (a
padding mask, when there is padding, as one in-place add); norms with one addmm for the feature
statistics; rotary embedding as mul + roll + addcmul; cache columns written with a plain column
copy when every row writes the same column (else one scatter per cache); the attention output read
transposed by the projection (no copy); the rows' masks and rotary columns built once per step for
all layers; a sampling path that draws and takes the logprob in one pass.

Speed against HF `generate` and the arithmetic floor: docs/results/benchmarks.md; how it is measured:
benchmarks/README.md (generation.py).

Static decode step (`static_decode=True`) and CUDA graphs (`cuda_graphs=True`, GPU only): the
step can instead attend over the whole cache with a mask (each row's future and padding
columns get the dtype's minimum) and read tokens, positions, the rows' cache columns and the padding
bias from fixed buffers. That step has no Python-side values and no shape changes, so a CUDA
graph can record it once per batch size and cache allocation and replay it (continuous batching
shrinks the decode batch as rows end: one graph per batch size it reaches) (`aligner.generation.cuda_graphs`, the
engine's only GPU-specific code). On CPU cuda_graphs=True is refused with a ValueError (no
silent fallback); static_decode=True runs the same static step eagerly, and the tests check it
gives the default step's tokens and logprobs (also at TP=2 and PP=2).

Sampling (temperature, top-k, top-p, greedy, min/max new tokens, stop ids and strings,
fixed length, per-sample seeds) is in `sampling`; the reported logprobs are those of
log_softmax(logits / temperature) over the real vocabulary (temperature 1 when greedy), before
top-k/top-p/min-new-tokens filtering: the quantity the training forward recomputes.

Parallelism: tensor parallel through megatron's TP group (all-reduce after the row-parallel
projections, vocab-parallel embedding, sampling on vocab shards, see `sampling`); pipeline
parallel (also virtual stages) by passing hidden states stage to stage with point-to-point
sends; the last stage samples and broadcasts tokens and logprobs to the other stages, so every
rank returns the same Rollout.

Model families: the rotary tables come from megatron's own RotaryEmbedding of the chunk (Llama 3.x
scaling included, one fact); queries and keys get the per-head norm of megatron's qk_layernorm
(Qwen3) before RoPE; Gemma 3's zero-centred norms (x * (1 + w)), norms after attention and after the
MLP, scaled embeddings, softmax scale and its sliding-window layers' own RoPE base (the tables hold
both bases' angles side by side, each layer reads its half), with requests longer than the sliding
window refused, as training refuses such rows; an MoE layer's MLP is megatron's own MoELayer module
(router, token dispatcher, experts), called token-major ([tokens, 1, hidden]) from both the prefill
and the feature-major decode step. Generation with expert_model_parallel_size > 1 is refused (each
data-parallel rank decodes its own prompts for its own number of steps, the MoE layer would need them
in lockstep), and so is cuda_graphs=True for MoE models (tokens per expert change every step).

Modules: `engine` (NativeEngine: binding, KV cache, the generation loops), `forward` (prefill and
decode steps, the static step CUDA graphs capture), `weights` (the records of the bound parameters, packed
copies, rotary tables), `sampling_state` (one call's or stream's draws, stop rules and rollout tensors),
`state` (EngineState, the record they share), `turns` (the cache rows of multi-turn episodes).

Not supported: the transformer-engine layer spec (its fused norm+linear weights have other
names); CUDA graphs across pipeline stages (cuda_graphs needs PP=1).
"""
from __future__ import annotations

from aligner.generation.native.engine import NativeEngine

__all__ = ["NativeEngine"]
