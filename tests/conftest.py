"""Shared test helpers: launching multi-process (torchrun) scripts on gloo."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600) -> str:
    """Run `script` under torchrun with `nproc` CPU processes; returns stdout, fails with all output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    command = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", f"--master_port={_free_port()}", "--master_addr=127.0.0.1",
        str(script), *map(str, args),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if result.returncode != 0:
        pytest.fail(
            f"torchrun {script} (nproc={nproc}) exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result.stdout


@pytest.fixture
def torchrun():
    return run_torchrun


def dotted_keys(config) -> set[str]:
    """Every key of a (nested) config as dotted paths, e.g. {"trainer", "trainer.max_steps"}.

    Accepts an omegaconf config or plain dicts; used to check that a shipped yaml documents
    every key of its schema.
    """
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(config) if OmegaConf.is_config(config) else config
    found = set()
    for key, value in node.items():
        found.add(str(key))
        if isinstance(value, dict):
            found |= {f"{key}.{inner}" for inner in dotted_keys(value)}
    return found
