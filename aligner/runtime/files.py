"""Reading a whole JSON file (a config, a tokenizer file, checkpoint metadata) with errors that name the file and line.

In the bottom layer so that the foundation (checkpointing, the tokenizer) and the data readers share it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aligner.runtime.errors import DataError


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
        raise DataError(f"{path}:{error.lineno}: not valid JSON ({message} at column {error.colno})") from None
