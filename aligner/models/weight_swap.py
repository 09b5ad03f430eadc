"""Two models on one set of devices: a second set of weights kept on (pinned) host memory and
swapped into the live model chunks for a pass, then swapped out again.

PPO's actor holds its reference policy this way (NeMo-Aligner's CPU-offloaded reference), DPO can
compute reference logprobs the same way, and the critic server's combined mode swaps reward-model
weights into the critic. The Parameter objects stay, so everything that holds them (DDP, the optimizer,
the modules, the generation engine) stays valid, and swapping back restores the training weights bit
for bit. Where the stored copy lives on the parameter's own device (a CPU run: host memory is the
model's memory) the two tensors are exchanged (`param.data`), which copies nothing; a GPU model
exchanges values with its host copy, one parameter's worth of device memory at a time.

    reference = HostWeights.snapshot(chunks)        # e.g. right after loading the initial policy
    with reference.swapped_in(chunks):
        reference_logprobs = ...                    # the model computes with the reference weights
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Sequence

import torch

from aligner.runtime.cpu_bridge import mark_written
from aligner.runtime.distributed import host_copy


def named_parameters(chunks: Sequence[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """Every parameter of the chunks in a fixed order, named `chunk<i>.<name>` (wrappers unwrapped)."""
    from megatron.core.utils import unwrap_model

    named = []
    for index, chunk in enumerate(unwrap_model(list(chunks))):
        named.extend((f"chunk{index}.{name}", param) for name, param in chunk.named_parameters())
    return named


class HostWeights:
    """A host-memory copy of model chunks' parameters that can be exchanged with the live ones."""

    def __init__(self, tensors: dict[str, torch.Tensor], select: Optional[Callable[[str], bool]] = None):
        self.tensors = tensors  # name -> host tensor, same shapes/dtypes as the live parameters
        self.select = select  # which parameters (by name) the copy holds; None: every one

    @classmethod
    def snapshot(cls, chunks: Sequence[torch.nn.Module],
                 select: Optional[Callable[[str], bool]] = None) -> "HostWeights":
        """Copy the chunks' current parameters (those `select` names, e.g. LoRA adapters only) to host memory."""
        return cls({name: host_copy(param) for name, param in cls._named(chunks, select)}, select)

    @staticmethod
    def _named(chunks, select) -> list[tuple[str, torch.Tensor]]:
        return [(name, param) for name, param in named_parameters(chunks) if select is None or select(name)]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def exchange(self, chunks: Sequence[torch.nn.Module]) -> None:
        """Swap values: the chunks get the stored weights, the store gets the chunks' weights."""
        named = self._named(chunks, self.select)
        if [name for name, _ in named] != list(self.tensors):
            missing = sorted(set(self.tensors) - {name for name, _ in named})[:5]
            extra = sorted({name for name, _ in named} - set(self.tensors))[:5]
            raise ValueError("these weights belong to a different model layout "
                             f"(missing {missing}, unexpected {extra})")
        for name, param in named:
            if self.tensors[name].shape != param.shape:
                raise ValueError(f"{name}: stored shape {tuple(self.tensors[name].shape)} != model shape "
                                 f"{tuple(param.shape)}")
        for name, param in named:
            stored = self.tensors[name]
            if stored.device == param.device and stored.dtype == param.dtype:
                # One memory: exchange the tensors, not their values (the DPO reference swap of SmolLM2
                # copied 538 MB each way, twice a step). `.data =` keeps the parameter's autograd state
                # (DDP's gradient hooks; `set_` would lose them) and its version counter, which an
                # in-place write to an empty slice then moves on, as a copy would: caches keyed by it
                # (the engine's packed weights) see the change.
                live = param.data
                param.data = stored
                mark_written(param)
                self.tensors[name] = live
            else:
                live = param.clone()  # one parameter's worth of device memory at a time
                param.copy_(stored)
                stored.copy_(live)  # reuse the (pinned) host buffer

    @contextlib.contextmanager
    def swapped_in(self, chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
        """Run the block with these weights in the chunks; the chunks' own weights come back after,
        even if the block raises."""
        self.exchange(chunks)
        try:
            yield
        finally:
            self.exchange(chunks)

