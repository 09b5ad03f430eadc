"""Reading JSONL data files with errors that point at the offending line.

Every record type (SFT, reward-model pairs, DPO, prompts) reads through
`read_jsonl` and checks its fields with the `require_*` helpers, so a bad
file always fails with `path:line: what is wrong; what was expected`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from aligner.runtime.errors import UserError


class DataError(UserError, ValueError):
    """A data file is missing, unreadable or holds a malformed record."""


def _where(path: str | Path, line: int) -> str:
    return f"{path}:{line}: "


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, record) for each non-blank line of a JSONL file.

    A file that cannot be opened is reported at line 0 (the file as a whole).
    """
    try:
        handle = open(path, encoding="utf-8")
    except OSError as error:
        raise DataError(
            f"{_where(path, 0)}cannot open data file ({error.strerror}); "
            "expected a readable JSONL file with one JSON object per line"
        ) from error
    line_number = 0
    with handle:
        try:
            for line_number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as error:
                    raise DataError(
                        f"{_where(path, line_number)}invalid JSON ({error.msg} at column {error.colno}); "
                        "expected one JSON object per line"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(
                        f"{_where(path, line_number)}found a JSON {type(record).__name__}; "
                        "expected a JSON object ({...}) per line"
                    )
                yield line_number, record
        except UnicodeDecodeError as error:
            raise DataError(
                f"{_where(path, line_number + 1)}file is not valid UTF-8 ({error.reason}); expected UTF-8 encoded JSONL"
            ) from None


def read_json(path: str | Path) -> Any:
    """The JSON value of a whole file (a config, a tokenizer file, checkpoint metadata).

    A file that is not valid JSON (e.g. cut short by a crash or a full disk) fails as
    `path:line: not valid JSON (...)`; one that cannot be opened as `path: cannot read it (...)`.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as error:
        raise DataError(f"{path}: cannot read it ({error.strerror or error})") from error
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not valid JSON (not UTF-8 text: {error.reason})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        message = error.msg.removesuffix(" at")  # "Unterminated string starting at" + the position
        raise DataError(f"{_where(path, error.lineno)}not valid JSON ({message} at column {error.colno})") from None


def require_key(record: dict, key: str, path: str | Path, line: int) -> Any:
    """record[key], whatever its type, or an error listing the keys present."""
    if key not in record:
        present = ", ".join(sorted(map(repr, record))) or "none"
        raise DataError(f"{_where(path, line)}missing key {key!r} (keys present: {present})")
    return record[key]


def require_str(record: dict, key: str, path: str | Path, line: int, allow_empty: bool = False) -> str:
    """Return record[key], checking that it is a string (non-blank unless allow_empty)."""
    value = require_key(record, key, path, line)
    if not isinstance(value, str):
        raise DataError(
            f"{_where(path, line)}key {key!r} is a {type(value).__name__}; expected a string"
        )
    if not allow_empty and not value.strip():
        raise DataError(f"{_where(path, line)}key {key!r} is empty; expected non-empty text")
    return value


def optional_str(record: dict, key: str, path: str | Path, line: int, default: str = "") -> str:
    """Return record[key] if present (a string, may be empty), else `default`."""
    if record.get(key) is None:
        return default
    return require_str(record, key, path, line, allow_empty=True)


