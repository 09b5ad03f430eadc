"""The body of a training entry point: config -> build -> fit -> the end-of-run summary.

Above the trainers' building blocks (it reads checkpoints and writes the metrics summary), so it lives here
rather than in `aligner.config`, which the foundation imports.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Type, TypeVar

from aligner import checkpointing
from aligner.config import CONF_DIR, load_config, parse_command_line, require_writable_dir
from aligner.runtime.distributed import rank_and_world_from_env
from aligner.training import metrics as run_metrics

T = TypeVar("T")


def run_training(schema: Type[T], yaml_name: str, build, after_fit=None,
                 next_commands: Optional[Callable[[Path], list[str]]] = None,
                 argv: Optional[Sequence[str]] = None) -> None:
    """The body of a training entry point: aligner/conf/<yaml_name> + command-line overrides (argv, default sys.argv)
    -> schema -> its data files checked -> build(cfg) -> fit() -> the end-of-run summary
    (MetricsLogger.run_summary, with next_commands(checkpoint), by default chat and export); after_fit(trainer,
    cfg) runs on success before it. A run resumed with no step left (re-running a finished run) says so in one
    line, trains nothing and returns; the metrics are closed either way."""
    started = time.monotonic()
    config_path, overrides = parse_command_line(CONF_DIR / yaml_name, argv, schema=schema)
    cfg = load_config(schema, config_path, overrides)
    if rank_and_world_from_env()[0] == 0:  # rank 0 writes the metrics; found before minutes of model building
        require_writable_dir(cfg.logging.log_dir, "logging.log_dir")
    cfg.check_data_sources()  # every data file exists and has its columns, before the model is built
    trainer = build(cfg)
    try:
        finished = trainer.nothing_to_train()
        if finished is not None:
            where, limit_key = finished
            trainer.metrics.write(f"{where} in checkpoint.save_dir={cfg.checkpoint.save_dir}: nothing to train; to "
                                  f"start fresh use another checkpoint.save_dir, to train on raise {limit_key}")
        trainer.fit()
        if finished is None:
            if after_fit is not None:
                after_fit(trainer, cfg)
            checkpoint = checkpointing.latest_checkpoint(cfg.checkpoint.save_dir)
            commands = (next_commands or run_metrics.next_commands)(checkpoint) if checkpoint is not None else []
            for line in trainer.metrics.run_summary(seconds=time.monotonic() - started, checkpoint=checkpoint,
                                                    next_commands=commands):
                trainer.metrics.write(line)
    finally:
        trainer.metrics.close()
