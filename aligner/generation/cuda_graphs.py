"""CUDA-graph capture of the native engine's decode step: the engine's only GPU-specific code.

A decode step at batch 32 on a small model is hundreds of tiny kernels whose launch cost exceeds
their arithmetic. A CUDA graph records the launches once and replays them with one call. The
recorded kernels keep the tensor addresses they saw, so the captured step must read and write
only buffers that never move (the KV cache, fixed input buffers, the weights) and must not
depend on Python-side values that change between steps: that is `NativeEngine`'s static decode
step (`static_decode=True`), which the engine captures here once per batch size. The engine
captures again when a weight's storage moves or the cache is reallocated.

The CPU tests run the same static step eagerly.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from aligner.runtime.errors import ConfigError


def check_supported(device: torch.device) -> None:
    """Refuse cuda_graphs for weights that are not on a CUDA device (no silent fallback)."""
    if device.type != "cuda":
        raise ConfigError(
            f"cuda_graphs=True needs the model on a CUDA device, but its weights are on {device}; build the "
            "engine with cuda_graphs=False (static_decode=True runs the same static decode step without a graph)"
        )


class CapturedStep:
    """step() recorded once in a CUDA graph; replay() reruns it on the current buffer contents.

    step is first run `warmup` times on a side stream (as torch requires before capture, so lazy
    initialisations happen outside the graph); those runs do real work, so the caller must have
    filled the input buffers with the values of the step about to be taken.
    """

    def __init__(self, step: Callable[[], Optional[torch.Tensor]], warmup: int = 2):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step()

    def replay(self) -> Optional[torch.Tensor]:
        """Rerun the recorded kernels; the result is the same output tensor, overwritten."""
        self.graph.replay()
        return self.output
