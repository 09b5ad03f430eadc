"""One run per directory: an exclusive lock on `<directory>/.aligner.lock`, held until the process ends.

The lock is an OS file lock (`flock`) on that file, so the kernel drops it when the holder exits in any
way, kill -9 included: a dead run never blocks the next. The file also holds a record of the holder
(host, pid, start time, run id), which a refused run names. Some shared file systems keep flock per
host (NFS mounted with `local_lock=flock` or `nolock`), so a run on another host gets the lock anyway;
the record is the check left there: a record of this host whose flock could be taken (or whose process
is gone) is stale and taken over. Another host's pid cannot be checked from here, so a holder's daemon
thread touches the file every quarter of `stale_after_s()`: a record of another host whose file has gone
untouched that long (by the file system's clock, so clock skew between hosts does not matter) is a dead
run's (kill -9, node failure) and is taken over; a fresher one is refused. A clean exit empties the
record, so only a run that died leaves one.

How long that is depends on the shared file system, not on the run, so it is a setting of the site:
`ALIGNER_LOCK_STALE_S` in the environment (default 120 s: NFS clients cache a file's attributes, mtime
included, for up to 60 s). Every run on one save_dir must see the same value (a requeue inherits it).

flock belongs to the open file, which a fork shares: a forked child (megatron's checkpoint writers)
would keep the lock after a kill -9 of the run. Each forked child closes its copies at once
(`os.register_at_fork`); closing a shared copy leaves the parent's lock in place.

Written on fcntl rather than `filelock`: its flock lock records no holder (it keeps a pid only in its
soft-lock fallback), and a refused run here must name the holder's host, pid, start and run id, read from
the locked file itself, and forked children must drop their copies.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aligner.runtime.errors import UserError

LOCK_FILE = ".aligner.lock"
# flock errors of a file system that does not lock (the record is then the only check)
_NO_FLOCK_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)

# A record of another host is a dead run's once its file has gone untouched this long; its holder touches it four
# times as often. Several heartbeats, not one: a loaded file server or a stalled process can delay a touch, and NFS
# clients cache a file's attributes (mtime included) for up to 60 s by default (acregmax), so a reader may see a
# touch that late. A file system that shows another host's mtime at once (Lustre, GPFS, one machine) can do with
# less: the site sets STALE_VARIABLE.
STALE_AFTER_S = 120.0
STALE_VARIABLE = "ALIGNER_LOCK_STALE_S"
MIN_STALE_AFTER_S = 4.0

_logger = logging.getLogger(__name__)


@dataclass
class _Lock:
    """A lock this process holds: its file's descriptor and the heartbeat that touches it."""

    descriptor: int
    stop: threading.Event
    heartbeat: threading.Thread


_held: dict[str, _Lock] = {}  # resolved directory -> its lock, in this process


