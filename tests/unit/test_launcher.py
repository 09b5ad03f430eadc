"""aligner/launcher.py: the launcher's children and everything they started are gone after it stops them,
also when a child was killed and could not clean up after itself."""
from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import psutil
import pytest

from aligner.launcher import READY_MARKER, ManagedProcess, run_processes

# A child that starts a grandchild (as torch.compile's worker pool does), prints the grandchild's
# pid, then behaves as argv[1] says: serve (print the ready line and wait) or exit with code 3.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("grandchild", grandchild.pid, flush=True)
    if sys.argv[1] == "serve":
        print("%s 127.0.0.1:0" , flush=True)
        time.sleep(600)
    sys.exit(3)
""" % READY_MARKER)


def _grandchild_pid(process: ManagedProcess, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in process.log_path.read_text().splitlines() if process.log_path.exists() else []:
            if line.startswith("grandchild "):
                return int(line.split()[1])
        time.sleep(0.05)
    pytest.fail(f"{process.name} never reported its grandchild")


def _gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_stop_after_the_child_was_killed_removes_what_it_left_behind(tmp_path):
    child = ManagedProcess("actor", [sys.executable, "-c", PARENT, "serve"], tmp_path / "actor.log", echo=False)
    child.start(dict(os.environ))
    grandchild = _grandchild_pid(child)
    os.kill(child.process.pid, signal.SIGKILL)  # no chance to clean up: the grandchild is orphaned
    child.process.wait(timeout=30)
    assert psutil.pid_exists(grandchild) and not _gone(grandchild, timeout_s=0.5)
    child.stop()
    assert _gone(grandchild)


def test_run_processes_returns_the_actor_code_and_leaves_no_process(tmp_path):
    server = ManagedProcess("server", [sys.executable, "-c", PARENT, "serve"], tmp_path / "server.log", echo=False)
    actor = ManagedProcess("actor", [sys.executable, "-c", PARENT, "exit"], tmp_path / "actor.log", echo=False)
    code = run_processes([server], actor, ready_timeout_s=60)
    assert code == 3
    assert not server.running() and not actor.running()
    assert _gone(_grandchild_pid(server)) and _gone(_grandchild_pid(actor))
