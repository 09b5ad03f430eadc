"""Critic-server request caps: an oversize critic_train or critic_infer request is refused alone.

A critic_train request with more rows than `server.max_train_rows`, or any request with more bytes
than `server.max_request_bytes`, gets one error naming the cap and the key; nothing is trained (the
next good train call is the critic's first step and equals the float64 reference), and the next good
inference request equals the in-process values. Last, `tritonserver` killed: the critic server exits
with status 1 and one line, as the reward server does.
"""
from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from aligner.clients import ClientError
from aligner.clients.critic import CriticClient, CriticServerError

from ..functional.test_critic_server import LR, float64_reference, pool, references, rollout, start_server  # noqa: F401 - fixtures

MAX_TRAIN_ROWS = 8  # the rollout fixture's batch: two of them are one request too many
MAX_REQUEST_BYTES = 256 << 10


@pytest.fixture(scope="module")
def capped_server(references):  # noqa: F811 - a fixture imported above
    process = start_server(references, "capped.log", f"server.max_train_rows={MAX_TRAIN_ROWS}",
                           f"server.max_request_bytes={MAX_REQUEST_BYTES}",
                           f"checkpoint.save_dir={references['root'] / 'capped_checkpoints'}")
    yield process
    if process.process.poll() is None:
        process.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(capped_server):
    with CriticClient("127.0.0.1", capped_server.port, timeout_s=60, train_timeout_s=120, ready_timeout_s=30) as critic:
        critic.wait_until_ready(timeout_s=30)
        yield critic


def test_oversize_inference_request_is_refused_and_the_next_request_is_right(client, pool):  # noqa: F811 - a fixture imported above
    """Runs before the train test: the served values are still the initial critic's."""
    sequences, reference, _ = pool
    tokens = np.ones((16, 4096), dtype=np.int64)  # 512 KiB of (valid, mostly padding) token ids
    lengths = np.full((16, 1), 3, dtype=np.int64)
    outputs = client.submit({"tokens": tokens, "sequence_lengths": lengths}).result()  # the raw answer
    errors = {bytes(message).decode() for message in outputs["error"].reshape(-1)}
    assert errors == {f"the request carries {tokens.nbytes + lengths.nbytes} bytes, more than the server accepts "
                      f"({MAX_REQUEST_BYTES} bytes, server.max_request_bytes): send fewer or shorter sequences per "
                      "request, or restart the server with a larger server.max_request_bytes"}, errors
    assert np.isnan(outputs["values"]).all()
    values = client.infer(sequences[2:5]).values
    assert np.abs(values - reference[2:5, :values.shape[1]]).max() < 1e-5


def test_oversize_train_requests_are_refused_and_nothing_is_trained(client, references, rollout):  # noqa: F811 - a fixture imported above
    sequences, prompts, returns, old_values = (rollout["sequences"], rollout["prompt_lengths"], rollout["returns"],
                                               rollout["old_values"])
    doubled = (sequences * 2, prompts * 2, np.concatenate([returns] * 2), np.concatenate([old_values] * 2))
    with pytest.raises(CriticServerError, match=rf"a train batch of 16 rows is more than the server accepts "
                                                rf"\({MAX_TRAIN_ROWS} rows, server\.max_train_rows\)"):
        client.train(*doubled)
    wide = 5000  # 8 rows x 5000 columns x (4 + 4) bytes of returns and old values: over 256 KiB
    padded = [np.pad(array, ((0, 0), (0, wide - array.shape[1]))) for array in (returns, old_values)]
    with pytest.raises(CriticServerError, match=rf"more than the server accepts \({MAX_REQUEST_BYTES} bytes, "
                                                rf"server\.max_request_bytes\)"):
        client.train(sequences, prompts, *padded)
    loss, grad_norm, _ = float64_reference(references, rollout)
    metrics = client.train(sequences, prompts, returns, old_values)
    assert metrics["critic_step"] == 1.0  # the refused requests trained nothing
    assert metrics["value_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert metrics["lr"] == pytest.approx(LR)


def test_tritonserver_killed_ends_the_critic_server_with_status_1(client, capped_server, pool):  # noqa: F811 - a fixture imported above
    """Last in the module: it ends the module's server. Same code path as the reward server's
    (servers.triton.serve), whose fault tests load it with many clients."""
    import psutil

    sequences, _, _ = pool
    client.infer(sequences[:3])
    tritonserver = next(process for process in psutil.Process(capped_server.process.pid).children(recursive=True)
                        if process.name() == "tritonserver")
    tritonserver.send_signal(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(ClientError):
        client.infer(sequences[:3])
    assert time.monotonic() - start < client.timeout_s
    assert capped_server.process.wait(timeout=30) == 1
    last_line = capped_server.log().strip().splitlines()[-1]
    assert last_line.startswith(f"error: Triton's server process (tritonserver, pid {tritonserver.pid}) was killed "
                                "by SIGKILL"), last_line
