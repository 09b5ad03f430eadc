"""Reading JSONL data files with errors that point at the offending line.

Every record type (SFT, reward-model pairs, DPO, prompts) reads through
`read_jsonl` and checks its fields with the `require_*` helpers, so a bad
file always fails with `path:line: what is wrong; what was expected`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

from aligner.config import OutputError
from aligner.runtime.errors import DataError


def _where(path: str | Path, line: int) -> str:
    return f"{path}:{line}: "


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Records as one JSON object per line at `path` (its directory made); one line naming the file if it cannot."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as handle:
            for record in records:
                handle.write(json.dumps(record) + "\n")
    except OSError as error:
        raise OutputError(f"{path}: cannot write it ({error.strerror or error})") from None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, record) for each non-blank line of a JSONL file.

    Lines are decoded one by one, so bytes that are not UTF-8 are reported on their own line. A
    string that UTF-8 cannot encode (a lone surrogate: "\\ud800" is valid JSON) is refused here,
    naming its field, before a tokenizer fails on it far from the file.
    """
    for line_number, _, record in read_jsonl_offsets(path):
        yield line_number, record


def read_jsonl_offsets(path: str | Path) -> Iterator[tuple[int, int, dict]]:
    """`read_jsonl` with each record's byte offset in the file: (line number, offset, record)."""
    try:
        handle = open(path, "rb")
    except OSError as error:
        raise DataError(
            f"{path}: cannot open data file ({error.strerror}); "
            "expected a readable JSONL file with one JSON object per line"
        ) from error
    with handle:
        offset = 0
        for line_number, raw in enumerate(handle, start=1):
            start, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(
                    f"{_where(path, line_number)}not valid UTF-8 ({error.reason} at byte {error.start + 1} of the "
                    "line); expected UTF-8 encoded JSONL"
                ) from None
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
            if "\\u" in text:  # a lone surrogate can only come from an escape such as \ud800
                require_encodable(record, _where(path, line_number))
            yield line_number, start, record


def require_encodable(record: dict, where: str) -> None:
    """Refuse a JSON object holding a string UTF-8 cannot encode (a lone surrogate), naming its field.

    where: the message's prefix, e.g. "data.jsonl:3: ".
    """
    found = _unencodable(record, "")
    if found is not None:
        field, position = found
        raise DataError(f"{where}{field} holds text that cannot be encoded as UTF-8 (a lone surrogate such as "
                        f"\\ud800, at character {position + 1}); expected valid Unicode text")


def _unencodable(value: Any, field: str) -> Optional[tuple[str, int]]:
    """(which field, character index) of the first string UTF-8 cannot encode in a JSON value, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return field, error.start
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, int):
            name = f"{field}[{key}]"
        else:
            name = f"{field}.{key}" if field else key
            found = _unencodable(key, f"a key of {field!r}" if field else "a key")
            if found is not None:
                return found
        found = _unencodable(item, name if isinstance(item, (dict, list)) else f"field {name!r}")
        if found is not None:
            return found
    return None


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


