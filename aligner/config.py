"""Configs: one yaml per entry point, checked against a dataclass schema, `key=value` overrides.

The schema makes every key explicit: a key in the yaml or on the command line that the schema
does not know is an error (with the known keys listed), and values are type-checked by omegaconf.
Value ranges and choices are declared on the schema's fields (`at_least`, `one_of`) and checked
by `load_config` for every entry point, before anything is built.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Type, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
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
    renames = getattr(schema, "RENAMED_KEYS", ())
    retired = getattr(schema, "RETIRED_KEYS", ())
    merged = OmegaConf.structured(schema)
    notes, layers = [], []
    for path, from_file in _config_files(yaml_path):  # the file it extends first, then the file itself
        try:
            notes += apply_renamed_keys(from_file, renames, str(path))
            notes += drop_retired_keys(from_file, retired, str(path))
            from_file = expand_path_shorthands(schema, from_file)
            _check_shapes(schema, from_file, lambda key, path=path: _in_file(path, key))
            merged = OmegaConf.merge(merged, from_file)
        except OmegaConfBaseException as error:
            raise ConfigError(f"{_in_file(path, getattr(error, 'full_key', None))}{_describe(error)}") from None
        layers.append((path, from_file))
    bad = [item for item in overrides if "=" not in item or item.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like key=value (dotted keys allowed); got {bad}")
    for item in overrides:
        try:
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as error:
            raise ConfigError(f"command-line override {item!r}: the value is not valid YAML "
                              f"({getattr(error, 'problem', None) or error})") from None
    on_command_line = "command-line override: "
    try:
        from_command_line = OmegaConf.from_dotlist(list(overrides))
        notes += apply_renamed_keys(from_command_line, renames, "the command line")
        notes += drop_retired_keys(from_command_line, retired, "the command line")
        from_command_line = expand_path_shorthands(schema, from_command_line)
        _check_shapes(schema, from_command_line, lambda key: on_command_line)
        merged = OmegaConf.merge(merged, from_command_line)
    except OmegaConfBaseException as error:
        raise ConfigError(f"{on_command_line}{_describe(error)}") from None
    try:
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        # Interpolations and missing values are resolved here, whichever source set them.
        key = getattr(error, "full_key", None)
        setting_file = next((path for path, node in reversed(layers) if _set_by(node, key)), yaml_path)
        where = on_command_line if _set_by(from_command_line, key) else _in_file(setting_file, key)
        raise ConfigError(f"{where}{_describe(error)}") from None
    check_values(config)
    for note in notes:
        print(note, file=sys.stderr)
    return config


EXTENDS_KEY = "extends"


def _config_files(yaml_path: Path) -> list[tuple[Path, Any]]:
    """[(path, its omegaconf node)] of a config file and the files it extends, the farthest first.

    A file may start with `extends: OTHER.yaml` (relative to its own directory): it then holds only the
    keys it changes, merged over OTHER's (the recipes in conf/recipes/ extend an entry point's yaml)."""
    files, seen = [], []
    path: Optional[Path] = yaml_path
    while path is not None:
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist" if not files else
                              f"{_in_file(files[0][0], EXTENDS_KEY)}extends {path}, which does not exist")
        if path.resolve() in seen:
            raise ConfigError(f"{_in_file(files[0][0], EXTENDS_KEY)}extends {path}, which extends it back (a cycle)")
        seen.append(path.resolve())
        try:
            node = OmegaConf.load(path)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}:{_yaml_problem(error)}") from None
        except OmegaConfBaseException as error:
            raise ConfigError(f"{_in_file(path, getattr(error, 'full_key', None))}{_describe(error)}") from None
        extends = node.pop(EXTENDS_KEY, None) if isinstance(node, DictConfig) else None
        if extends is not None and not isinstance(extends, str):
            raise ConfigError(f"{_in_file(path, EXTENDS_KEY)}{EXTENDS_KEY} must name one yaml file, got {extends!r}")
        files.insert(0, (path, node))
        path = path.parent / extends if extends else None
    return files


# ----------------------------------------------------------------------------- where a bad value is
def _key_parts(key: str) -> list[str | int]:
    """omegaconf's full key "data.train[0].path" -> ["data", "train", 0, "path"]."""
    return [int(part[1:-1]) if part.startswith("[") else part for part in re.findall(r"\[\d+\]|[^.\[\]]+", key)]


def _dotted(parts: Sequence[str | int]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in parts).lstrip(".")


def _in_file(yaml_path: Path, key: Optional[str]) -> str:
    """`path:line: ` of the line that sets a dotted key in a yaml file, or `path: ` where no line does."""
    line = _yaml_line(yaml_path, _key_parts(key)) if key else None
    return f"{yaml_path}:{line}: " if line else f"{yaml_path}: "


def _yaml_line(yaml_path: Path, parts: Sequence[str | int]) -> Optional[int]:
    """The 1-based line of a key (or list item) in a yaml file, from the parser's node marks."""
    try:
        node = yaml.compose(yaml_path.read_text(), Loader=yaml.SafeLoader)
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in parts:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            entry = next(((key, value) for key, value in node.value if getattr(key, "value", None) == part), None)
            if entry is None:
                return None
            line, node = entry[0].start_mark.line + 1, entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return None
    return line


def _set_by(node, key: Optional[str]) -> bool:
    """Whether an omegaconf node (the command-line overrides) sets a dotted key, or a list that holds it
    (a list is replaced whole, not merged)."""
    if not key:
        return False
    value = OmegaConf.to_container(node, resolve=False)
    for part in _key_parts(key):
        if isinstance(value, list):
            return True
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


