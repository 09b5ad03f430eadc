"""Metrics: a progress bar, a per-step metrics line, TensorBoard by default, W&B when configured.

Everything here acts on rank 0 only; other ranks get a logger whose methods do nothing.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from aligner.config import at_least
from aligner.runtime.distributed import is_rank_zero


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "aligner"
    name: Optional[str] = None


@dataclass
class LoggingConfig:
    """The `logging:` section."""

    log_dir: str = "results"
    log_interval: int = at_least(1, 1)
    tensorboard: bool = True
    progress_bar: bool = True
    peak_tflops: Optional[float] = None  # per device, for the MFU estimate; None: measured (CPU) or table (GPU)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def get_logger(name: str = "aligner") -> logging.Logger:
    """A logger that prints on rank 0 and stays quiet elsewhere."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if is_rank_zero() else logging.WARNING)
    return logger


def transformer_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_length: int) -> float:
    """Training FLOPs per token: 6 per parameter (forward + backward) plus attention scores.

    The attention term is 12 * layers * hidden * seq (QK^T and attention x V, forward and
    backward), as in the PaLM appendix's MFU accounting.
    """
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_length


_GPU_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def peak_tflops_per_device(configured: Optional[float]) -> float:
    """Peak dense TFLOP/s of one device: the configured value, a GPU table, or a measured CPU matmul rate."""
    if configured:
        return float(configured)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in _GPU_PEAK_BF16_TFLOPS.items():
            if key in name:
                return value
        return 100.0
    size = 512
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    # Best of individually timed products: a peak rate, robust to other work on the machine.
    fastest = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest / 1e12


class MetricsLogger:
    """Rank-0 sink for scalar metrics and text; call `close()` at the end."""

    def __init__(self, config: LoggingConfig, run_name: str, total_steps: int, initial_step: int = 0, full_config=None):
        self.config = config
        self.enabled = is_rank_zero()
        self.logger = get_logger()
        self.tensorboard = None
        self.wandb = None
        self.progress = None
        self.jsonl = None
        if not self.enabled:
            return
        log_dir = Path(config.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # Machine-readable copy of every logged metric (full precision), appended across resumes.
        self.jsonl = open(log_dir / "metrics.jsonl", "a")
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        if config.wandb.enabled:
            try:
                import wandb
            except ImportError as error:
                raise ImportError("logging.wandb.enabled=true needs the wandb package (pip install wandb)") from error
            self.wandb = wandb.init(project=config.wandb.project, name=config.wandb.name or run_name, config=full_config)
        if config.progress_bar:
            from tqdm import tqdm

            # disable=None: a bar on a terminal, none in a redirected log (the metrics lines remain).
            self.progress = tqdm(total=total_steps, initial=initial_step, desc=run_name, dynamic_ncols=True,
                                 file=sys.stderr, disable=None)

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "split": prefix, **metrics}) + "\n")
        self.jsonl.flush()
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{key}": value for key, value in metrics.items()}, step=step)
        if step % max(self.config.log_interval, 1) == 0 or prefix != "train":
            line = " ".join(f"{key}={_format(value)}" for key, value in metrics.items())
            self.write(f"{prefix} step {step}: {line}")

    def log_text(self, step: int, tag: str, text: str) -> None:
        if self.enabled and self.tensorboard is not None:
            self.tensorboard.add_text(tag, text, step)

    def advance(self, steps: int = 1, **postfix: float) -> None:
        if self.progress is not None:
            self.progress.update(steps)
            if postfix:
                self.progress.set_postfix({k: _format(v) for k, v in postfix.items()}, refresh=False)

    def write(self, message: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.write(message, file=sys.stdout)
        else:
            self.logger.info(message)

    def close(self) -> None:
        if not self.enabled:
            return
        self.jsonl.close()
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value == 0 or math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1e4 or magnitude < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"
