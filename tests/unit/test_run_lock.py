"""One run per save_dir (aligner/runtime/run_lock.py, checkpointing.start_run): a live holder refuses a second
run in one line, a killed one (also with a forked child still alive) or a stale record blocks nothing, a record
of another host is refused, and checkpoint.lock_wait_s waits for the holder to end."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aligner import checkpointing
from aligner.runtime import run_lock, stopping

from ..conftest import REPO_ROOT

# A process that locks the directory argv[1] as a run's start does, names run "run-held", says so, and sleeps
# (argv[2] seconds, then exits normally); with argv[3] == "fork" it first forks a child that sleeps on.
_HOLDER = textwrap.dedent("""
    import os, sys, time
    from aligner.runtime import run_lock, stopping
    run_lock.acquire(sys.argv[1])
    run_lock.record_run_id(sys.argv[1], "run-held")
    if sys.argv[3] == "fork" and os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _start_holder(directory: Path, hold_s: float = 60.0, fork: bool = False) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory), str(hold_s), "fork" if fork else "-"],
                              stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def _kill_9(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=30)


def _dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


@pytest.fixture(autouse=True)
def _released(tmp_path):
    yield
    run_lock.release(tmp_path)


def test_a_live_holder_refuses_a_second_run_in_one_line_naming_it_and_a_kill_9_frees_the_directory(tmp_path):
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(checkpointing.CheckpointError) as raised:
            checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=print)
        record = run_lock.read_holder(tmp_path)
        assert (record.host, record.pid, record.run_id) == (socket.gethostname(), holder.pid, "run-held")
        assert str(raised.value) == (
            f"checkpoint.save_dir={tmp_path} is in use by run run-held (pid {holder.pid} on {socket.gethostname()}, "
            f"since {record.since}): one run per save_dir; wait for that run to end (or stop it), set "
            "checkpoint.lock_wait_s to wait for it, or choose another checkpoint.save_dir")
    finally:
        _kill_9(holder)
    lines = []
    run = checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=lines.append)
    assert lines == [f"took over {tmp_path / run_lock.LOCK_FILE} from run run-held (pid {holder.pid} on "
                     f"{socket.gethostname()}, since {record.since}), which ended without releasing it"]
    mine = run_lock.read_holder(tmp_path)
    assert (mine.pid, mine.run_id) == (os.getpid(), run.run_id)
    run_lock.release(tmp_path)
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == ""  # a clean end leaves no record


def test_a_forked_child_does_not_keep_the_lock_of_a_killed_parent(tmp_path):
    holder = _start_holder(tmp_path, fork=True)
    children = subprocess.run(["pgrep", "-P", str(holder.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 1
    _kill_9(holder)  # the child is not killed with it (no parent-death signal here)
    try:
        os.kill(int(children[0]), 0)  # still alive
        assert run_lock.acquire(tmp_path).pid == holder.pid
    finally:
        os.kill(int(children[0]), signal.SIGKILL)


def test_a_stale_record_of_a_dead_pid_is_taken_over(tmp_path):
    dead = _dead_pid()
    stale = {"host": socket.gethostname(), "pid": dead, "since": "2026-01-01T00:00:00Z", "run_id": "old"}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(stale))
    taken_over = run_lock.acquire(tmp_path)
    assert (taken_over.pid, taken_over.run_id) == (dead, "old")
    assert run_lock.read_holder(tmp_path).pid == os.getpid()


def test_a_record_of_another_host_is_refused_saying_it_cannot_be_checked(tmp_path):
    other = {"host": "node-17", "pid": 4242, "since": "2026-01-01T00:00:00Z", "run_id": "elsewhere"}
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps(other))
    with pytest.raises(checkpointing.CheckpointError) as raised:
        checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=print)
    lock_file = tmp_path / run_lock.LOCK_FILE
    assert str(raised.value) == (
        f"checkpoint.save_dir={tmp_path} may be in use by run elsewhere (pid 4242 on node-17, since "
        f"2026-01-01T00:00:00Z): its lock file {lock_file} names a run on another host, which cannot be checked "
        f"from here; if that run has ended, delete {lock_file} and start again, else choose another "
        "checkpoint.save_dir")
    assert json.loads(lock_file.read_text()) == other  # left as it was


def test_lock_wait_s_waits_for_the_holder_to_end_then_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "_LOCK_POLL_S", 0.1)
    holder = _start_holder(tmp_path, hold_s=1.0)
    lines = []
    started = time.monotonic()
    try:
        run = checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=lines.append, lock_wait_s=60)
    finally:
        holder.wait(timeout=30)
    assert time.monotonic() - started < 30
    assert lines[0].startswith(f"checkpoint.save_dir={tmp_path} is in use by run run-held (pid {holder.pid} on ")
    assert lines[0].endswith(": waiting up to checkpoint.lock_wait_s=60 s for it to end")
    assert len(lines) == 1  # the holder ended cleanly: nothing to take over
    assert run_lock.read_holder(tmp_path).run_id == run.run_id


def test_lock_wait_s_refuses_when_the_holder_outlives_it(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing, "_LOCK_POLL_S", 0.1)
    holder = _start_holder(tmp_path)
    try:
        with pytest.raises(checkpointing.CheckpointError, match=r"is in use by run run-held .* \(still after "
                                                                r"checkpoint.lock_wait_s=0.3 s\): one run per"):
            checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=print, lock_wait_s=0.3)
    finally:
        _kill_9(holder)


def test_a_stop_that_exits_at_once_still_empties_the_record(tmp_path, monkeypatch):
    """checkpoint.stop_grace_s passed: the process ends by os._exit (no atexit), and releases the lock first."""
    run_lock.acquire(tmp_path)
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stopping._grace_expired(signal.SIGTERM)
    assert exits == [128 + signal.SIGTERM]
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == ""
