"""Clients of the model servers in `servers/` (reward model, PPO critic).

`ModelServerClient` is the shared part: futures over one Triton model, many requests in flight,
readiness waits that end within their timeout, and PyTriton's exceptions turned into these:

  ServerUnavailableError  nobody answers at host:port, or the model is not ready, within the timeout
  ServerError             the server answered with an error (a rejected request, a failure while running)
  RequestTimeoutError     the server accepted the request but did not answer within timeout_s
  RequestError            the request cannot be sent as given (e.g. text UTF-8 cannot encode); names the field

All derive from ClientError. The clients are `aligner.clients.reward.RewardClient` and
`aligner.clients.critic.CriticClient`; the wire protocol they share with the servers is
`aligner.clients.protocol`.
"""
from __future__ import annotations

import http.client
import logging
import re
import socket
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import numpy as np


class ClientError(RuntimeError):
    """Base of the errors the server clients raise."""


class ServerUnavailableError(ClientError):
    pass


class ServerError(ClientError):
    pass


class RequestTimeoutError(ClientError, TimeoutError):
    pass


class RequestError(ClientError, ValueError):
    pass


def utf8_bytes(text: str, field: str) -> bytes:
    """`text` as the UTF-8 bytes a request carries; a RequestError naming the request field if UTF-8
    cannot encode it (a lone surrogate such as "\\ud800", which Python strings and JSON allow)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{field} holds text that cannot be encoded as UTF-8 (a lone surrogate such as \\ud800); "
                           "send valid Unicode text") from None


def server_message(text: str) -> str:
    """The useful part of an error text relayed by Triton (PyTriton adds prefixes and tracebacks)."""
    text = text.replace("Error occurred during inference request. Message: ", "", 1).strip()
    if "batch-size must be <=" in text:  # Triton's own check of rows per request
        return f"{text} (the server's server.max_batch_size: send fewer rows per request, or raise it on the server)"
    if "Traceback" not in text:
        return text
    # An exception raised in the model callback arrives as a formatted traceback; its last
    # "SomeError: message" line is what went wrong.
    raised = re.findall(r"^(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$", text, flags=re.MULTILINE)
    return f"{raised[-1][0]}: {raised[-1][1]}" if raised else text


def rejected_rows_message(server: str, errors: list[str]) -> str:
    """One line for a response with per-row errors ("" marks a row that was computed), or "" if none.

    A request refused as a whole (e.g. over the server's size cap) carries the same error on every
    row: it is said once.
    """
    rejected = [(row, message) for row, message in enumerate(errors) if message]
    if not rejected:
        return ""
    if len(rejected) > 1 and len(rejected) == len(errors) and len({message for _, message in rejected}) == 1:
        return f"the {server} rejected all {len(errors)} sequences: {rejected[0][1]}"
    shown = "; ".join(f"sequence {row}: {message}" for row, message in rejected[:5])
    more = f"; and {len(rejected) - 5} more" if len(rejected) > 5 else ""
    return f"the {server} rejected {len(rejected)} of {len(errors)} sequences: {shown}{more}"


class ModelServerClient:
    """Futures over one Triton model served by PyTriton (HTTP).

    Thread-safe: `submit` may be called from any number of threads; requests run on a pool of
    `max_workers` threads, each with its own PyTriton `ModelClient` (which is not thread-safe), so
    up to `max_workers` requests are in flight and the server can batch them together.

    timeout_s: how long one request may take once sent (includes waiting in the server's queue).
    ready_timeout_s: how long the first request (or `wait_until_ready()`) waits for the server and
        model to become ready before raising ServerUnavailableError.
    """

    server_kind = "model"
    error_class: type = ServerError

    def __init__(self, host: str, port: int, model_name: str, *, timeout_s: float = 60.0,
                 ready_timeout_s: float = 30.0, max_workers: int = 8):
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.host, self.port, self.model_name = host, int(port), model_name
        self.timeout_s, self.ready_timeout_s = float(timeout_s), float(ready_timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{self.server_kind}-client")
        self._local = threading.local()
        self._clients: list = []  # every thread's ModelClient, closed by close()
        self._lock = threading.Lock()
        self._ready = False
        self._max_batch_size: Optional[int] = None
        self._closed = False
        _quiet_pytriton_client()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start_hint(self) -> str:
        """How to start the server this client talks to (for ServerUnavailableError)."""
        return f"start the {self.server_kind} server on {self.host}:{self.port}"

    # -- readiness

    def wait_until_ready(self, timeout_s: Optional[float] = None) -> None:
        """Return once the server answers and the model is ready; ServerUnavailableError after timeout_s."""
        timeout_s = self.ready_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            reason = self._probe(max(0.05, min(1.0, remaining)))
            if reason is None:
                self._ready = True
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServerUnavailableError(
                    f"no {self.server_kind} server is ready at {self.host}:{self.port} (model '{self.model_name}') "
                    f"after waiting {timeout_s:.1f} s: {reason}. {self.start_hint()}")
            time.sleep(min(0.2, remaining))

    def _probe(self, timeout_s: float) -> Optional[str]:
        """None if the model is ready, else why not."""
        import tritonclient.http

        try:
            client = tritonclient.http.InferenceServerClient(
                f"{self.host}:{self.port}", connection_timeout=timeout_s, network_timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - e.g. a host name that does not resolve: reported as not ready
            return f"{type(error).__name__}: {error}"
        try:
            if not client.is_server_live():
                return "the server is starting or stopping"
            if not client.is_model_ready(self.model_name):
                return (f"the server is up but model '{self.model_name}' is not ready (still loading, or the "
                        f"server serves another model name)")
            return None
        except Exception as error:  # noqa: BLE001 - connection refused, timeouts, HTTP errors: not ready
            return f"{type(error).__name__}: {error}".strip()
        finally:
            client.close()

    # -- requests

    def submit(self, inputs: dict[str, np.ndarray]) -> Future:
        """Send named arrays with a leading batch dimension; a Future of the output dict.

        More rows than the server's max_batch_size are sent as several requests, one after the
        other, and their outputs concatenated.
        """
        if self._closed:
            raise ClientError(f"the {self.server_kind} client for {self.url} is closed")
        return self._pool.submit(self._request, inputs)

    def _request(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._ensure_ready()
        if self._max_batch_size is None:
            self._max_batch_size = self._call(lambda client: client.model_config.max_batch_size)
        rows = next(iter(inputs.values())).shape[0] if inputs else 0
        step = max(1, self._max_batch_size)
        if rows <= step:
            return self._call(lambda client: client.infer_batch(**inputs))
        parts = [self._call(lambda client, start=start: client.infer_batch(
                     **{name: array[start:start + step] for name, array in inputs.items()}))
                 for start in range(0, rows, step)]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    def _ensure_ready(self) -> None:
        if not self._ready:
            self.wait_until_ready(self.ready_timeout_s)

    def _call(self, action: Callable):
        from pytriton.client.exceptions import (
            PyTritonClientError,
            PyTritonClientInferenceServerError,
            PyTritonClientModelUnavailableError,
            PyTritonClientTimeoutError,
        )

        client = self._thread_client()
        try:
            return action(client)
        except PyTritonClientInferenceServerError as error:
            raise self.error_class(server_message(str(error))) from None
        except PyTritonClientTimeoutError as error:
            # The connection may still owe a late answer: never reuse it for the next request.
            self._discard_thread_client()
            cause = error.__cause__
            if isinstance(cause, OSError) and not isinstance(cause, (socket.timeout, TimeoutError)):
                self._ready = False  # the server went away: the next request waits for it again
                raise ServerUnavailableError(
                    f"lost the {self.server_kind} server at {self.host}:{self.port} ({cause}). {self.start_hint()}"
                ) from None
            if "inference request" in str(error):
                raise RequestTimeoutError(
                    f"the {self.server_kind} server at {self.host}:{self.port} did not answer within "
                    f"timeout_s={self.timeout_s:g} s") from None
            raise ServerUnavailableError(
                f"the {self.server_kind} server at {self.host}:{self.port} (model '{self.model_name}') did not "
                f"become ready within {self.ready_timeout_s:g} s ({error}). {self.start_hint()}") from None
        except PyTritonClientModelUnavailableError as error:
            raise ServerUnavailableError(f"{error}. {self.start_hint()}") from None
        except PyTritonClientError as error:
            raise ClientError(f"{self.server_kind} client for {self.url}: {error}") from None
        except (OSError, http.client.HTTPException) as error:  # e.g. the server died with our request in flight
            self._discard_thread_client()
            self._ready = False
            raise ServerUnavailableError(
                f"lost the {self.server_kind} server at {self.host}:{self.port} ({error}). {self.start_hint()}"
            ) from None

    def _thread_client(self):
        client = getattr(self._local, "client", None)
        if client is None:
            from pytriton.client import ModelClient

            client = ModelClient(self.url, self.model_name, init_timeout_s=self.ready_timeout_s,
                                 inference_timeout_s=self.timeout_s)
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _discard_thread_client(self) -> None:
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            with self._lock:
                if client in self._clients:
                    self._clients.remove(client)
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close
                pass

    # -- lifetime

    def close(self) -> None:
        """Finish the requests in flight, then close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a connection to a server that is already gone
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_quieted = False


def _quiet_pytriton_client() -> None:
    """PyTriton warns on every request that its network timeout differs from the init timeout, and logs each
    failed request ("Timeout occurred during inference request ...") before raising it: the exception, which
    these clients turn into one line naming the server, says the same."""
    global _quieted
    if not _quieted:
        from pytriton.client.warnings import NotSupportedTimeoutWarning

        warnings.filterwarnings("ignore", category=NotSupportedTimeoutWarning)
        logging.getLogger("pytriton.client.client").setLevel(logging.CRITICAL)
        _quieted = True
