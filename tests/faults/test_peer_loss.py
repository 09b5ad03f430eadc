"""A peer rank lost in a collective: a rank whose peer died (its sockets closed) or went silent (a cut link: no
answer at all) stops with one line naming the peer, exit 3, within parallel.timeout_s; never the 30-minute
default, never a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from aligner.runtime.distributed import ParallelConfig, initialize, lost_peer
from aligner.runtime.errors import ConfigError

from ..conftest import REPO_ROOT, TORCHRUN_VARIABLES, free_port_block

SCRIPT = REPO_ROOT / "tests" / "faults" / "peer_loss.py"
pytestmark = [pytest.mark.faults]


def _two_ranks(tmp_path, **variables: str) -> tuple[list[subprocess.Popen], list]:
    port = free_port_block(1)
    ranks, logs = [], []
    for rank in (0, 1):
        env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), **variables)
        log = open(tmp_path / f"rank{rank}.log", "w+")  # noqa: SIM115
        logs.append(log)
        ranks.append(subprocess.Popen([sys.executable, str(SCRIPT)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=REPO_ROOT))
    return ranks, logs


def _finish(ranks, logs) -> list[str]:
    for process in ranks:
        if process.poll() is None:
            process.kill()
        process.wait()
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    return texts


def _rank0_once_rank1_goes_silent(tmp_path, **variables: str) -> tuple[int, float, str]:
    """Rank 0's exit code, the seconds from rank 1's going silent to rank 0's exit, and rank 0's output."""
    ranks, logs = _two_ranks(tmp_path, **variables)
    try:
        deadline = time.monotonic() + 120
        while "goes silent" not in (tmp_path / "rank1.log").read_text():
            assert time.monotonic() < deadline and ranks[0].poll() is None, (tmp_path / "rank0.log").read_text()
            time.sleep(0.05)
        silent_at = time.monotonic()
        code = ranks[0].wait(timeout=120)
        noticed_s = time.monotonic() - silent_at
    finally:
        output = _finish(ranks, logs)[0]
    return code, noticed_s, output


def test_a_silent_peer_stops_the_rank_within_the_timeout_with_one_line(tmp_path):
    code, noticed_s, output = _rank0_once_rank1_goes_silent(tmp_path, TIMEOUT_S="6", STOP_RANK="1")
    assert code == 3, output[-3000:]
    assert 5 <= noticed_s <= 20, noticed_s  # parallel.timeout_s=6, not 30 minutes
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "lost a peer rank" in lines[0] and "parallel.timeout_s" in lines[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_dead_peer_stops_the_rank_at_once_naming_its_address(tmp_path):
    code, noticed_s, output = _rank0_once_rank1_goes_silent(tmp_path, TIMEOUT_S="600", KILL_RANK="1")
    assert code == 3, output[-3000:]
    assert noticed_s < 60, noticed_s  # the kernel closed the dead rank's sockets: no waiting for the 600 s timeout
    assert "error: lost a peer rank: the rank on localhost (127.0.0.1) went away" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("message, expected", [
    ("[gloo/transport/tcp/pair.cc:537] Read error [10.1.2.3]:64687: Connection reset by peer. This is typically",
     "the rank on 10.1.2.3 went away (connection reset by peer)"),
    ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.1.2.3]:63110. This is typically",
     "the rank on 10.1.2.3 went away (connection closed by peer)"),
    ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv operation to complete",
     "a collective got no answer from a peer within parallel.timeout_s"),
    ("shapes [2]:3 and [4]:5 differ", None),
    ("Connection reset by peer", None),
])
def test_gloo_messages_of_a_lost_peer_are_told_from_other_errors(message, expected, monkeypatch):
    monkeypatch.setattr("socket.gethostbyaddr", lambda address: (_ for _ in ()).throw(OSError("no name")))
    line = lost_peer(RuntimeError(message))
    assert (line is None) if expected is None else (expected in line), line
    assert lost_peer(ValueError(message)) is None


def test_the_timeout_must_be_positive():
    with pytest.raises(ConfigError, match="parallel.timeout_s must be > 0"):
        initialize(ParallelConfig(timeout_s=0))
