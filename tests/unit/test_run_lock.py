"""One run per save_dir (aligner/runtime/run_lock.py, checkpointing.start_run): a live holder refuses a second
run in one line, a killed one (also with a forked child still alive) or a stale record blocks nothing, a record
of another host is refused while its heartbeat is fresh and taken over once it is silent, and
checkpoint.lock_wait_s waits for the holder to end."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
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


_OTHER_HOST = {"host": "node-17", "pid": 4242, "since": "2026-01-01T00:00:00Z", "run_id": "elsewhere"}
_OTHER_HOLDER = "run elsewhere (pid 4242 on node-17, since 2026-01-01T00:00:00Z)"


def _record_of_another_host(directory: Path, heartbeat_age_s: float) -> Path:
    """A lock file as a run on node-17 leaves it, last touched by its heartbeat `heartbeat_age_s` ago."""
    lock_file = directory / run_lock.LOCK_FILE
    lock_file.write_text(json.dumps(_OTHER_HOST))
    touched = time.time() - heartbeat_age_s
    os.utime(lock_file, (touched, touched))
    return lock_file


def _heartbeats() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "aligner-lock-heartbeat"]


def test_a_record_of_another_host_with_a_fresh_heartbeat_is_refused_naming_it(tmp_path):
    lock_file = _record_of_another_host(tmp_path, heartbeat_age_s=30)
    with pytest.raises(checkpointing.CheckpointError) as raised:
        checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=print)
    message = re.fullmatch(
        re.escape(f"checkpoint.save_dir={tmp_path} is in use by {_OTHER_HOLDER}, whose heartbeat in {lock_file} was "
                  "last seen ") + r"(\d+)" + re.escape(
            " s ago (a run on another host counts as ended after 120 s without one): one run per save_dir; wait for "
            "that run to end (or stop it), set checkpoint.lock_wait_s to wait for it, or choose another "
            "checkpoint.save_dir"), str(raised.value))
    assert message and 30 <= int(message[1]) < 60
    assert json.loads(lock_file.read_text()) == _OTHER_HOST  # left as it was
    assert [path.name for path in tmp_path.iterdir()] == [run_lock.LOCK_FILE]  # no clock probe left behind


def test_a_record_of_another_host_whose_heartbeat_is_silent_is_taken_over_naming_it(tmp_path):
    lock_file = _record_of_another_host(tmp_path, heartbeat_age_s=run_lock.stale_after_s() + 80)
    lines = []
    run = checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=lines.append)
    [line] = lines
    taken_over = re.fullmatch(
        re.escape(f"took over {lock_file} from {_OTHER_HOLDER}, whose heartbeat has been silent for ") + r"(\d+)"
        + re.escape(" s (a run on another host counts as ended after 120 s)"), line)
    assert taken_over and 200 <= int(taken_over[1]) < 230
    mine = run_lock.read_holder(tmp_path)
    assert (mine.host, mine.pid, mine.run_id) == (socket.gethostname(), os.getpid(), run.run_id)


def test_the_site_s_stale_setting_shortens_the_silence_that_counts_as_a_dead_run(tmp_path, monkeypatch):
    """ALIGNER_LOCK_STALE_S: a record of another host silent for 25 s is refused by default and taken over at 20;
    the holder then beats every 5 s."""
    lock_file = _record_of_another_host(tmp_path, heartbeat_age_s=25)
    with pytest.raises(checkpointing.CheckpointError, match=r"counts as ended after 120 s without one"):
        checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=print)
    monkeypatch.setenv(run_lock.STALE_VARIABLE, "20")
    beats = []
    monkeypatch.setattr(run_lock, "_beat", lambda *args: beats.append(args[2:4]))
    lines = []
    checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=lines.append)
    assert re.fullmatch(re.escape(f"took over {lock_file} from {_OTHER_HOLDER}, whose heartbeat has been silent for ")
                        + r"2\d s \(a run on another host counts as ended after 20 s\)", lines[0]), lines
    assert beats == [(5.0, 20.0)]


@pytest.mark.parametrize("value", ["soon", "2", "-1", "nan", "inf"])
def test_a_bad_stale_setting_is_one_line_naming_the_variable(tmp_path, monkeypatch, value):
    monkeypatch.setenv(run_lock.STALE_VARIABLE, value)
    with pytest.raises(run_lock.UserError) as raised:
        run_lock.acquire(tmp_path)
    assert str(raised.value) == (f"ALIGNER_LOCK_STALE_S={value!r} in the environment: give the seconds after which a "
                                 "silent lock of another host counts as a dead run's, at least 4 (default 120)")
    assert not (tmp_path / run_lock.LOCK_FILE).exists()


def test_the_holder_s_heartbeat_keeps_touching_the_lock_file_until_release(tmp_path):
    lock_file = tmp_path / run_lock.LOCK_FILE
    others = set(_heartbeats())  # locks that tests before this one built in this process still hold
    run_lock.acquire(tmp_path, heartbeat_s=0.05)
    ours = [thread for thread in _heartbeats() if thread not in others]
    assert len(ours) == 1
    for _ in range(3):  # set back, and touched again by the next heartbeat
        os.utime(lock_file, (1_000_000_000, 1_000_000_000))
        deadline = time.monotonic() + 10
        while lock_file.stat().st_mtime < time.time() - 60 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock_file.stat().st_mtime >= time.time() - 60
    run_lock.release(tmp_path)
    assert not ours[0].is_alive()  # stopped (and joined) by release
    os.utime(lock_file, (1_000_000_000, 1_000_000_000))
    time.sleep(0.2)
    assert lock_file.stat().st_mtime == 1_000_000_000  # nothing touches a released lock


def test_a_heartbeat_that_cannot_touch_the_file_says_so_once_and_the_run_goes_on(tmp_path, monkeypatch):
    warnings, failures = [], []

    def read_only(*args, **kwargs):
        failures.append(args)
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(run_lock, "_logger", type("Log", (), {"warning": staticmethod(warnings.append)}))
    others = set(_heartbeats())  # locks that tests before this one built in this process still hold
    run_lock.acquire(tmp_path, heartbeat_s=0.02)
    ours = [thread for thread in _heartbeats() if thread not in others]
    monkeypatch.setattr(os, "utime", read_only)
    deadline = time.monotonic() + 10
    while len(failures) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(failures) >= 3 and len(ours) == 1 and ours[0].is_alive()  # still beating
    # Locks that earlier tests' runs still hold beat too and meet the same utime: only this lock's lines count.
    lock_file = tmp_path / run_lock.LOCK_FILE
    ours_warned = [line for line in warnings if line.startswith(f"cannot touch {lock_file} ")]
    assert ours_warned == [f"cannot touch {lock_file} ([Errno 30] Read-only file system): while this lasts, a run "
                           "on another host takes this directory over once the file is 120 s old"]


def test_lock_wait_s_waits_for_the_holder_to_end_then_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing.runs, "_LOCK_POLL_S", 0.1)
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


def test_lock_wait_s_takes_over_a_record_of_another_host_once_its_heartbeat_goes_silent(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing.runs, "_LOCK_POLL_S", 0.1)
    lock_file = _record_of_another_host(tmp_path, heartbeat_age_s=run_lock.stale_after_s() - 2)  # silent in 2 s
    lines = []
    started = time.monotonic()
    run = checkpointing.start_run(tmp_path, resume=True, estimated_bytes=1, log=lines.append, lock_wait_s=60)
    assert 1 < time.monotonic() - started < 30
    assert lines[0] == (f"checkpoint.save_dir={tmp_path} is in use by {_OTHER_HOLDER}: waiting up to "
                        "checkpoint.lock_wait_s=60 s for it to end")
    assert re.fullmatch(re.escape(f"took over {lock_file} from {_OTHER_HOLDER}, whose heartbeat has been silent for ")
                        + r"12\d s \(a run on another host counts as ended after 120 s\)", lines[1])
    assert len(lines) == 2
    assert run_lock.read_holder(tmp_path).run_id == run.run_id


def test_lock_wait_s_refuses_when_the_holder_outlives_it(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpointing.runs, "_LOCK_POLL_S", 0.1)
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
