"""Configs: one yaml per entry point, checked against a dataclass schema, `key=value` overrides.

The schema makes every key explicit: a key in the yaml or on the command line that the schema
does not know is an error (with the known keys listed), and values are type-checked by omegaconf.
Value ranges and choices are declared on the schema's fields (`at_least`, `one_of`) and checked
by `load_config` for every entry point, before anything is built.
"""
from __future__ import annotations

import ast
import atexit
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, Type, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner.clients import ClientError  # the clients stand alone, so theirs is not a UserError
from aligner.runtime import distributed, stopping
from aligner.runtime.errors import ConfigError, UserError

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shipped configs: package data (a wheel has them too); the source tree's conf/ links here.
CONF_DIR = Path(__file__).resolve().parent / "conf"


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

    A schema may name `PRESETS = (key, {name: {dotted key: value}})`: the preset that `key` names (in the
    file or on the command line) sets its keys directly under the source that names it, so the rest of that
    source and everything after it win: `algorithm=dapo loss.clip_high=0.3` keeps 0.3 (`describe_preset`
    says which preset keys were kept from the user).
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
    preset_key, presets = getattr(schema, "PRESETS", (None, {}))
    if preset_key is not None:
        name, where, position = _preset_choice(preset_key, layers, from_command_line)
        if name is not None:
            if name not in presets:
                raise ConfigError(f"{where}{preset_key}={name!r} is not one of {', '.join(presets)}")
            preset = OmegaConf.from_dotlist([f"{key}={_dotlist_value(value)}" for key, value in presets[name].items()])
            # Under the source that names it: that file's keys, the files extending it and the command line win.
            nodes = [node for _, node in layers]
            merged = OmegaConf.merge(OmegaConf.structured(schema), *nodes[:position], preset, *nodes[position:],
                                     from_command_line)
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

    A file may start with `extends: OTHER.yaml`: it then holds only the keys it changes, merged over OTHER's.
    OTHER is relative to the file's own directory, else to the shipped configs (CONF_DIR), so a copy of a
    shipped yaml (`extends: base.yaml`) still finds its base. The entry points' yamls extend the shared bases
    (base.yaml, ...), and the recipes in aligner/conf/recipes/ extend an entry point's yaml."""
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
        path = _extended_path(path, extends) if extends else None
    return files


def _extended_path(path: Path, extends: str) -> Path:
    """The file `extends: NAME` in `path` names: beside it, else among the shipped configs."""
    beside = path.parent / extends
    shipped = CONF_DIR / extends
    return shipped if not beside.is_file() and not Path(extends).is_absolute() and shipped.is_file() else beside


def composed_config(yaml_path: str | Path):
    """The omegaconf node of a config file with the files it extends merged under it (no schema, no overrides):
    what the file sets, wherever in its chain."""
    return OmegaConf.merge(OmegaConf.create(), *(node for _, node in _config_files(Path(yaml_path))))


def load_presets(directory: str | Path) -> dict[str, dict[str, Any]]:
    """{NAME: {dotted key: value}} of the preset files NAME.yaml in a directory (a schema's `PRESETS`): each is
    a partial config, a user can read or copy it, and it may `extends` another."""
    presets = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        values = OmegaConf.to_container(composed_config(path), resolve=False)
        presets[path.stem] = dict(_flatten(values))
    return presets


def _flatten(values: dict, prefix: str = ""):
    """(dotted key, value) of each leaf of a nested mapping, in the file's order."""
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _preset_choice(key: str, layers: list, from_command_line) -> tuple[Optional[str], str, int]:
    """(the preset a config names, where: the message prefix of the source naming it, the position of that source
    among the config files (their count for the command line)); the command line wins, then the last file."""
    named = OmegaConf.select(from_command_line, key, default=_ABSENT)
    if named is not _ABSENT:
        return named, "command-line override: ", len(layers)
    for position in reversed(range(len(layers))):
        path, node = layers[position]
        named = OmegaConf.select(node, key, default=_ABSENT)
        if named is not _ABSENT:
            return named, _in_file(path, key), position
    return None, "", 0


