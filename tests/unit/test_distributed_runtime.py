"""aligner/runtime/distributed.py: a process that initialised the runtime tears its process groups
down before the interpreter does (a live gloo group at finalisation can abort the process with
SIGABRT, "terminate called without an active exception"), unless the process is ending on an error."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ..conftest import REPO_ROOT

# The probe's atexit hook is registered before `initialize`, so it runs after the runtime's own
# (atexit runs last-registered first) and sees what the runtime left behind.
PROBE = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist
    from megatron.core import parallel_state
    from aligner.runtime import distributed
    atexit.register(lambda: print("alive at exit:", dist.is_initialized(),
                                  parallel_state.model_parallel_is_initialized(), flush=True))
    distributed.initialize(distributed.ParallelConfig())
    distributed.initialize(distributed.ParallelConfig())  # a second call registers no second hook
    if sys.argv[1] == "raise":
        raise RuntimeError("the run failed")
    if sys.argv[1] == "user_error":  # an entry point's clear one-line error, exit code 2
        from aligner.config import ConfigError, run_main
        def main():
            raise ConfigError("a bad setting")
        run_main(main)
""")


def _run_probe(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_a_clean_exit_destroys_the_process_groups():
    result = _run_probe("clean")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "alive at exit: False False" in result.stdout, result.stdout + result.stderr[-3000:]


@pytest.mark.parametrize("mode, code, message", [("raise", 1, "RuntimeError: the run failed"),
                                                 ("user_error", 2, "error: a bad setting")])
def test_a_failed_run_leaves_the_groups_and_keeps_its_error(mode, code, message):
    result = _run_probe(mode)
    assert result.returncode == code, result.stderr[-3000:]
    assert message in result.stderr
    assert "alive at exit: True True" in result.stdout, result.stdout + result.stderr[-3000:]