@dataclass
class Holder:
    """A lock file's record of the process that holds (or held) it."""

    host: str
    pid: int
    since: str  # UTC, ISO 8601
    run_id: Optional[str] = None
    # Not part of the record: for another host's, seconds since its heartbeat last touched the lock file.
    silent_s: Optional[float] = None

    def __str__(self) -> str:
        run = f"run {self.run_id}" if self.run_id else "a run starting up"
        return f"{run} (pid {self.pid} on {self.host}, since {self.since})"

    @property
    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive_here(self) -> bool:
        """Whether the holder's pid runs on this host (only meaningful when `on_this_host`)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return True


class LockHeld(UserError):
    """Another run holds the directory (`holder`: its record, None if unreadable or not written yet; one of
    another host has `silent_s`)."""

    def __init__(self, directory: Path, holder: Optional[Holder]):
        self.directory, self.holder = directory, holder
        self.lock_file = directory / LOCK_FILE
        super().__init__(f"{directory} is in use by {holder or 'another process'} ({self.lock_file})")


def lock_file(directory: str | os.PathLike) -> Path:
    return Path(directory) / LOCK_FILE


def read_holder(directory: str | os.PathLike) -> Optional[Holder]:
    """The record in a directory's lock file; None if there is none (or it is half-written or foreign)."""
    try:
        record = json.loads(lock_file(directory).read_text())
        return Holder(str(record["host"]), int(record["pid"]), str(record["since"]), record.get("run_id"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stale_after_s() -> float:
    """Seconds of silence after which another host's lock counts as a dead run's: STALE_VARIABLE, else
    STALE_AFTER_S."""
    text = os.environ.get(STALE_VARIABLE)
    if text is None:
        return STALE_AFTER_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= MIN_STALE_AFTER_S or value == float("inf"):  # (nan fails the comparison)
        raise UserError(f"{STALE_VARIABLE}={text!r} in the environment: give the seconds after which a silent "
                        f"lock of another host counts as a dead run's, at least {MIN_STALE_AFTER_S:g} "
                        f"(default {STALE_AFTER_S:g})")
    return value


def acquire(directory: str | os.PathLike, heartbeat_s: Optional[float] = None) -> Optional[Holder]:
    """Lock `directory` (which must exist) for this process, or raise LockHeld.

    Returns the record of a dead holder that was taken over (None otherwise). Idempotent within a process.
    `heartbeat_s`: how often the lock file is touched while held (default: a quarter of `stale_after_s()`;
    other values only in tests).
    """
    directory = Path(directory)
    key = str(directory.resolve())
    if key in _held:
        return None
    stale_s = stale_after_s()
    heartbeat_s = stale_s / 4 if heartbeat_s is None else heartbeat_s
    descriptor = os.open(lock_file(directory), os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: a holder's record
    try:
        flock_held = _flock(descriptor)
        previous = read_holder(directory)
        if flock_held is False:
            raise LockHeld(directory, previous)
        if previous is not None and previous.pid != os.getpid():
            # flock is exact between processes of one host: a record of this host is a dead run's
            # (or, where there is no flock, one whose pid is gone). Another host's lives by its heartbeat.
            if not previous.on_this_host:
                previous.silent_s = max(_file_system_now(directory) - os.fstat(descriptor).st_mtime, 0.0)
                if previous.silent_s < stale_s:
                    raise LockHeld(directory, previous)
            elif flock_held is None and previous.alive_here():
                raise LockHeld(directory, previous)
        else:
            previous = None
    except BaseException:
        os.close(descriptor)
        raise
    _write(descriptor, Holder(socket.gethostname(), os.getpid(),
                              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
    stop = threading.Event()
    heartbeat = threading.Thread(target=_beat, args=(descriptor, lock_file(directory), heartbeat_s, stale_s, stop),
                                 name="aligner-lock-heartbeat", daemon=True)  # never keeps the process alive
    _held[key] = _Lock(descriptor, stop, heartbeat)
    heartbeat.start()
    return previous


def record_run_id(directory: str | os.PathLike, run_id: str) -> None:
    """Name the run in the record of a lock this process holds (known only once its checkpoint is chosen)."""
    descriptor = _held[str(Path(directory).resolve())].descriptor
    holder = read_holder(directory)
    _write(descriptor, Holder(socket.gethostname(), os.getpid(), holder.since if holder else "?", run_id))


def release(directory: str | os.PathLike) -> None:
    """Empty the record and drop the lock (nothing if this process does not hold it)."""
    lock = _held.pop(str(Path(directory).resolve()), None)
    if lock is None:
        return
    lock.stop.set()
    lock.heartbeat.join()  # before the descriptor is closed: its number could be reused for another file
    descriptor = lock.descriptor
    with contextlib.suppress(OSError):  # else the record looks stale to the next run on this host: taken over
        os.ftruncate(descriptor, 0)
    with contextlib.suppress(OSError):  # (a file system without flock)
        fcntl.flock(descriptor, fcntl.LOCK_UN)
    os.close(descriptor)


def release_all() -> None:
    for directory in list(_held):
        release(directory)


def _flock(descriptor: int) -> Optional[bool]:
    """True: locked; False: another process holds it; None: this file system does not lock."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in _NO_FLOCK_ERRNOS:
            return None
        raise
    return True


def _beat(descriptor: int, path: Path, interval_s: float, stale_s: float, stop: threading.Event) -> None:
    """Touch the lock file every `interval_s` until `stop`. The file server stamps the time, which is what
    another host compares with its own probe (`_file_system_now`)."""
    failed = False
    while not stop.wait(interval_s):
        try:
            os.utime(descriptor)
        except OSError as error:
            if not failed:  # the run goes on; say it once, not every heartbeat
                _logger.warning(f"cannot touch {path} ({error}): while this lasts, a run on another host takes "
                                f"this directory over once the file is {stale_s:g} s old")
            failed = True


def _file_system_now(directory: Path) -> float:
    """Now by the file system's clock: the mtime of a file created in `directory`. Another host's heartbeat
    was stamped by the same file server, so clock skew between the hosts does not enter the comparison."""
    descriptor, probe = tempfile.mkstemp(prefix=f"{LOCK_FILE}.probe-", dir=directory)
    try:
        return os.fstat(descriptor).st_mtime
    finally:
        os.close(descriptor)
        os.unlink(probe)


def _write(descriptor: int, holder: Holder) -> None:
    text = json.dumps({"host": holder.host, "pid": holder.pid, "since": holder.since, "run_id": holder.run_id})
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, (text + "\n").encode(), 0)


def _close_in_forked_child() -> None:
    """A forked child drops its copies of the locks (the parent keeps them) and never empties a record."""
    for lock in _held.values():  # (the heartbeat threads are not forked)
        with contextlib.suppress(OSError):
            os.close(lock.descriptor)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_forked_child)
atexit.register(release_all)
