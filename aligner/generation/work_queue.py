"""Rollout router's work queue: prompt micro-batches handed out over TCP by global rank 0.

Data-parallel generation with a static split waits for the slowest rank: a rank on a slow GPU,
or one that drew long responses, holds every other rank at the next collective. Handing out the
prompts in small micro-batches from one shared queue instead lets a fast rank come back for more
while a slow one is still busy, so the work follows the speed (NeMo-Aligner's balancer idea).

`WorkQueueServer` runs in a background thread of global rank 0 and answers one question over a
TCP socket: "the next micro-batch of round E, please". The routing logic that uses it (rounds,
model-parallel groups, timeouts) is `aligner.generation.router_client.DynamicRouter`. It runs inside
the training job (not as a separate server process), so it lives in the library.

Protocol: one JSON object per line, one answer line per request line, on a kept-open connection.
    request  {"op": "next", "round": E, "worker": W}   W: the asking data-parallel rank (for the log)
    answer   {"indices": [i, ...]}    the next micro-batch; [] once round E's queue is empty
                                      (also for an earlier round: its queue was emptied before a
                                      new round could start)
    answer   {"error": "..."}         a malformed request, or a round that has not started yet
Rounds are started in process by rank 0 (`WorkQueue.start_round`), never over the wire.
"""
from __future__ import annotations

import collections
import json
import logging
import socket
import socketserver
import threading
import time
from typing import Optional

LOGGER = logging.getLogger(__name__)


class RouterError(RuntimeError):
    """The router could not hand out work (server unreachable, protocol error, time limit)."""


class WorkQueue:
    """Micro-batches of item indices for one routing round; every index is handed out exactly once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._round = -1
        self._pending: collections.deque[list[int]] = collections.deque()
        self.assigned: dict[int, list[int]] = {}  # worker -> indices it took this round, in order

    def start_round(self, round_id: int, num_items: int, micro_batch_size: int) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if num_items < 0:
            raise ValueError(f"num_items must be >= 0, got {num_items}")
        with self._lock:
            if round_id <= self._round:
                raise ValueError(f"round {round_id} was already started (current round {self._round})")
            self._round = round_id
            self._pending = collections.deque(
                list(range(start, min(start + micro_batch_size, num_items)))
                for start in range(0, num_items, micro_batch_size)
            )
            self.assigned = {}

    def take(self, round_id: int, worker: int) -> list[int]:
        with self._lock:
            if round_id > self._round:
                raise RouterError(f"round {round_id} has not started (the server is at round {self._round})")
            if round_id < self._round or not self._pending:
                return []
            batch = self._pending.popleft()
            self.assigned.setdefault(worker, []).extend(batch)
            return batch


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        queue: WorkQueue = self.server.queue  # type: ignore[attr-defined]
        for line in self.rfile:  # ends when the client closes the connection
            try:
                request = json.loads(line)
                if not isinstance(request, dict) or request.get("op") != "next":
                    raise RouterError(f"unknown request {line[:200]!r}; expected {{\"op\": \"next\", ...}}")
                answer = {"indices": queue.take(int(request["round"]), int(request.get("worker", -1)))}
            except (RouterError, ValueError, KeyError, TypeError) as error:
                answer = {"error": f"{type(error).__name__}: {error}"}
            self.wfile.write((json.dumps(answer) + "\n").encode())
            self.wfile.flush()


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # a hung client connection never keeps the process alive
    allow_reuse_address = True


class WorkQueueServer:
    """The queue behind a TCP socket, served from a daemon thread (global rank 0 only).

    host: the interface to bind; other ranks connect to `address`, so on several nodes this must
    be an address they can reach (e.g. MASTER_ADDR). port 0 picks a free port.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.queue = WorkQueue()
        self._server = _ThreadingServer((host, port), _Handler)
        self._server.queue = self.queue  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="rollout-router", daemon=True
        )
        self._thread.start()
        self.address: tuple[str, int] = (host, self._server.server_address[1])
        LOGGER.info("rollout router serving on %s:%d", *self.address)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)

    def __enter__(self) -> "WorkQueueServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkQueueClient:
    """One kept-open connection to a `WorkQueueServer`.

    timeout_s bounds both connecting (retried until then: the server may still be starting) and
    waiting for any one answer.
    """

    def __init__(self, address: tuple[str, int], timeout_s: float = 60.0):
        self.address = (address[0], int(address[1]))
        deadline = time.monotonic() + timeout_s
        last_error: Optional[OSError] = None
        while True:
            try:
                self._socket = socket.create_connection(self.address, timeout=timeout_s)
                break
            except OSError as error:
                last_error = error
                if time.monotonic() >= deadline:
                    raise RouterError(
                        f"cannot reach the rollout router at {self.address[0]}:{self.address[1]} within "
                        f"{timeout_s:.0f} s ({last_error}); global rank 0 serves it: is rank 0 alive, and is "
                        "the router host reachable from this node (router host setting / MASTER_ADDR)?"
                    ) from error
                time.sleep(0.05)
        self._socket.settimeout(timeout_s)
        self._reader = self._socket.makefile("rb")

    def next_batch(self, round_id: int, worker: int) -> list[int]:
        """The next micro-batch of item indices of this round; [] when the queue is empty."""
        request = json.dumps({"op": "next", "round": round_id, "worker": worker}) + "\n"
        try:
            self._socket.sendall(request.encode())
            line = self._reader.readline()
        except OSError as error:
            raise RouterError(f"rollout router at {self.address[0]}:{self.address[1]} failed: {error}") from error
        if not line:
            raise RouterError(f"rollout router at {self.address[0]}:{self.address[1]} closed the connection")
        answer = json.loads(line)
        if "error" in answer:
            raise RouterError(f"rollout router refused the request: {answer['error']}")
        return [int(index) for index in answer["indices"]]

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            self._socket.close()
