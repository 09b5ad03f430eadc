"""Metrics: a progress bar, a per-step metrics line, TensorBoard by default, W&B when configured.

The console's per-step line is short by default (`SHORT_LINE`: step, loss, reward and KL where the run
has them, lr, tokens/s, step time; `logging.console=full` prints every metric); the full set goes to
metrics.jsonl, TensorBoard and W&B either way. The first step a process runs and the run's last step are
always printed, whatever `logging.log_interval`; `run_summary` is the end-of-run report.

Everything here acts on rank 0 only; other ranks get a logger whose methods do nothing.

`<log_dir>/metrics.jsonl` holds one JSON row per logged metric set, `{"step", "split", ...}`,
appended across resumes. A resume first writes a marker row
`{"step": N, "split": "resumed_from", "checkpoint": PATH, "changed_settings": {KEY: [OLD, NEW]}}`:
rows after it with step > N re-run steps that rows before it already logged. A row cut short by a
crash is removed when the file is next opened for appending. `read_metrics` reads the file
without marker rows, either as written or as the run's history (one row per step and split, from
its newest attempt).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch

from aligner.config import MissingExtraError, OutputError, at_least, one_of, require_writable_dir
from aligner.runtime import cpu_products
from aligner.runtime.distributed import is_rank_zero
from aligner.runtime.errors import DataError


@dataclass
class WandbConfig:
    enabled: bool = False
    project: str = "aligner"
    name: Optional[str] = None


@dataclass
class LoggingConfig:
    """The `logging:` section."""

    log_dir: Optional[str] = None  # metrics.jsonl and TensorBoard; None: checkpoint.save_dir (see RunConfig)
    log_interval: int = at_least(1, 1)  # steps between console lines (the first and last step always print)
    console: str = one_of(("short", "full"), "short")  # per-step console line: short (SHORT_LINE) | full: every metric
    tensorboard: bool = True
    progress_bar: bool = True
    peak_tflops: Optional[float] = None  # per device, for the MFU estimate; None: measured (CPU) or table (GPU)
    wandb: WandbConfig = field(default_factory=WandbConfig)


METRICS_FILE = "metrics.jsonl"
# The short console line: (label, metric key), each shown when the step reports it. The RL actor's
# throughput is its generation's (rollout_tokens_per_second); the other trainers' is the update's.
SHORT_LINE = (("loss", "loss"), ("reward", "reward_mean"), ("kl", "kl"), ("lr", "lr"),
              ("tokens/s", "tokens_per_second"), ("gen tokens/s", "rollout_tokens_per_second"), ("time", "step_time"))
RESUMED_FROM = "resumed_from"  # the split of a resume's marker row


def read_metrics(path: str | Path, *splits: str, newest_attempt: bool = False,
                 include_markers: bool = False) -> list[dict]:
    """The rows of a metrics.jsonl (or of `<log_dir>/metrics.jsonl`), in order; those of `splits` if given.

    A last line without its newline that is not valid JSON (a write cut short by a crash) is
    skipped. newest_attempt: drop the rows that a resume re-ran (at a `resumed_from` marker for
    step N, the earlier rows with step > N), so each step appears once, from its newest attempt.
    include_markers: keep the marker rows as well (they are left out otherwise, whatever `splits` says).
    """
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    rows: list[dict] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the unterminated last line: a crash cut this write short
                break
            raise DataError(f"{path}:{number}: not valid JSON ({error.msg}); "
                            "expected one metrics row per line") from None
        if newest_attempt and row.get("split") == RESUMED_FROM:
            rows = [kept for kept in rows if kept["step"] <= row["step"] or kept["split"] == RESUMED_FROM]
        rows.append(row)
    return [row for row in rows if (include_markers or row["split"] != RESUMED_FROM)
            and (not splits or row["split"] in splits or (include_markers and row["split"] == RESUMED_FROM))]


def _drop_partial_last_line(path: Path) -> int:
    """Cut a last line that has no newline (a crash mid-write) off the file; returns the bytes removed."""
    if not path.is_file():
        return 0
    with open(path, "rb+") as handle:
        size = handle.seek(0, 2)
        if size == 0:
            return 0
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return 0
        # Scan back for the last complete line (rows are small: a few kB at most).
        keep, position = 0, size
        while position > 0:
            start = max(position - 65536, 0)
            handle.seek(start)
            chunk = handle.read(position - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        handle.truncate(keep)
        return size - keep


def _quiet_tensorboard_writer_failures() -> None:
    """TensorBoard's writer thread re-raises a failed write (a full disk), which prints a thread
    traceback; the main thread gets the same error at its next write and ends the run with one line
    (MetricsLogger._writing), so the thread's own report is left out. Idempotent."""
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        from_tensorboard = type(args.thread).__module__.startswith("tensorboard.")
        if not (from_tensorboard and args.exc_type is not None and issubclass(args.exc_type, OSError)):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


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


