"""PyTriton plumbing shared by the model servers (reward model now, PPO critic later).

Two pieces:

* `serve(...)`: start PyTriton on a configurable host and ports with the environment it needs
  (see `prepare_environment`), bind models, print one "ready" line once Triton reports the
  models ready, run until SIGINT/SIGTERM or until Triton dies, then shut down within seconds.
  If Triton's own process (`tritonserver`) or its Python-backend process dies, the server exits
  with status 1 and one line saying so (`TritonDied`), so a supervisor restarts it; the processes
  a dead `tritonserver` leaves behind are ended too. A `tritonserver` that crashes while it loads the models,
  before anything is served, is started again (`start`, up to START_ATTEMPTS times).
* `CollectiveServing`: "rank 0 serves, the other ranks follow". A model sharded over a
  distributed job (TP/PP/DP) is computed by a collective function that *every* rank must call
  with the same inputs. Only rank 0 runs Triton; its inference callback calls `run(*tensors)`,
  which broadcasts a RUN command and the tensors to all ranks and then calls the collective
  function itself, while every other rank sits in `follow()` receiving commands and calling the
  same function. When rank 0 shuts down it broadcasts STOP and the followers return.

The command channel is its own gloo group on CPU tensors (whatever the model's backend), with a
long timeout: a follower may wait for the next request for as long as the server is idle, and
the default process-group timeout (minutes) would otherwise end an idle server. If rank 0 dies,
gloo reports the closed connection at once and the followers exit with an error.
"""
from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import os
import signal
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from aligner.runtime import cpu_bridge, stopping
from aligner.runtime.distributed import stream_address
from aligner.runtime.errors import UserError

if TYPE_CHECKING:  # PyTriton is imported where a server starts (prepare_environment names the fix when it is missing)
    from pytriton.triton import Triton

LOGGER = logging.getLogger(__name__)

# Triton waits this long for in-flight requests when it stops (its default is 30 s).
EXIT_TIMEOUT_S = 3
# How long shutdown waits for a running collective call before giving up on telling followers.
STOP_LOCK_TIMEOUT_S = 10.0
# How long Triton may take to report the models ready after it started.
MODEL_READY_TIMEOUT_S = 120.0
# How many times serve() starts Triton when `tritonserver` crashes (ends by a signal) while loading the models.
# Seen under load: Triton's Python backend aborting on `boost::interprocess::lock_exception` during a model load
# (reported upstream as triton-inference-server/server#5949 and #8882). Nothing is served yet, so nothing is lost.
START_ATTEMPTS = 3
# How often the processes Triton starts are looked up while it starts (they are ended if the start fails).
START_WATCH_S = 0.1
# How long a crashed start waits for PyTriton to record tritonserver's exit status.
EXIT_CODE_WAIT_S = 5.0
# The process Triton's Python backend runs each model instance in (PyTriton's proxy to our callbacks).
BACKEND_STUB_NAME = "triton_python_backend_stub"
# Lines of Triton's own log shown when it fails.
TRITON_LOG_TAIL_LINES = 30
# Followers wait on the command channel while the server is idle; effectively forever.
COMMAND_CHANNEL_TIMEOUT = datetime.timedelta(days=365)


class TritonSetupError(UserError, ValueError):
    """The environment or a server setting cannot run PyTriton (a user error: entry points report it in one line)."""


class TritonDied(SystemExit):
    """Triton stopped on its own while serving. A SystemExit with a message: the interpreter prints
    the one line and exits with status 1 (not 0, so a supervisor restarts the server), no traceback."""

    def __init__(self, message: str):
        super().__init__(f"error: {message}")


