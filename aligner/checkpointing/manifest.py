"""The manifest: the size and sha256 of every file of a checkpoint, written last by a save and checked
first by a load (`verify`); `fingerprint` names a checkpoint's contents."""
from __future__ import annotations

import hashlib
import heapq
import json
import os
from pathlib import Path
from typing import Optional, Sequence

from aligner.checkpointing.base import MANIFEST_FILE, CheckpointError, _all_gather, _broadcast, _rank, _world

CHECKSUM = "sha256"  # ~2 GB/s per core with SHA extensions, split over ranks; `sha256sum` checks a file by hand

# Checkpoints whose files this process has checked against their manifest (all ranks agree on it).
_verified: set[str] = set()


def _sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, CHECKSUM).hexdigest()


def fingerprint(checkpoint_dir: str | os.PathLike) -> Optional[str]:
    """An id of a checkpoint's contents that survives moving it: the digest of its manifest (which lists
    every file's checksum); None for a checkpoint without a manifest."""
    path = Path(checkpoint_dir) / MANIFEST_FILE
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.is_file() else None


def _owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank that reads each file: largest first to the least-loaded rank (about total/world bytes each)."""
    loads = [(0, rank) for rank in range(world)]  # a heap of (bytes so far, rank)
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, rank = heapq.heappop(loads)
        owner[index] = rank
        heapq.heappush(loads, (load + sizes[index], rank))
    return owner


def _listed_files(directory: Path) -> list[tuple[str, int]]:
    """(path relative to directory, size) of every file under it but the manifest, sorted."""
    files = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory).as_posix()
        if path.is_file() and relative != MANIFEST_FILE:
            files.append((relative, path.stat().st_size))
    return sorted(files)


def build_manifest(directory: str | os.PathLike) -> dict:
    """{"checksum": "sha256", "files": {relative path: {"size", "sha256"}}} of every file in directory.

    Collective when distributed: rank 0 lists the files, each rank hashes its share (split by size,
    so a checkpoint is read once in total), every rank returns the whole manifest.
    """
    root = Path(directory)
    files = _broadcast(_listed_files(root) if _rank() == 0 else None)
    owners = _owners([size for _, size in files], _world())
    mine: dict[str, str] = {}
    failure = None
    for (name, _), owner in zip(files, owners):
        if owner == _rank() and failure is None:
            try:
                mine[name] = _sha256(root / name)
            except OSError as error:  # reported on every rank below, so none waits in the gather
                failure = f"cannot read {root / name} to checksum it: {error}"
    shares = _all_gather((mine, failure))
    failures = [failed for _, failed in shares if failed is not None]
    if failures:
        raise OSError(failures[0])
    digests = {name: digest for share, _ in shares for name, digest in share.items()}
    return {"checksum": CHECKSUM, "files": {name: {"size": size, CHECKSUM: digests[name]} for name, size in files}}


def _file_problem(root: Path, name: str, expected: dict) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{name} is missing"
    try:
        size = path.stat().st_size
        if size < expected["size"]:
            return f"{name} is truncated to {size} of {expected['size']} bytes"
        if size > expected["size"]:
            return f"{name} has {size} bytes, {expected['size']} expected"
        if _sha256(path) != expected[CHECKSUM]:
            return f"{name} fails its {CHECKSUM} check (its bytes changed after the save)"
    except OSError as error:
        return f"{name} cannot be read ({error})"
    return None


def verify(checkpoint_dir: str | os.PathLike) -> Optional[str]:
    """None if every file of the checkpoint matches its manifest, else one line naming the damage.

    A checkpoint without a manifest (written before manifests existed) is not checked. Collective
    when distributed: each rank checks a share of the files (each file read once), all get the verdict.
    """
    root = Path(checkpoint_dir)

    def read_manifest():
        """The manifest's files, None without a manifest, or why it cannot be used."""
        path = root / MANIFEST_FILE
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text())
            files = sorted(manifest["files"].items())
            if manifest["checksum"] != CHECKSUM or not all(
                    isinstance(entry["size"], int) and isinstance(entry[CHECKSUM], str) for _, entry in files):
                raise ValueError(f"not a {CHECKSUM} manifest")
            return files
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"its {MANIFEST_FILE} is unreadable ({type(error).__name__}: {error})"

    files = _broadcast(read_manifest() if _rank() == 0 else None)
    if files is None:
        return None
    if isinstance(files, str):
        return f"{root} is damaged: {files}"
    owners = _owners([entry["size"] for _, entry in files], _world())
    mine = [(index, problem) for index, ((name, entry), owner) in enumerate(zip(files, owners))
            if owner == _rank() and (problem := _file_problem(root, name, entry)) is not None]
    problems = [problem for _, problem in sorted(found for share in _all_gather(mine) for found in share)]
    if not problems:
        return None
    others = len(problems) - 1
    more = f" (and {others} more damaged file{'s' if others > 1 else ''})" if others else ""
    return f"{root} is damaged: {problems[0]}{more}"


def _verify_once(checkpoint_dir: str | os.PathLike) -> None:
    key = str(Path(checkpoint_dir).resolve())
    if key in _verified:
        return
    problem = verify(checkpoint_dir)
    if problem is not None:
        raise CheckpointError(problem)
    _verified.add(key)