def cpu_matmul_flops(size: int = 1024, repeats: int = 3) -> float:
    """FLOP/s of the fastest of `repeats` fp32 [size, size] x [size, size] products on this CPU, through
    BLAS (`a @ b`) and, where it can run them, oneDNN (`cpu_products`): the faster sets the peak, so MFU
    stays below 1 whichever library the training products run on."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    products = [lambda: a @ b]
    if cpu_products.available(a.device, a.dtype):
        products.append(lambda: cpu_products.linear(a, b))
    fastest = float("inf")
    for product in products:
        product()  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            product()
            fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest


class PeakRate:
    """Peak dense FLOP/s of one device, the denominator of MFU.

    Configured (`logging.peak_tflops`), a GPU table, or on a CPU the best matmul rate measured
    alongside the run: a rate measured once at start-up under load read low, and MFU then read
    above 1 when the machine quieted. So the CPU rate is re-measured every `resample_s` seconds and
    whenever a step's achieved rate exceeds it, and the best seen is kept.
    """

    def __init__(self, configured: Optional[float] = None, resample_s: float = 30.0):
        self.measured = not configured and not torch.cuda.is_available()
        self.resample_s = resample_s
        if configured:
            self.flops = float(configured) * 1e12
        elif torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            self.flops = next((value for key, value in _GPU_PEAK_BF16_TFLOPS.items() if key in name), 100.0) * 1e12
        else:
            self.flops = cpu_matmul_flops()
        self.sampled_at = time.monotonic()

    def refresh(self, achieved_flops: float) -> float:
        """The peak FLOP/s to divide a step's `achieved_flops` (per device) by, re-measured when due."""
        if self.measured and (achieved_flops > self.flops or time.monotonic() - self.sampled_at >= self.resample_s):
            self.flops = max(self.flops, cpu_matmul_flops())
            self.sampled_at = time.monotonic()
        return self.flops


