"""Triton's leftovers: the processes `tritonserver` started are ended after every stop, clean or not.

A stand-in `tritonserver` (a shell script of that name, so the kernel names its process so) starts a
long sleep as its "Python-backend stub"; the stand-in is then killed, as PyTriton's stop does when
`tritonserver` does not exit in time, which leaves the stub owned by PID 1.
"""
from __future__ import annotations

import os
import subprocess
import time

import psutil
import pytest

from servers.triton import TritonProcesses

pytestmark = pytest.mark.skipif(not os.uname().sysname == "Linux", reason="reads /proc")


def _stand_in_triton(tmp_path):
    script = tmp_path / "tritonserver"
    script.write_text("#!/bin/sh\nsleep 300 &\nwait\n")
    script.chmod(0o755)
    server = subprocess.Popen([str(script)])
    deadline = time.monotonic() + 30
    while not psutil.Process(server.pid).children():
        assert time.monotonic() < deadline, "the stand-in started no child"
        time.sleep(0.05)
    return server


def test_the_processes_of_a_killed_tritonserver_are_ended(tmp_path):
    server = _stand_in_triton(tmp_path)
    stub = None
    try:
        processes = TritonProcesses(triton=None)
        assert processes.server_process is not None and processes.server_process.pid == server.pid
        processes.remember_descendants()
        (stub,) = psutil.Process(server.pid).children()
        assert stub.name() == "sleep"
        server.kill()
        server.wait(timeout=30)
        assert stub.is_running() and stub.status() != psutil.STATUS_ZOMBIE  # outlived its parent
        processes.end_leftovers(timeout_s=10)
        assert not stub.is_running() or stub.status() == psutil.STATUS_ZOMBIE
    finally:
        server.kill()
        server.wait(timeout=30)
        if stub is not None and stub.is_running():
            stub.kill()