def _dotlist_value(value: Any) -> str:
    """A preset value as a dotlist override's text (YAML): null, true/false, numbers, strings."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def dotted_value(config: Any, key: str) -> Any:
    """The value of a dotted key ("loss.clip_high") in a loaded config."""
    for part in key.split("."):
        config = getattr(config, part)
    return config


def describe_preset(config: Any) -> Optional[str]:
    """One line naming the preset a loaded config chose and the settings it set, or None without one:
    `algorithm=dapo: advantage.estimator=grpo loss.clip_high=0.28 ...; kept yours: loss.clip_high=0.3`."""
    key, presets = getattr(type(config), "PRESETS", (None, {}))
    name = dotted_value(config, key) if key is not None else None
    if name is None:
        return None
    settings = presets[name]
    applied = [f"{item}={_dotlist_value(value)}" for item, value in settings.items()
               if dotted_value(config, item) == value]
    kept = [f"{item}={_dotlist_value(dotted_value(config, item))}" for item, value in settings.items()
            if dotted_value(config, item) != value]
    return (f"{key}={name}: {' '.join(applied) or 'nothing'}"
            + (f"; kept yours: {' '.join(kept)}" if kept else ""))


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


def parse_command_line(default_config: str | Path, argv: Optional[Sequence[str]] = None,
                       schema: Optional[type] = None) -> tuple[Path, list[str]]:
    """`[--config PATH] key=value ...` -> (config path, overrides). `--help` prints the usage and, given the
    entry point's schema, every key with its default (the config file's) and comment, then exits 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = Path(default_config)
    overrides = []
    index = 0
    while index < len(argv):
        item = argv[index]
        if item == "--config":
            if index + 1 >= len(argv):
                raise ConfigError("--config needs a path")
            config_path = Path(argv[index + 1])
            index += 2
            continue
        if item.startswith("--config="):
            config_path = Path(item.split("=", 1)[1])
        elif item not in ("-h", "--help"):
            overrides.append(item)
        index += 1
    if "-h" in argv or "--help" in argv:  # after the loop: the keys of the --config file, wherever it stands
        text = (f"usage: {Path(sys.argv[0]).name} [--config PATH] [key=value ...]\n"
                f"config: {config_path}\n"
                "nested keys are dotted, e.g. trainer.max_steps=10; a list or mapping is YAML, e.g. "
                "'data.train=[{path: a.jsonl}]'")
        if schema is not None:
            text += "\n\nkeys (default: the config file's value; ??? must be set):\n"
            text += "\n".join(describe_keys(schema, config_path))
        try:
            print(text, flush=True)
        except BrokenPipeError:  # `--help | head`: the reader left; nothing else is worth saying
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    return config_path, overrides


# ----------------------------------------------------------------------------- --help: every key
class KeyRow(typing.NamedTuple):
    """One setting of an entry point's schema, as `--help` and the docs' configuration reference show it."""
    key: str  # dotted
    default: str  # the config file's value (the schema's where the file does not set it), as a dotlist value
    type: str  # the field's annotation, e.g. `int | None`
    allowed: str  # the field's declared choices or minimum, '' if none
    comment: str  # the config file's comment on its line, else the schema field's comment


def key_rows(schema: type, yaml_path: str | Path) -> list[KeyRow]:
    """Every key of `schema` with its default as `yaml_path` sets it, its type, allowed values and comment."""
    yaml_path = Path(yaml_path)
    files = _config_files(yaml_path) if yaml_path.is_file() else []
    merged = OmegaConf.merge(OmegaConf.structured(schema), *(node for _, node in files))
    values = OmegaConf.to_container(merged, resolve=False)
    file_comments = {}  # the comment of the last file in the chain that has one on the key's line
    for path, _ in files:
        file_comments.update(_yaml_comments(path.read_text()))
    rows = []
    for key, value, spec, owner in _leaves(schema, values, ""):
        comment = file_comments.get(key) or _field_comments(owner).get(spec.name, "")
        allowed = []
        if spec.metadata.get("choices"):
            allowed.append("one of " + " | ".join(spec.metadata["choices"]))
        if spec.metadata.get("minimum") is not None:
            meaning = spec.metadata.get("meaning")
            allowed.append(f">= {spec.metadata['minimum']}{f'; {meaning}' if meaning and not comment else ''}")
        type_name = _type_name(typing.get_type_hints(owner).get(spec.name, spec.type))
        rows.append(KeyRow(key, _dotlist_value(value), type_name, "; ".join(allowed), comment))
    return rows


