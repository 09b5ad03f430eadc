"""Data files of any format, read lazily: JSONL, Parquet, Arrow, or a `datasets` directory.

    records = open_records("train.parquet")   # also .jsonl, .arrow, a Dataset.save_to_disk directory
    len(records); records[i]                  # one record (a dict), read when asked for
    records.where(i)                          # its position: the line (JSONL) or Row (prints "row 5")
    for line, record in records: ...         # every record in order, with its position (read_jsonl's pairs)

Parquet, Arrow and `datasets` directories go through the `datasets` library, memory-mapped (Parquet is
converted once into datasets' Arrow cache), so a large data set never sits in Python lists. JSONL is
read by `aligner.data.jsonl.read_jsonl` (its errors name the line); only the byte offset of each line is
kept, and a record is decoded again when indexed.

A record is a dict of its columns; in Arrow layouts a null column value is left out of the dict, as a
JSONL line that does not have the key. A position is the 1-based line of a JSONL record, or the `Row`
of an Arrow record (an int that formats as "row N"), so every reader's `f"{path}:{line}: ..."` message
says "train.jsonl:5: ..." or "train.parquet:row 5: ...".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from aligner.data.jsonl import DataError, read_jsonl, read_jsonl_offsets

if TYPE_CHECKING:
    import datasets

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")  # .json: one object per line, as read_jsonl checks
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow", ".feather")
FORMATS_HELP = ("a JSONL file (.jsonl), a Parquet file (.parquet), an Arrow file (.arrow) or a directory written "
                "by datasets' Dataset.save_to_disk")
SCAN_BATCH_ROWS = 1024  # rows decoded at once when a whole Arrow data set is read in order


class Row(int):
    """A record's 1-based row in an Arrow layout; formats as "row 5", so a reader's `f"{path}:{line}: ..."`
    message says "train.parquet:row 5: ..." (a JSONL record's position stays its line number)."""

    def __format__(self, spec: str) -> str:
        return f"row {int(self)}" if not spec else int(self).__format__(spec)

    def __str__(self) -> str:
        return self.__format__("")


def data_format(path: str | Path) -> str:
    """"jsonl", "parquet", "arrow" or "datasets" (a save_to_disk directory), from the path; an error otherwise.

    A missing JSONL file is left to read_jsonl, whose message says why it cannot be opened."""
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = ", ".join(json.loads((path / "dataset_dict.json").read_text()).get("splits", []))
            raise DataError(f"{path}: a datasets DatasetDict (splits: {splits}); give one split's directory, "
                            f"e.g. {path / 'train'}")
        if (path / "state.json").is_file():
            return "datasets"
        raise DataError(f"{path}: a directory that is not a datasets save_to_disk directory (no state.json); "
                        f"expected {FORMATS_HELP}")
    suffix = path.suffix.lower()
    kind = next((name for name, suffixes in (("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES),
                                             ("arrow", ARROW_SUFFIXES)) if suffix in suffixes), None)
    if kind == "jsonl":
        return kind
    if not path.exists():
        raise DataError(f"{path}: no such file; expected {FORMATS_HELP}")
    return kind or _sniffed_format(path)


# The first bytes of a Parquet file, an Arrow IPC file and an Arrow IPC stream (a continuation marker).
MAGIC_BYTES = ((b"PAR1", "parquet"), (b"ARROW1", "arrow"), (b"\xff\xff\xff\xff", "arrow"))


def _sniffed_format(path: Path) -> str:
    """The format of a file whose suffix names none: Parquet and Arrow by their first bytes, anything else
    JSONL (a .txt of JSON lines; a CSV then fails on its first line, named). A FIFO or device is not read
    ahead: JSONL."""
    if not path.is_file():
        return "jsonl"
    with open(path, "rb") as handle:
        head = handle.read(8)
    return next((kind for magic, kind in MAGIC_BYTES if head.startswith(magic)), "jsonl")


class Records(Sequence):
    """The records of one data file, indexed lazily (see the module docstring)."""

    path: str

    def where(self, index: int) -> int | Row:
        """Record `index`'s 1-based line (JSONL) or `Row`, for messages: f"{path}:{where}: ..."."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[int | Row, dict]]:
        for index in range(len(self)):
            yield self.where(index), self[index]


class JsonlRecords(Records):
    """A JSONL file: checked once, line by line (read_jsonl's errors); then each record re-read from its offset."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        lines, offsets = [], []
        for line, offset, _ in read_jsonl_offsets(path):
            lines.append(line)
            offsets.append(offset)
        self.lines = np.asarray(lines, dtype=np.int64)
        self.offsets = np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, index: int) -> int:
        return int(self.lines[index])

    def __getitem__(self, index: int) -> dict:
        with open(self.path, "rb") as handle:
            handle.seek(int(self.offsets[index]))
            return json.loads(handle.readline().decode("utf-8"))

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        yield from read_jsonl(self.path)


class ArrowRecords(Records):
    """A `datasets.Dataset` (memory-mapped Arrow) of a Parquet or Arrow file or a save_to_disk directory."""

    def __init__(self, path: str | Path, dataset: datasets.Dataset):
        self.path, self.dataset = str(path), dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def where(self, index: int) -> int | Row:
        return Row(index + 1)

    def __getitem__(self, index: int) -> dict:
        return _present(self.dataset[int(index)])

    def __iter__(self) -> Iterator[tuple[int | Row, dict]]:
        for start in range(0, len(self.dataset), SCAN_BATCH_ROWS):
            columns = self.dataset[start:start + SCAN_BATCH_ROWS]
            names = list(columns)
            for offset, values in enumerate(zip(*(columns[name] for name in names))):
                yield Row(start + offset + 1), _present(dict(zip(names, values)))


def _present(record: dict) -> dict:
    """A row without its null columns: as a JSONL record that does not have those keys."""
    return {key: value for key, value in record.items() if value is not None}


def _datasets():
    """The `datasets` library, imported at the first Parquet, Arrow or directory read: with pandas it adds ~1 s
    to the start of every process, and JSONL, what most runs read, does not need it."""
    import datasets

    return datasets


def open_records(path: str | Path) -> Records:
    """The records of a data file or directory (any format of `data_format`); errors name the file."""
    kind = data_format(path)
    if kind == "jsonl":
        return JsonlRecords(path)
    datasets = _datasets()
    try:
        if kind == "parquet":
            dataset = datasets.Dataset.from_parquet(str(path))
            pa.default_memory_pool().release_unused()  # the conversion's buffers: 50 MB kept per 1M rows otherwise
        elif kind == "datasets":
            dataset = datasets.load_from_disk(str(path))
        else:
            dataset = _arrow_file(path)
    except (OSError, ValueError, pa.ArrowException, datasets.exceptions.DatasetsError) as error:
        raise DataError(f"{path}: cannot read it as {kind} data ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}); expected {FORMATS_HELP}") from None
    return ArrowRecords(path, dataset)


def _arrow_file(path: str | Path) -> datasets.Dataset:
    """An Arrow IPC stream (what datasets writes) or IPC file (Feather v2), memory-mapped either way."""
    datasets = _datasets()
    try:
        return datasets.Dataset.from_file(str(path))
    except pa.ArrowInvalid:
        return datasets.Dataset(pa.ipc.open_file(pa.memory_map(str(path))).read_all())


def read_records(path: str | Path) -> Iterator[tuple[int | Row, dict]]:
    """(position, record) of every record of a data file in order: `read_jsonl` for any format."""
    if data_format(path) == "jsonl":
        yield from read_jsonl(path)  # one pass, without the offsets open_records keeps for indexing
    else:
        yield from open_records(path)


# ----------------------------------------------------------------------------- checks before the model is built
@dataclass(frozen=True)
class Layouts:
    """The column sets a reader accepts: a record has all columns of at least one of `choices`."""

    what: str  # "SFT", "preference pairs", ...
    choices: tuple[tuple[str, ...], ...]

    def with_columns(self, *columns: str) -> "Layouts":
        """The same layouts, each also needing `columns` (e.g. SteerLM's annotated "attributes")."""
        return Layouts(self.what, tuple(choice + columns for choice in self.choices))

    def describe(self) -> str:
        return " or ".join("/".join(repr(column) for column in choice) for choice in self.choices)

    def missing(self, columns: Sequence[str]) -> bool:
        return not any(all(column in columns for column in choice) for choice in self.choices)


def first_columns(path: str | Path) -> tuple[str, ...]:
    """The columns of a data file's first record (JSONL) or schema (Arrow layouts), read cheaply; errors name
    the file (and the line of a bad first JSONL record)."""
    kind = data_format(path)
    if kind == "jsonl":
        first = next(iter(read_jsonl(path)), None)
        if first is None:
            raise DataError(f"{path}: the file holds no records")
        return tuple(first[1])
    datasets = _datasets()
    try:
        if kind == "parquet":
            schema = pq.read_schema(str(path))
        elif kind == "datasets":
            return tuple(datasets.load_from_disk(str(path)).column_names)
        else:
            schema = _arrow_file(path).data.schema
    except (OSError, ValueError, pa.ArrowException, datasets.exceptions.DatasetsError) as error:
        raise DataError(f"{path}: cannot read it as {kind} data ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''}); expected {FORMATS_HELP}") from None
    return tuple(schema.names)


def check_data_source(key: str, path: Optional[str], layouts: Optional[Layouts]) -> None:
    """Refuse a data setting whose file is missing, unreadable, of an unknown format or without the columns
    its reader needs (in its first record or schema), in one line naming the setting and the file."""
    if path is None:
        return
    try:
        columns = first_columns(path)
    except DataError as error:
        raise DataError(f"{key}: {error}") from None
    if layouts is not None and layouts.missing(columns):
        raise DataError(f"{key}: {path}: no {layouts.describe()} columns for {layouts.what} data "
                        f"(columns: {', '.join(map(repr, columns)) or 'none'})")