def expand_path_shorthands(schema: type, node):
    """An omegaconf node with each list of path entries given as a path or a list of paths written out as
    entries: `data.train=a.parquet` -> [{path: a.parquet}], `data.train=[a.parquet, b.jsonl]` ->
    [{path: a.parquet}, {path: b.jsonl}] (a list whose schema entries are sections with a `path` key)."""
    container = OmegaConf.to_container(node, resolve=False)
    expanded = _expand_paths(schema, container)
    return node if expanded == container else OmegaConf.create(expanded)


def _is_path_entry(annotation: Any) -> bool:
    return dataclasses.is_dataclass(annotation) and "path" in {spec.name for spec in dataclasses.fields(annotation)}


def _expand_paths(annotation: Any, value: Any) -> Any:
    """`expand_path_shorthands` of a plain yaml tree (dicts and lists) under its schema annotation."""
    if value is None or (isinstance(value, str) and (value == "???" or "${" in value)):
        return value
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        return _expand_paths(members[0], value) if len(members) == 1 else value
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):
        try:
            hints = typing.get_type_hints(annotation)
        except (NameError, TypeError):  # an annotation that cannot be evaluated here: omegaconf checks it
            return value
        names = {spec.name for spec in dataclasses.fields(annotation)}
        return {name: _expand_paths(hints[name], item) if name in names and name in hints else item
                for name, item in value.items()}
    arguments = typing.get_args(annotation)
    if (typing.get_origin(annotation) or annotation) is list and arguments and _is_path_entry(arguments[0]):
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):
            return [{"path": item} if isinstance(item, str) else item for item in items]
    return value


def _check_shapes(schema: type, node, where) -> None:
    """Refuse a mapping where the schema has a list (or a list, a mapping or a value where another of
    these belongs) before omegaconf's merge, which names no key for them. where(key) is the
    message's prefix: the file and line, or the command line."""
    found = _shape_problem(schema, OmegaConf.to_container(node, resolve=False), [])
    if found is not None:
        parts, problem = found
        key = _dotted(parts)
        raise ConfigError(f"{where(key)}key {key!r}{'' if problem.startswith('is ') else ':'} {problem}")


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping (key: value)"
    if isinstance(value, list):
        return "a list"
    return f"the value {value!r}"


def _shape_problem(annotation: Any, value: Any, parts: list) -> Optional[tuple[list, str]]:
    """(key parts, what is wrong) of the first value of a yaml tree (plain dicts and lists) whose kind
    (mapping, list, single value) is not the one its schema annotation asks for; None if all fit.
    Values, types within a kind, unknown keys and interpolations are left to omegaconf."""
    if value is None or (isinstance(value, str) and (value == "???" or "${" in value)):
        return None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(annotation) if member is not type(None)]
        return _shape_problem(members[0], value, parts) if len(members) == 1 else None
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            names = [spec.name for spec in dataclasses.fields(annotation)]
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            return parts, f"is {_kind(value)}; expected a section of keys ({shown})"
        try:
            hints = typing.get_type_hints(annotation)
        except (NameError, TypeError):  # an annotation that cannot be evaluated here: omegaconf checks it
            return None
        for name, item in value.items():
            if name in hints and name in {spec.name for spec in dataclasses.fields(annotation)}:
                found = _shape_problem(hints[name], item, parts + [name])
                if found is not None:
                    return found
        return None
    container = typing.get_origin(annotation) or annotation
    arguments = typing.get_args(annotation)
    if container in (list, tuple):
        if not isinstance(value, list):
            return parts, f"is {_kind(value)}; expected a list (- item lines, or [a, b])"
        element = arguments[0] if arguments else Any
        for index, item in enumerate(value):
            found = _shape_problem(element, item, parts + [index]) or _entry_problem(element, item, parts + [index])
            if found is not None:
                return found
        return None
    if container is dict:
        if not isinstance(value, dict):
            return parts, f"is {_kind(value)}; expected a mapping (key: value lines)"
        element = arguments[1] if len(arguments) == 2 else Any
        for name, item in value.items():
            found = _shape_problem(element, item, parts + [str(name)])
            if found is not None:
                return found
        return None
    if annotation not in (Any, object) and isinstance(value, (dict, list)):
        expected = getattr(annotation, "__name__", str(annotation))
        return parts, f"is {_kind(value)}; expected a single value ({expected})"
    return None


def _entry_problem(annotation: Any, value: Any, parts: list) -> Optional[tuple[list, str]]:
    """omegaconf's complaint about one list entry of a section type (e.g. a data.train entry), with the
    entry's full key: merged inside the list, its errors name only the field ('weight')."""
    if not dataclasses.is_dataclass(annotation) or not isinstance(value, dict):
        return None
    try:
        OmegaConf.merge(OmegaConf.structured(annotation), value)
    except OmegaConfBaseException as error:
        field = getattr(error, "full_key", None)
        return parts + (_key_parts(field) if field else []), str(error).splitlines()[0]
    return None


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
    """The body of a training entry point: conf/<yaml_name> + command-line overrides -> schema (a
    `RunConfig`) -> its data files checked -> build(cfg) -> fit(); after_fit(trainer, cfg) runs on success;
    the metrics are closed either way."""
    from aligner.runtime.distributed import rank_and_world_from_env

    config_path, overrides = parse_command_line(CONF_DIR / yaml_name)
    cfg = load_config(schema, config_path, overrides)
    if rank_and_world_from_env()[0] == 0:  # rank 0 writes the metrics; found before minutes of model building
        require_writable_dir(cfg.logging.log_dir, "logging.log_dir")
    cfg.check_data_sources()  # every data file exists and has its columns, before the model is built
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