def _type_name(annotation: Any) -> str:
    """`Optional[list[str]]` -> 'list[str] | None'; a class -> its name."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(member) for member in arguments)
    if origin is not None:
        inner = ", ".join(_type_name(argument) for argument in arguments)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", "")
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def describe_keys(schema: type, yaml_path: str | Path) -> list[str]:
    """One line per key of `schema` (`--help`): `key = default  # comment`, the default as the config file sets
    it (the schema's where the file does not), the comment from the file's line or else from the schema's
    field, with the field's allowed values."""
    lines = []
    for row in key_rows(schema, yaml_path):
        allowed = [part for part in row.allowed.split("; ") if part and part not in row.comment]
        notes = "; ".join([row.comment] * bool(row.comment) + allowed)
        lines.append(f"  {row.key} = {row.default}" + (f"  # {notes}" if notes else ""))
    return lines


def _leaves(annotation: Any, value: Any, prefix: str):
    """(dotted key, value, its dataclass field or None, the dataclass that declares it) of each setting: the
    schema's sections are walked, anything else (a value, a list, a mapping) is one setting."""
    if not dataclasses.is_dataclass(annotation) or not isinstance(value, dict):
        return
    hints = typing.get_type_hints(annotation)
    for spec in dataclasses.fields(annotation):
        if spec.name not in value:
            continue
        key, item = f"{prefix}{spec.name}", value[spec.name]
        field_type = hints.get(spec.name)
        if dataclasses.is_dataclass(field_type) and isinstance(item, dict):
            yield from _leaves(field_type, item, key + ".")
        else:
            owner = next(klass for klass in annotation.__mro__
                         if spec.name in getattr(klass, "__annotations__", {}))
            yield key, item, spec, owner


_COMMENTS_CACHE: dict[type, dict[str, str]] = {}


def _field_comments(cls: type) -> dict[str, str]:
    """{field: its comment} of a dataclass's own fields, from its source: the comment lines right above a
    field and the comment at the end of its line(s)."""
    if cls in _COMMENTS_CACHE:
        return _COMMENTS_CACHE[cls]
    comments: dict[str, str] = {}
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built in an interpreter)
        return comments
    by_line = {token.start[0]: token.string.lstrip("#").strip()
               for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    lines = source.splitlines()
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line[line])
            line -= 1
        trailing = [by_line[number] for number in range(node.lineno, node.end_lineno + 1)
                    if number in by_line and not lines[number - 1].strip().startswith("#")]
        comments[node.target.id] = " ".join(above + trailing)
    _COMMENTS_CACHE[cls] = comments
    return comments


def _yaml_comments(text: str) -> dict[str, str]:
    """{dotted key: comment} of a yaml file's `key: value  # comment` lines; a comment-only line indented past
    its key continues the key's comment."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []  # (indent, dotted key) of the keys enclosing the current line
    last: Optional[tuple[int, str]] = None
    for line in text.splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("#"):
            if last is not None and indent > last[0]:
                comments[last[1]] = f"{comments.get(last[1], '')} {stripped.lstrip('#').strip()}".strip()
            continue
        match = re.match(r"(\s*)([A-Za-z_][\w]*):(\s.*|)$", line)
        if not match:
            last = None if stripped else last
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([parent for _, parent in stack] + [match.group(2)])
        stack.append((indent, key))
        comment = re.search(r"\s#\s?(.*)$", match.group(3))
        if comment:
            comments[key] = comment.group(1).strip()
        last = (indent, key)
    return comments


def run_main(main) -> None:
    """Run an entry point; user errors (a `UserError`: config, data, checkpoint, output, launch, a missing
    extra; or a `ClientError`: a server that cannot be reached) end with one clear line, exit 2; a peer rank
    lost in a collective (`distributed.lost_peer`) with one line naming it, exit 3. Any other exception is a
    bug: it keeps its traceback (exit 1)."""
    stopping.install()
    try:
        main()
    except KeyboardInterrupt as stop:  # SIGINT/SIGTERM: one line, exit 128 + signal (aligner/runtime/stopping.py)
        stopping.exit_on_stop(stop)
    except (UserError, ClientError) as error:
        print(f"error: {error}", file=sys.stderr)
        distributed.exiting_on_error()
        raise SystemExit(2) from None
    except RuntimeError as error:  # a peer rank gone (a lost node): one line naming it, exit 3; else a bug
        line = distributed.lost_peer(error)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The exit handlers run (a server stops its Triton, run_lock releases the save_dir lock, so a requeue on
        # another host need not wait for it to fall silent), then the process ends without the interpreter's
        # teardown: gloo's threads, still waiting on the lost peer, aborted it (SIGABRT, "terminate called
        # without an active exception"; seen once in five runs).
        distributed.exiting_on_error()
        atexit._run_exitfuncs()
        os._exit(3)