@dataclass
class ServerConfig:
    """The `server:` section of a server config. gRPC listens on port + 1, metrics on port + 2."""

    host: str = "127.0.0.1"  # loopback by default; 0.0.0.0 serves every interface
    port: int = 5555  # HTTP
    model_name: str = "model"
    max_queue_delay_microseconds: int = 2000  # how long Triton may hold a request to batch it with others
    preferred_batch_sizes: Optional[list[int]] = None  # null: the server's natural batch (see each server)
    max_batch_size: int = 64  # rows (sequences) per batch the model callback receives at most
    # Bytes of one request's input tensors at most (the wire payload; texts count their UTF-8 bytes).
    max_request_bytes: int = 32 << 20

    @property
    def grpc_port(self) -> int:
        return self.port + 1

    @property
    def metrics_port(self) -> int:
        return self.port + 2

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def validate(self) -> None:
        if not 0 < self.port < 65534:
            raise TritonSetupError("server.port must be in 1..65533 (gRPC uses port+1, metrics port+2), "
                                   f"got {self.port}")
        if self.max_batch_size < 1:
            raise TritonSetupError(f"server.max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_request_bytes < 1:
            raise TritonSetupError(f"server.max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if self.max_queue_delay_microseconds < 0:
            raise TritonSetupError(
                f"server.max_queue_delay_microseconds must be >= 0, got {self.max_queue_delay_microseconds}")
        for size in self.preferred_batch_sizes or []:
            if not 1 <= size <= self.max_batch_size:
                raise TritonSetupError(
                    f"server.preferred_batch_sizes {self.preferred_batch_sizes}: every size must be in "
                    f"1..server.max_batch_size ({self.max_batch_size})")


def check_numpy() -> None:
    """PyTriton 0.7 fails every inference under numpy 2 ('cannot reshape array of size 0')."""
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise TritonSetupError(
            f"PyTriton needs numpy<2 but numpy {numpy.__version__} is installed (with numpy 2 every "
            "inference fails with 'cannot reshape array of size 0'); install it with: pip install 'numpy<2'"
        )


def prefix_python_libdir() -> None:
    """Put this interpreter's LIBDIR first on LD_LIBRARY_PATH (read by Triton when it starts).

    PyTriton's Python-backend stub links `libpython3.X.so`; without this the loader may pick
    another build of the same version (e.g. the system's under pyenv or a venv) and model loading
    fails with "'_thread.RLock' object has no attribute '_recursion_count'".
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    if not libdir:
        return
    entries = [entry for entry in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if entry]
    if not entries or entries[0] != libdir:
        os.environ["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, *entries])


def check_ports_free(server: ServerConfig) -> None:
    """Fail fast with the port's name: Triton itself would only stop answering readiness checks."""
    import socket

    address = bind_address(server.host)
    for name, port in (("server.port (HTTP)", server.port), ("gRPC (server.port + 1)", server.grpc_port),
                       ("metrics (server.port + 2)", server.metrics_port)):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Triton does: TIME_WAIT is fine
            try:
                sock.bind((address, port))
            except OSError as error:
                raise TritonSetupError(
                    f"cannot listen on {server.host}:{port} for {name}: {error.strerror}; another server may be "
                    f"running there, choose another server.port (gRPC and metrics use the next two ports)") from None


def prepare_environment() -> None:
    """Everything PyTriton needs before Triton starts; raises TritonSetupError with the fix."""
    check_numpy()
    try:
        import pytriton  # noqa: F401
    except ImportError as error:
        raise TritonSetupError(
            f"the servers need PyTriton ({error}); install it with: pip install nvidia-pytriton") from None
    prefix_python_libdir()


# ------------------------------------------------------------------------------------------
# rank 0 serves, the other ranks follow


class Command(enum.IntEnum):
    STOP = 0
    RUN = 1


# Header: [command, number of tensors, then per tensor: dtype code, ndim, dims padded to MAX_DIMS].
MAX_TENSORS = 8
MAX_DIMS = 4
_FIELDS_PER_TENSOR = 2 + MAX_DIMS
_HEADER_LENGTH = 2 + MAX_TENSORS * _FIELDS_PER_TENSOR
_DTYPES = [torch.int64, torch.int32, torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8]
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


class CollectiveServing:
    """Serialised calls of one collective function on every rank with rank 0's inputs.

    collective_fn(*tensors) -> result is called by every rank with the same CPU tensors; rank 0
    gets the result from `run`. Calls are serialised by a lock (two collectives must never
    interleave), so `run` may be called from any number of threads. Without a process group, or
    with one process, `run` just calls the function.
    """

    def __init__(self, collective_fn: Callable[..., torch.Tensor]):
        self._fn = collective_fn
        self._lock = threading.Lock()
        self._stopped = False
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._world = dist.get_world_size() if dist.is_initialized() else 1
        self._group = None
        if self._world > 1:  # collective: every rank constructs its CollectiveServing at the same point
            self._group = dist.new_group(backend="gloo", timeout=COMMAND_CHANNEL_TIMEOUT)
        from aligner.runtime.distributed import device

        self._device = device()  # this rank's model device, captured on the main thread

    @property
    def is_server(self) -> bool:
        return self._rank == 0

    def run(self, *tensors: torch.Tensor) -> torch.Tensor:
        """Rank 0: have every rank call the collective function on `tensors`; returns rank 0's result."""
        if not self.is_server:
            raise RuntimeError("CollectiveServing.run is for rank 0; the other ranks call follow()")
        tensors = tuple(tensor.detach().cpu().contiguous() for tensor in tensors)
        with self._lock:
            if self._stopped:
                raise RuntimeError("the server is shutting down")
            self._use_device()
            if self._group is not None:
                self._send(Command.RUN, tensors)
            return self._fn(*tensors)

    def follow(self) -> None:
        """Ranks other than 0: run the collective function for every RUN until rank 0 sends STOP.

        SIGINT and SIGTERM are ignored meanwhile: rank 0 decides when the job stops (it sends STOP
        when it is interrupted), so a Ctrl-C or a launcher's SIGTERM that reaches every rank never
        leaves rank 0 inside a collective with a missing peer. If rank 0 dies, the broadcast fails
        at once (closed connection) and this raises.
        """
        if self.is_server:
            raise RuntimeError("rank 0 serves; follow() is for the other ranks")
        if self._group is None:
            return
        with _signals_ignored():
            self._use_device()
            while True:
                try:
                    command, tensors = self._receive()
                except RuntimeError as error:
                    raise RuntimeError(
                        f"rank {self._rank}: lost the serving rank 0 ({str(error).splitlines()[0]}); "
                        "see rank 0's output for why it stopped") from None
                if command == Command.STOP:
                    LOGGER.info("rank %d: rank 0 stopped serving", self._rank)
                    return
                try:
                    self._fn(*tensors)
                except UserError as error:  # a bad request (a checkpoint to restore that is missing, ...): one line
                    LOGGER.warning("rank %d: the collective call failed: %s", self._rank, error)
                except Exception:  # rank 0 gets the same error (same inputs) and reports it to the client
                    LOGGER.exception("rank %d: the collective call failed", self._rank)

    def stop(self) -> None:
        """Rank 0: send STOP to the followers (after any running call); idempotent, never hangs."""
        if not self.is_server:
            return
        if not self._lock.acquire(timeout=STOP_LOCK_TIMEOUT_S):
            LOGGER.error("a collective call is still running after %.0f s; exiting without stopping the "
                         "other ranks (they exit when this process does)", STOP_LOCK_TIMEOUT_S)
            return
        try:
            if self._stopped:
                return
            self._stopped = True
            if self._group is not None:
                header = self._header(Command.STOP, ())
                try:
                    work = dist.broadcast(header, src=0, group=self._group, async_op=True)
                    work.wait(timeout=datetime.timedelta(seconds=5))
                except RuntimeError as error:  # a follower already gone: nothing left to stop
                    LOGGER.warning("could not send STOP to the other ranks: %s", str(error).splitlines()[0])
        finally:
            self._lock.release()

    # -- wire format

    def _use_device(self) -> None:
        # Triton calls back on its own threads, whose current CUDA device is 0 by default.
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)

    @staticmethod
    def _header(command: Command, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(tensors) > MAX_TENSORS:
            raise ValueError(f"at most {MAX_TENSORS} tensors per call, got {len(tensors)}")
        header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
        header[0], header[1] = int(command), len(tensors)
        for index, tensor in enumerate(tensors):
            if tensor.dtype not in _DTYPE_CODES or tensor.dim() > MAX_DIMS:
                raise ValueError(f"tensor {index}: dtype {tensor.dtype} with {tensor.dim()} dims cannot be sent "
                                 f"(supported: {_DTYPES}, at most {MAX_DIMS} dims)")
            start = 2 + index * _FIELDS_PER_TENSOR
            header[start], header[start + 1] = _DTYPE_CODES[tensor.dtype], tensor.dim()
            header[start + 2:start + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        return header

    def _send(self, command: Command, tensors: Sequence[torch.Tensor]) -> None:
        dist.broadcast(self._header(command, tensors), src=0, group=self._group)
        for tensor in tensors:
            dist.broadcast(tensor, src=0, group=self._group)

    def _receive(self) -> tuple[Command, list[torch.Tensor]]:
        header = torch.zeros(_HEADER_LENGTH, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self._group)
        command, count = Command(int(header[0])), int(header[1])
        tensors = []
        for index in range(count):
            start = 2 + index * _FIELDS_PER_TENSOR
            dtype, ndim = _DTYPES[int(header[start])], int(header[start + 1])
            shape = header[start + 2:start + 2 + ndim].tolist()
            tensor = torch.empty(shape, dtype=dtype)
            dist.broadcast(tensor, src=0, group=self._group)
            tensors.append(tensor)
        return command, tensors


@contextlib.contextmanager
def _signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _sigterm_as_keyboard_interrupt():
    """SIGTERM ends the server like Ctrl-C does (so rank 0 always stops Triton and the followers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise stopping.Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------------
# PyTriton


@dataclass
class TritonModel:
    """One model to bind: its callback gets a list of requests (dicts of numpy arrays with a
    leading batch dimension) and returns one dict of outputs per request."""

    name: str
    infer_fn: Callable
    inputs: list  # pytriton.model_config.Tensor
    outputs: list
    max_batch_size: int
    max_queue_delay_microseconds: int
    preferred_batch_sizes: list[int] = field(default_factory=list)


def new_triton_log(server: ServerConfig) -> Path:
    """A new file for Triton's own log (serve() removes it after a clean stop, keeps it after a failure).

    Not the console: Triton prints its option tables on every start and, on a machine without
    CUDA, errors about the missing CUDA driver that no user can act on. Its real failures are
    shown from this file (`triton_log_tail`) where the server reports them.
    """
    handle, path = tempfile.mkstemp(prefix=f"aligner_triton_{server.port}_", suffix=".log")
    os.close(handle)
    return Path(path)


def triton_log_tail(path: Path) -> str:
    """The path and last lines of Triton's log, for an error message."""
    try:
        lines = path.read_text(errors="replace").splitlines()[-TRITON_LOG_TAIL_LINES:]
    except OSError as error:
        return f"Triton's log {path} cannot be read ({error.strerror})"
    return f"the end of Triton's log {path}:\n" + "\n".join(lines)


def bind_address(host: str) -> str:
    """The address Triton binds for `server.host`: a node's name (a Slurm job's `scontrol show hostnames`) is
    resolved here, since Triton's own options take addresses."""
    return stream_address(host, None, "server.host", "give this node's name or address (127.0.0.1: this machine "
                          "only)", TritonSetupError)[3][0]


def triton_config(server: ServerConfig, log_file: Path):
    from pytriton.triton import TritonConfig

    address = bind_address(server.host)
    return TritonConfig(
        http_address=address, http_port=server.port,
        grpc_address=address, grpc_port=server.grpc_port,
        metrics_address=address, metrics_port=server.metrics_port,
        exit_timeout_secs=EXIT_TIMEOUT_S, log_file=log_file,
        **cpu_bridge.triton_config_overrides(),
    )


def wait_models_ready(server: ServerConfig, model_names: Sequence[str], log_file: Path,
                      timeout_s: float = MODEL_READY_TIMEOUT_S) -> None:
    """Poll Triton until every model answers ready (PyTriton's own wait only warns on a timeout)."""
    import tritonclient.http

    deadline = time.monotonic() + timeout_s
    client = tritonclient.http.InferenceServerClient(f"{server.host}:{server.port}", connection_timeout=5.0,
                                                     network_timeout=5.0)
    try:
        for name in model_names:
            while True:
                try:
                    if client.is_model_ready(name):
                        break
                except Exception:  # noqa: BLE001 - not answering yet counts as not ready
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Triton on {server.http_url} did not report model '{name}' ready within "
                                       f"{timeout_s:.0f} s; {triton_log_tail(log_file)}")
                time.sleep(0.2)
    finally:
        client.close()


class TritonProcesses:
    """Triton's own process (`tritonserver`) and the processes it starts, watched while serving.

    When `tritonserver` is killed, or PyTriton's stop gives up waiting for it (seen under load: a SIGKILL of the
    PPO launcher left the critic's stub running), the Python-backend stub it started (and the stub's helpers)
    stay alive, owned by PID 1; `end_leftovers`, called after every stop, ends the ones seen while Triton ran.
    When a stub dies, Triton stays up but answers every request for that model with an error and never restarts
    it: `dead_backend` reports it, and the server stops as it does when Triton dies.
    """

    def __init__(self, triton):
        import psutil

        self._triton = triton
        self.server_process: Optional[psutil.Process] = None  # found by remember_descendants once it runs
        self._shared_memory: set[str] = set()  # /dev/shm files Triton's processes map
        self._seen: dict[int, tuple["psutil.Process", str]] = {}  # pid: (process, name; a dead one has none)
        self._find_server()

    def _find_server(self) -> None:
        import psutil

        if self.server_process is None:
            with contextlib.suppress(psutil.Error):
                found = [child for child in psutil.Process().children() if child.name() == "tritonserver"]
                self.server_process = found[0] if found else None

    @property
    def exit_code(self) -> Optional[int]:
        """tritonserver's exit status (-N: killed by signal N), as PyTriton 0.7's process runner (`sh`)
        recorded it; None where that private attribute is missing (the line then only says 'stopped')."""
        running = getattr(getattr(self._triton, "_triton_server", None), "_tritonserver_running_cmd", None)
        return getattr(getattr(running, "process", None), "exit_code", None)

    def remember_descendants(self) -> None:
        import psutil

        self._find_server()
        if self.server_process is None:
            return
        try:
            for process in self.server_process.children(recursive=True):
                if process.pid not in self._seen:
                    self._seen[process.pid] = (process, process.name())
        except psutil.Error:  # tritonserver just ended: keep what was seen
            pass
        for process in [self.server_process, *(process for process, _ in self._seen.values())]:
            self._shared_memory |= _mapped_shared_memory(process.pid)

    @contextlib.contextmanager
    def watched(self, every_s: float = START_WATCH_S):
        """Remember the processes Triton starts while the block runs (a thread; for Triton's start, during
        which a crash would otherwise leave processes nobody saw)."""
        done = threading.Event()

        def watch():
            while not done.wait(every_s):
                self.remember_descendants()

        thread = threading.Thread(target=watch, name="triton-start-watch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
            self.remember_descendants()
            # Triton runs a short-lived stub to read a model's config before the instance's own stub: one that
            # ended while Triton started is not a dead backend (the shared memory it mapped is still removed)
            self._seen = {pid: seen for pid, seen in self._seen.items() if _running(seen[0])}

    def crashed(self) -> bool:
        """`tritonserver` has ended by a signal (an abort or a crash), not with an exit status of its own (which
        is Triton refusing something: a setting, a port). Read after PyTriton's stop, which waits for it."""
        if self.server_process is None or _running(self.server_process):
            return False
        deadline = time.monotonic() + EXIT_CODE_WAIT_S  # PyTriton's runner records the status a moment later
        while (code := self.exit_code) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return code is not None and code < 0

    def dead_backend(self):  # -> Optional[psutil.Process]
        """A Python-backend stub (one per model instance; Triton never restarts one) that has died."""
        for process, name in self._seen.values():
            # Linux keeps 15 characters of a name; psutil restores the rest only while it can read the command line
            if name.startswith(BACKEND_STUB_NAME[:15]) and not _running(process):
                return process
        return None

    def what_died(self) -> str:
        if self.server_process is None or _running(self.server_process):
            stub = self.dead_backend()
            if stub is not None:
                return f"Triton's Python-backend process ({BACKEND_STUB_NAME}, pid {stub.pid}) died"
            return "Triton reported a model as no longer alive (its inference handler stopped)"
        what = f"Triton's server process (tritonserver, pid {self.server_process.pid})"
        code = self.exit_code
        if code is None:
            return f"{what} stopped"
        if code < 0:
            return f"{what} was killed by {stopping.signal_name(-code)}"
        return f"{what} exited with status {code}"

    def end_leftovers(self, timeout_s: float = 3.0) -> None:
        """Terminate (then kill) the processes Triton started that are still running, and remove the
        shared memory they mapped (the Python backend's regions, PyTriton's tensor stores: several
        hundred MB after large requests), which only a clean Triton stop removes."""
        import psutil

        alive = [process for process, _ in self._seen.values() if _running(process)]
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        _, still = psutil.wait_procs(alive, timeout=timeout_s)
        for process in still:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(still, timeout=timeout_s)
        ours = _mapped_shared_memory(os.getpid())  # PyTriton's stop has released what this process shares
        for path in self._shared_memory - ours:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if alive:
            LOGGER.debug("ended the processes Triton had started: %s", [process.pid for process in alive])


def _mapped_shared_memory(pid: int) -> set[str]:
    """The /dev/shm files process `pid` maps (empty once it has ended)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split(maxsplit=5)[5].strip() for line in maps
                    if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop(triton: Triton, processes: TritonProcesses) -> None:
    """Stop Triton and end what it started (a killed tritonserver, or a stop that timed out, leaves its stubs)."""
    with _signals_ignored():  # a second Ctrl-C must not cut the shutdown short
        triton.stop()
        processes.end_leftovers()


def start(server: ServerConfig, models: Sequence[TritonModel]) -> tuple[Triton, TritonProcesses, Path]:
    """Start Triton with `models` bound and wait until it reports them ready: (Triton, its processes, its log).

    When `tritonserver` crashes while loading the models (see START_ATTEMPTS), what it started is ended and it
    starts again, up to START_ATTEMPTS times, with one warning line each time; the crashed start's log is kept.
    Any other failure (a setting Triton refuses, models not ready in time, an interrupt) stops Triton and raises.
    """
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton

    for attempt in range(1, START_ATTEMPTS + 1):
        log_file = new_triton_log(server)
        LOGGER.info("Triton's log: %s", log_file)
        triton = Triton(config=triton_config(server, log_file))
        processes = TritonProcesses(triton)
        try:
            with processes.watched():
                for model in models:
                    batcher = DynamicBatcher(max_queue_delay_microseconds=model.max_queue_delay_microseconds,
                                             preferred_batch_size=list(model.preferred_batch_sizes) or None)
                    triton.bind(model_name=model.name, infer_func=model.infer_fn, inputs=model.inputs,
                                outputs=model.outputs,
                                config=ModelConfig(max_batch_size=model.max_batch_size, batcher=batcher))
                triton.run()  # starts Triton and waits (a bounded time) for the bound models
                wait_models_ready(server, [model.name for model in models], log_file)
            return triton, processes, log_file
        except BaseException as error:
            _stop(triton, processes)
            if isinstance(error, KeyboardInterrupt):
                log_file.unlink(missing_ok=True)
                raise
            if not processes.crashed():
                raise
            what = f"{processes.what_died()} while loading the models on {server.http_url}"
            if attempt == START_ATTEMPTS:
                raise TritonDied(f"{what}, at each of {START_ATTEMPTS} starts; the server stops (Triton's log: "
                                 f"{log_file})") from error
            LOGGER.warning("%s (start %d of %d; Triton's log: %s); starting Triton again", what, attempt,
                           START_ATTEMPTS, log_file)
    raise AssertionError("unreachable: the last start returns or raises")


def serve(server: ServerConfig, models: Sequence[TritonModel], collective: Optional[CollectiveServing] = None, *,
          ready_message: str = "", poll_s: float = 0.5) -> None:
    """Serve `models` until SIGINT/SIGTERM or until Triton stops.

    With `collective`, only rank 0 runs Triton; the other ranks follow it and return when it stops.
    `ready_message` is printed (flushed) once Triton reports every model ready (`start`: a Triton that crashes
    while loading them is started again). A signal ends it with `stopping.Interrupted` (entry points exit
    128 + the signal number) after a clean shutdown; if Triton stops on its own, raises `TritonDied` (after
    the same shutdown) naming what died.
    """
    if collective is not None and not collective.is_server:
        collective.follow()
        return
    server.validate()
    prepare_environment()
    check_ports_free(server)
    triton = processes = log_file = None
    stopped_cleanly = False
    interrupt: Optional[KeyboardInterrupt] = None
    try:
        with _sigterm_as_keyboard_interrupt():
            try:
                triton, processes, log_file = start(server, models)
                if ready_message:
                    print(ready_message, flush=True)
                while triton.is_alive():
                    processes.remember_descendants()
                    if processes.dead_backend() is not None:  # Triton would answer every request with an error
                        break
                    time.sleep(poll_s)
                raise TritonDied(f"{processes.what_died()} while serving on {server.http_url}; the server stops "
                                 f"(Triton's log: {log_file})")
            except KeyboardInterrupt as received:
                LOGGER.info("interrupted; shutting down")
                stopped_cleanly = True
                interrupt = received
    finally:
        with _signals_ignored():
            if triton is not None:
                _stop(triton, processes)
            if collective is not None:
                collective.stop()
            if stopped_cleanly and log_file is not None:
                log_file.unlink(missing_ok=True)
    sys.stdout.flush()
    if interrupt is not None:
        raise stopping.Interrupted(getattr(interrupt, "signal_number", signal.SIGINT))
