"""Run a server entry point whose `tritonserver` aborts while loading the models, at its first CRASHES starts.

    python triton_crashes.py CRASHES PIDS_FILE ENTRY_POINT [key=value ...]

Stands in for the abort seen under load (Triton's Python backend throwing `boost::interprocess::lock_exception`
while a model loads; the load's HTTP call then fails with the connection closed): PyTriton's model load is
wrapped so that once it has loaded the models (their Python-backend stubs running), `tritonserver` gets SIGABRT
and the load fails as that call does. Every process `tritonserver` had started, and `tritonserver` itself, is
appended to PIDS_FILE ("pid name" a line) before the abort, for the test to check that none outlives the start.
"""
from __future__ import annotations

import runpy
import signal
import sys

import psutil
from pytriton.models.manager import ModelManager

from tests.conftest import processes_alive

crashes_left = int(sys.argv[1])
pids_file = sys.argv[2]
entry_point = sys.argv[3]
load_models = ModelManager.load_models


def load_models_then_abort(manager: ModelManager) -> None:
    global crashes_left
    load_models(manager)
    if crashes_left == 0:
        return
    crashes_left -= 1
    (server,) = [child for child in psutil.Process().children() if child.name() == "tritonserver"]
    started = server.children(recursive=True)
    assert started, "the loaded models' Python-backend stubs should be running"
    with open(pids_file, "a") as out:
        out.writelines(f"{process.pid} {process.name()}\n" for process in [server, *started])
    server.send_signal(signal.SIGABRT)
    # polled, not server.wait(): reaping it here would take its exit status from PyTriton
    assert processes_alive([server], timeout_s=60) == [], "tritonserver outlived SIGABRT"
    raise ConnectionError("connection closed (tritonserver aborted while loading the models)")


ModelManager.load_models = load_models_then_abort
sys.argv = [entry_point, *sys.argv[4:]]
runpy.run_path(entry_point, run_name="__main__")
