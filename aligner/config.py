"""Configs: one yaml per entry point, checked against a dataclass schema, `key=value` overrides.

The schema makes every key explicit: a key in the yaml or on the command line that the schema
does not know is an error (with the known keys listed), and values are type-checked by omegaconf.
Value ranges and choices are declared on the schema's fields (`at_least`, `one_of`) and checked
by `load_config` for every entry point, before anything is built.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Type, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner.runtime.errors import ConfigError, UserError

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"


class MissingExtraError(UserError, ImportError):
    """An optional dependency is not installed; the message says which extra to install."""


class OutputError(UserError, OSError):
    """A file or directory the run writes cannot be written (not writable, disk full); the message
    names the path. Raised instead of the bare OSError so that the run ends with that one line."""


def require_writable_dir(path: str | Path, key: str) -> None:
    """Create the directory a setting names if needed and prove it takes a file; an OutputError
    naming the setting and path otherwise (at start-up, before any work is done)."""
    import tempfile

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".write_check_"):
            pass
    except OSError as error:
        raise OutputError(f"{key}={path} is not writable ({error.strerror or error})") from None


def require_checkpoint_dir(path: str | Path, key: str) -> None:
    """Refuse a setting that should name a checkpoint directory (`model.init_from`, `critic.init_from`, ...)
    but names nothing or a file, before anything is built."""
    if not Path(path).exists():
        raise ConfigError(f"{key}={path} does not exist; expected an aligner checkpoint directory (a step_<N> "
                          "directory of an earlier run, or one written by python -m aligner.hf import)")
    if not Path(path).is_dir():
        raise ConfigError(f"{key}={path} is a file; expected an aligner checkpoint directory")


def at_least(minimum: float, default: Any, meaning: str = "") -> Any:
    """A schema field whose value (unless null) must be >= minimum; `meaning` explains the edge
    value in the error, e.g. "0: only at the end"."""
    return dataclasses.field(default=default, metadata={"minimum": minimum, "meaning": meaning})


def one_of(choices: Sequence[str], default: str) -> Any:
    """A schema field that takes one of `choices`."""
    return dataclasses.field(default=default, metadata={"choices": tuple(choices)})


def apply_renamed_keys(node, renames: Sequence[tuple[str, str]], where: str) -> list[str]:
    """Move the values of deprecated dotted keys in an omegaconf node to their new names, in place;
    returns one 'deprecated' line per key moved. Both names set is an error (which one would win?)."""
    lines = []
    for old, new in renames:
        value = OmegaConf.select(node, old, default=_ABSENT)
        if value is _ABSENT:
            continue
        if OmegaConf.select(node, new, default=_ABSENT) is not _ABSENT:
            raise ConfigError(f"{where}: {old} is the old name of {new}; set only {new}")
        _delete_key(node, old)
        OmegaConf.update(node, new, value, force_add=True)
        lines.append(f"deprecated: {where} sets {old}; it is now {new} (the old name goes in the next release)")
    return lines


def drop_retired_keys(node, retired: Sequence[tuple[str, str]], where: str) -> list[str]:
    """Remove keys that are no longer settings from an omegaconf node, in place; returns one
    'deprecated' line per key removed, saying what replaces it."""
    lines = []
    for old, instead in retired:
        if OmegaConf.select(node, old, default=_ABSENT) is _ABSENT:
            continue
        _delete_key(node, old)
        lines.append(f"deprecated: {where} sets {old}, which is no longer a setting ({instead}); it is ignored "
                     "(and refused from the next release)")
    return lines


def _delete_key(node, dotted: str) -> None:
    """Remove a dotted key from an omegaconf node; a section it leaves empty goes too (an old section
    must not stay behind as an unknown key)."""
    parent, _, leaf = dotted.rpartition(".")
    container = OmegaConf.select(node, parent) if parent else node
    del container[leaf]
    if parent and len(container) == 0:
        _delete_key(node, parent)


_ABSENT = object()


def load_config(schema: Type[T], yaml_path: str | Path, overrides: Sequence[str] = ()) -> T:
    """Build a `schema` instance from a yaml file plus `key=value` overrides (dotted keys).

    A schema may list `RENAMED_KEYS` (a class attribute of (old dotted key, new dotted key) pairs): old names
    still load, with a 'deprecated' line on stderr; and `RETIRED_KEYS` ((old dotted key, what replaces it)
    pairs): keys that are no longer settings, dropped with a 'deprecated' line.
    """
    yaml_path = Path(yaml_path)
    if not yaml_path.is_file():
        raise ConfigError(f"config file {yaml_path} does not exist")
    renames = getattr(schema, "RENAMED_KEYS", ())
    retired = getattr(schema, "RETIRED_KEYS", ())
    base = OmegaConf.structured(schema)
    try:
        from_file = OmegaConf.load(yaml_path)
        notes = (apply_renamed_keys(from_file, renames, str(yaml_path))
                 + drop_retired_keys(from_file, retired, str(yaml_path)))
        merged = OmegaConf.merge(base, from_file)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{yaml_path}: {_describe(error)}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{yaml_path}:{_yaml_problem(error)}") from None
    bad = [item for item in overrides if "=" not in item or item.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key=value (dotted keys allowed); got {bad}")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as error:
            raise ConfigError(f"command-line override {item!r}: the value is not valid YAML "
                              f"({getattr(error, 'problem', None) or error})") from None
    try:
        from_command_line = OmegaConf.from_dotlist(list(overrides))
        notes += apply_renamed_keys(from_command_line, renames, "the command line")
        notes += drop_retired_keys(from_command_line, retired, "the command line")
        merged = OmegaConf.merge(merged, from_command_line)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError(f"command-line override: {_describe(error)}") from None
    check_values(config)
    for note in notes:
        print(note, file=sys.stderr)
    return config


def check_values(node: Any, prefix: str = "") -> None:
    """Refuse values outside the ranges and choices the schema declares (see `at_least`, `one_of`),
    naming the dotted key; a dataclass may add checks across its fields in `check_fields()`, which
    returns (field name, complaint) or None."""
    if isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            check_values(item, f"{prefix[:-1]}[{index}].")
        return
    if not dataclasses.is_dataclass(node):
        return
    for spec in dataclasses.fields(node):
        value, key = getattr(node, spec.name), prefix + spec.name
        minimum = spec.metadata.get("minimum")
        if minimum is not None and value is not None and value < minimum:
            meaning = spec.metadata.get("meaning")
            raise ConfigError(f"{key}={value} is out of range: it must be >= "
                              f"{minimum}{f' ({meaning})' if meaning else ''}")
        choices = spec.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(choices)}")
        check_values(value, key + ".")
    check_fields = getattr(node, "check_fields", None)
    problem = check_fields() if callable(check_fields) else None
    if problem is not None:
        name, complaint = problem
        raise ConfigError(f"{prefix}{name}={getattr(node, name)!r}: {complaint}")


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None)
    message = str(error).splitlines()[0]
    return f"key {key!r}: {message}" if key else message


def _yaml_problem(error: yaml.YAMLError) -> str:
    """`LINE: what is wrong` of a yaml syntax error (after the file name)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context = getattr(error, "context", None)
    context_mark = getattr(error, "context_mark", None)
    where = f"{mark.line + 1}: " if mark is not None else " "
    detail = f" ({context} from line {context_mark.line + 1})" if context and context_mark is not None else ""
    return f"{where}invalid YAML: {problem}{detail}"


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
                  f"default config: {config_path}\n"
                  "keys: see the yaml; nested keys are dotted, e.g. trainer.max_steps=10")
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
    from aligner.runtime.distributed import rank_and_world_from_env

    config_path, overrides = parse_command_line(CONF_DIR / yaml_name)
    cfg = load_config(schema, config_path, overrides)
    if rank_and_world_from_env()[0] == 0:  # rank 0 writes the metrics; found before minutes of model building
        require_writable_dir(cfg.logging.log_dir, "logging.log_dir")
    trainer = build(cfg)
    try:
        trainer.fit()
        if after_fit is not None:
            after_fit(trainer, cfg)
    finally:
        trainer.metrics.close()


def run_main(main) -> None:
    """Run an entry point; user errors (a `UserError`: config, data, checkpoint, output, launch, a missing
    extra; or a `ClientError`: a server that cannot be reached) end with one clear line, exit 2. Any
    other exception is a bug: it keeps its traceback (exit 1)."""
    from aligner.clients import ClientError  # the clients stand alone, so theirs is not a UserError
    from aligner.runtime import stopping

    stopping.install()
    try:
        main()
    except KeyboardInterrupt as stop:  # SIGINT/SIGTERM: one line, exit 128 + signal (aligner/runtime/stopping.py)
        stopping.exit_on_stop(stop)
    except (UserError, ClientError) as error:
        print(f"error: {error}", file=sys.stderr)
        from aligner.runtime import distributed

        distributed.exiting_on_error()
        raise SystemExit(2) from None