class MetricsLogger:
    """Rank-0 sink for scalar metrics and text; call `close()` at the end."""

    def __init__(self, config: LoggingConfig, run_name: str, total_steps: int, initial_step: int = 0, full_config=None):
        self.config = config
        self.total_steps = total_steps
        self.enabled = is_rank_zero()
        # This process's training steps, for the console's first line and the end-of-run summary.
        self.steps_run = 0
        self.step = initial_step  # the newest training step logged (or resumed from)
        self.last_train: dict[str, float] = {}
        self.tokens = {"trained": 0.0, "generated": 0.0}
        self.logger = get_logger()
        self.tensorboard = None
        self.wandb = None
        self.progress = None
        self.jsonl = None
        if not self.enabled:
            return
        log_dir = Path(config.log_dir)
        require_writable_dir(log_dir, "logging.log_dir")
        # Machine-readable copy of every logged metric (full precision), appended across resumes.
        self.jsonl_path = log_dir / METRICS_FILE
        try:
            dropped = _drop_partial_last_line(self.jsonl_path)
            self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        except OSError as error:
            raise OutputError(f"{self.jsonl_path}: cannot open it for appending ({error.strerror or error})") from None
        if dropped:
            self.logger.warning(f"{self.jsonl_path}: removed a partial last row ({dropped} bytes) that an interrupted "
                                "run left behind")
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_writer_failures()
            self.tensorboard = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        if config.wandb.enabled:
            try:
                import wandb
            except ImportError as error:
                raise MissingExtraError("logging.wandb.enabled=true needs the wandb package "
                                        "(pip install wandb)") from error
            self.wandb = wandb.init(project=config.wandb.project, name=config.wandb.name or run_name,
                                    config=full_config)
        if config.progress_bar:
            from tqdm import tqdm

            # disable=None: a bar on a terminal, none in a redirected log (the metrics lines remain).
            self.progress = tqdm(total=total_steps, initial=initial_step, desc=run_name, dynamic_ncols=True,
                                 file=sys.stderr, disable=None)

    @contextlib.contextmanager
    def _writing(self, path: Path) -> Iterator[None]:
        """A full or failing disk under log_dir ends the run with one line naming the file (OutputError):
        every later metric would be lost. The trainer's stop handling decides what else to save."""
        try:
            yield
        except OSError as error:
            if self.jsonl is not None:
                jsonl, self.jsonl = self.jsonl, None
                with contextlib.suppress(OSError):
                    jsonl.close()  # a partial row it leaves is dropped when the file is next opened
            raise OutputError(f"{path}: cannot write metrics ({error.strerror or error}); the run stops, since "
                              "every later metric would be lost") from None

    def _write_row(self, row: dict) -> None:
        with self._writing(self.jsonl_path):
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()

    def log(self, step: int, metrics: dict[str, float], prefix: str = "train") -> None:
        if not self.enabled:
            return
        self._write_row({"step": step, "split": prefix, **metrics})
        if self.tensorboard is not None:
            with self._writing(Path(self.tensorboard.log_dir)):
                for key, value in metrics.items():
                    self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{key}": value for key, value in metrics.items()}, step=step)
        if prefix != "train":
            line = " ".join(f"{key}={_format(value)}" for key, value in metrics.items())
            self.write(f"{prefix} step {step}: {line}")
            return
        self.steps_run += 1
        self.step = step
        self.last_train = metrics
        self.tokens["trained"] += metrics.get("tokens", 0.0)
        self.tokens["generated"] += metrics.get("generated_tokens", 0.0)
        if step % max(self.config.log_interval, 1) == 0 or step >= self.total_steps or self.steps_run == 1:
            self.write(self.console_line(step, metrics))

    def console_line(self, step: int, metrics: dict[str, float]) -> str:
        """The console's line of a training step: `step N/TOTAL: loss=... lr=... tokens/s=... time=...`
        (`SHORT_LINE`), or every metric with logging.console=full."""
        if self.config.console == "full":
            shown = [f"{key}={_format(value)}" for key, value in metrics.items()]
        else:
            shown = [f"{label}={_short(key, metrics[key])}" for label, key in SHORT_LINE if key in metrics]
        return f"step {step}/{self.total_steps}: {' '.join(shown)}"

    def run_summary(self, *, seconds: float, checkpoint: Optional[Path],
                    next_commands: list[str]) -> list[str]:
        """The end-of-run report's lines: steps, time, final loss (and reward), tokens, checkpoint, next commands."""
        last = self.last_train
        finals = "".join(f", final {label} {_format(last[key])}" for label, key in (("loss", "loss"),
                                                                                   ("reward", "reward_mean"))
                         if key in last)
        tokens = ", ".join(f"{count:,.0f} tokens {kind}" for kind, count in self.tokens.items() if count)
        lines = [f"done: {self.steps_run} step(s) in {seconds:.1f} s, now at step {self.step}/{self.total_steps}"
                 f"{finals}{'; ' + tokens if tokens else ''}",
                 f"checkpoint: {checkpoint}" if checkpoint is not None else
                 "checkpoint: none saved (checkpoint.save_at_end=false)"]
        if checkpoint is not None:
            lines += [f"next: {command}" for command in next_commands]
        return lines

    def log_resume(self, step: int, checkpoint: str | Path, changed_settings: Optional[dict] = None) -> None:
        """The marker row of a resume from `checkpoint` at `step`: rows after it with a step > `step`
        re-run steps that earlier rows logged. changed_settings: {key: [old, new]} of the schedule
        settings that differ from the checkpoint's (see aligner.training.schedule)."""
        self.step = step
        if not self.enabled:
            return
        self._write_row({"step": step, "split": RESUMED_FROM, "checkpoint": str(checkpoint),
                         "changed_settings": {key: list(pair) for key, pair in (changed_settings or {}).items()}})

    def log_text(self, step: int, tag: str, text: str) -> None:
        if self.enabled and self.tensorboard is not None:
            with self._writing(Path(self.tensorboard.log_dir)):
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
        if self.jsonl is not None:
            with self._writing(self.jsonl_path):
                jsonl, self.jsonl = self.jsonl, None
                jsonl.close()
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            tensorboard, self.tensorboard = self.tensorboard, None
            with self._writing(Path(tensorboard.log_dir)):
                tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _short(key: str, value: float) -> str:
    """A value on the short console line: throughput in whole tokens, times in seconds, the rest `_format`."""
    if key.endswith("tokens_per_second") and math.isfinite(value):
        return f"{value:.0f}"
    if key == "step_time" and math.isfinite(value):
        return f"{value:.2f}s"
    return _format(value)


def next_commands(checkpoint: Path) -> list[str]:
    """What a user usually runs on a trained policy's checkpoint: chat with it, export it to Hugging Face."""
    return [f"python examples/nlp/gpt/chat.py init_from={checkpoint}",
            f"python -m aligner.hf export --checkpoint {checkpoint} --output {checkpoint.parent / 'hf'}"]


def _format(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if value == 0 or math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1e4 or magnitude < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"
