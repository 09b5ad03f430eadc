"""Configs: one yaml per entry point, checked against a dataclass schema, `key=value` overrides.

The schema makes every key explicit: a key in the yaml or on the command line that the schema
does not know is an error (with the known keys listed), and values are type-checked by omegaconf.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence, Type, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"


class ConfigError(ValueError):
    pass


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


def load_config(schema: Type[T], yaml_path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Build a `schema` instance from a yaml file plus `key=value` overrides (dotted keys)."""
    yaml_path = Path(yaml_path)
    if not yaml_path.is_file():
        raise ConfigError(f"config file {yaml_path} does not exist")
    base = OmegaConf.structured(schema)
    try:
        from_file = OmegaConf.load(yaml_path)
        merged = OmegaConf.merge(base, from_file)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{yaml_path}: {_describe(error)}") from None
    bad = [item for item in overrides if "=" not in item or item.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key=value (dotted keys allowed); got {bad}")
    try:
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line override: {_describe(error)}") from None


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"key {key!r}: {message}" if key else message


def parse_command_line(default_config: str | Path, argv: Optional[Sequence[str]] = None) -> tuple[Path, list[str]]:
    """`[--config PATH] key=value ...` -> (config path, overrides)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = Path(default_config)
    overrides = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if item in ("-h", "--help"):
            print(f"usage: {Path(sys.argv[0]).name} [--config PATH] [key=value ...]\n"
                  f"default config: {config_path}\nkeys: see the yaml; nested keys are dotted, e.g. trainer.max_steps=10")
            raise SystemExit(0)
        if item == "--config":
            if index + 1 >= len(argv):
                raise ConfigError("--config needs a path")
            config_path = Path(argv[index + 1])
            index += 2
            continue
        if item.startswith("--config="):
            config_path = Path(item.split("=", 1)[1])
        else:
            overrides.append(item)
        index += 1
    return config_path, overrides



def run_training(schema: Type[T], yaml_name: str, build, after_fit=None) -> None:
    """The body of a training entry point: conf/<yaml_name> + command-line overrides -> schema ->
    build(cfg) -> fit(); after_fit(trainer, cfg) runs on success; the metrics are closed either way."""
    config_path, overrides = parse_command_line(CONF_DIR / yaml_name)
    cfg = load_config(schema, config_path, overrides)
    trainer = build(cfg)
    try:
        trainer.fit()
        if after_fit is not None:
            after_fit(trainer, cfg)
    finally:
        trainer.metrics.close()


def run_main(main) -> None:
    """Run an entry point; user errors (config, data, checkpoint) end with one clear line, exit 2."""
    from aligner.checkpointing import CheckpointError
    from aligner.clients import ClientError
    from aligner.data.jsonl import DataError
    from aligner.runtime import stopping

    stopping.install()
    try:
        main()
    except KeyboardInterrupt as stop:  # SIGINT/SIGTERM: one line, exit 128 + signal (aligner/runtime/stopping.py)
        stopping.exit_on_stop(stop)
    except (ConfigError, DataError, CheckpointError, ClientError, MissingExtraError, FileNotFoundError,
            FileExistsError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        from aligner.runtime import distributed

        distributed.exiting_on_error()
        raise SystemExit(2) from None
