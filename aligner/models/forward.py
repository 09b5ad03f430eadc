"""Forward passes through megatron-core's pipeline schedule (any TP/PP layout)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from aligner.models.deferred_output import HiddenStates, forward_deferred
from aligner.models.packing import PackedRows
from aligner.runtime.distributed import device


def run_microbatches(
    model_chunks: Sequence[torch.nn.Module],
    microbatches: list,
    forward_fn: Callable[[torch.nn.Module, object], torch.Tensor],
    loss_fn: Callable[[object, torch.Tensor], tuple],
    *,
    forward_only: bool,
    seq_length: int,
    micro_batch_size: int,
    defer_output_layer: bool = False,
) -> list[dict]:
    """Run megatron's forward(-backward) schedule over `microbatches`.

    forward_fn(model, batch) -> output tensor of the chunk; loss_fn(batch, output) -> the
    (loss_sum, num_tokens, reported) triple megatron expects with per-token loss. Returns the
    reported dicts (only on the last pipeline stage; an empty list elsewhere).
    defer_output_layer: the last stage's loss_fn gets `deferred_output.HiddenStates` instead of the logits.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    target = device()
    batches: Iterator = iter(microbatches)

    def checked_loss(batch, output) -> tuple:
        result = loss_fn(batch, output)
        # Megatron's schedule skips the backward of a loss outside the autograd graph without a word: the step
        # would then train nothing and report a zero gradient norm.
        if not forward_only and not result[0].requires_grad:
            raise RuntimeError("the training loss does not depend on any trainable parameter, so the backward "
                               "pass would change nothing (every parameter frozen, or the graph cut on the way)")
        return result

    def forward_step(data_iterator, model):
        # Batches are built on the CPU; the model may live on a GPU (a no-op on CPU).
        batch = batch_to_device(next(data_iterator), target)
        output = forward_deferred(model, forward_fn, batch) if defer_output_layer else forward_fn(model, batch)
        if isinstance(output, HiddenStates):  # the schedule passes tensors: the loss gets them back wrapped
            return output.tensor, lambda out: checked_loss(batch, HiddenStates(out, output.layer, output.weight))
        return output, lambda out: checked_loss(batch, out)

    # With a virtual pipeline every chunk consumes the same micro batches through its own iterator.
    data_iterator = batches if len(model_chunks) == 1 else [iter(microbatches) for _ in model_chunks]

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterator,
        model=list(model_chunks),
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def batch_to_device(batch, target):
    """A micro batch (a dict, or a dataclass record) with its tensors on `target`; a dict's packed
    rows (`PackedRows`) too."""
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **{spec.name: getattr(batch, spec.name).to(target, non_blocking=True)
                                             for spec in dataclasses.fields(batch)
                                             if isinstance(getattr(batch, spec.name), torch.Tensor)})
    return {key: value.to(target, non_blocking=True) if isinstance(value, (torch.Tensor, PackedRows)) else value
            for key, value in batch.items()}


def gather_vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gather tensor-parallel vocab shards into [..., vocab_size] logits (padding dropped)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    # contiguous: a slice of the padded vocab is a strided view, and collectives send raw storage.
    return gather_from_tensor_model_parallel_region(logits)[..., :vocab_size].contiguous()


@torch.no_grad()
def forward_logits(
    model_chunks: Sequence[torch.nn.Module],
    tokens: torch.Tensor,
    vocab_size: int,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Full-vocabulary logits [batch, seq, vocab] for `tokens`, on every rank (any TP/PP).

    One micro batch through the pipeline; the last stage's result is broadcast to all stages.
    Meant for evaluation and tests, not for the training hot path.
    """
    from megatron.core import parallel_state as ps

    batch_size, seq_length = tokens.shape
    if position_ids is None:
        position_ids = torch.arange(seq_length).unsqueeze(0).expand(batch_size, -1)
    for chunk in model_chunks:
        chunk.eval()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        # One stage: call the model directly (no schedule, so no CPU-bridge scope on the hot path).
        target = device()
        logits = model_chunks[0](tokens.to(target), position_ids.to(target), None)
        return gather_vocab_logits(logits, vocab_size).float().cpu()
    # The interleaved (virtual pipeline) schedule needs at least PP micro batches: split the rows,
    # repeating the last one to even them out, and drop the repeats afterwards.
    num_microbatches = ps.get_pipeline_model_parallel_world_size() if len(model_chunks) > 1 else 1
    rows_per_microbatch = -(-batch_size // num_microbatches)
    padding_rows = rows_per_microbatch * num_microbatches - batch_size
    if padding_rows:
        tokens = torch.cat([tokens, tokens[-1:].expand(padding_rows, -1)])
        position_ids = torch.cat([position_ids, position_ids[-1:].expand(padding_rows, -1)])
    microbatches = [
        {"tokens": tokens[i:i + rows_per_microbatch], "position_ids": position_ids[i:i + rows_per_microbatch]}
        for i in range(0, len(tokens), rows_per_microbatch)
    ]
    captured: list[torch.Tensor] = []

    def forward_fn(model, batch):
        return model(batch["tokens"], batch["position_ids"], None)

    def loss_fn(batch, output):
        captured.append(gather_vocab_logits(output, vocab_size).float())
        return output.new_zeros(()), torch.tensor(1, dtype=torch.int), {}

    run_microbatches(model_chunks, microbatches, forward_fn, loss_fn, forward_only=True,
                     seq_length=seq_length, micro_batch_size=rows_per_microbatch)
    if captured:
        result = torch.cat(captured)[:batch_size]
    else:
        result = torch.empty(batch_size, seq_length, vocab_size, device=device())
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(result, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    return result.cpu()
