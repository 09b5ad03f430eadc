"""A pool of sandboxed worker processes for tool and environment code: it never runs inside the trainer.

    pool = SandboxPool(workers=4, limits=SandboxLimits(timeout_s=5))
    result = pool.call("my_tools:add", 2, 3)             # SandboxResult(status="ok", value=5, ...)
    with pool.lease() as worker:                         # one worker for a stateful object (an episode)
        worker.new("my_env:GuessingGame", level=2)       # constructed in the worker
        first = worker.method("reset", record)
    pool.close()

Each worker (`aligner/runtime/sandbox_worker.py`) is a process group of its own, started as a script (no
torch), in a private temporary directory; before it runs anything it takes these limits (`SandboxLimits`):
address space, open files, file size, no core files; processes, by a pids cgroup (root) or RLIMIT_NPROC (other
users); no network (an empty network namespace); writes only inside its directory (Landlock). The kernel may
refuse a layer (an old kernel, no user namespaces, no writable cgroup): `pool.containment` says what holds,
and `SandboxLimits.require` names layers whose absence stops the pool from starting.

A call that outlives `timeout_s` (wall clock) is answered `timeout`: the worker's process group and cgroup are
killed, reaped and a new worker takes its place. A worker that dies during a call (killed by the kernel, a
crash) is answered `crashed` and replaced. After every call the worker kills and reaps what the call left
running, so nothing outlives its call. Exceptions raised by the code come back as `error` with one line.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from aligner.runtime.errors import ConfigError

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
STATUSES = ("ok", "error", "timeout", "crashed")
LAYERS = ("processes", "network", "files")
MAX_ANSWER_BYTES = 8 * 2 ** 20  # an answer longer than this is refused (the worker is replaced)
_worker_ids = itertools.count()
PREFIX = "aligner-sandbox-"  # + the pool's pid: its workers' directories and cgroups


def sweep_stale(places: list[Path]) -> None:
    """Remove the directories and (empty) cgroups that pools of processes no longer alive left in `places`
    (a pool killed with kill -9 cannot remove its own; its workers end with it)."""
    for place in places:
        try:
            entries = list(place.glob(f"{PREFIX}*"))
        except OSError:
            continue
        for entry in entries:
            pid = entry.name[len(PREFIX):].split("-", 1)[0]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists() or not entry.is_dir():
                continue
            if (entry / "cgroup.procs").exists():
                with contextlib.suppress(OSError):
                    entry.rmdir()  # a cgroup: removable once empty
            else:
                shutil.rmtree(entry, ignore_errors=True)


@dataclass(frozen=True)
class SandboxLimits:
    """What a worker may use. timeout_s: wall-clock seconds per call (the worker is killed past it)."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    open_files: int = 256
    file_size_mb: int = 64
    processes: int = 32
    network: bool = False  # True: the code may use the network
    paths: tuple[str, ...] = ()  # importable directories for targets (the pool adds the working directory)
    require: tuple[str, ...] = ()  # layers of LAYERS that must hold, else the pool does not start


@dataclass(frozen=True)
class SandboxResult:
    status: str  # one of STATUSES
    value: Any = None
    error: Optional[str] = None  # one line, for error / timeout / crashed
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def _pids_cgroup_root() -> Optional[Path]:
    """A writable cgroup directory with the pids controller (v1 hierarchy or v2 with pids enabled), or None."""
    if os.geteuid() != 0:
        return None
    try:
        entries = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for entry in entries:
        _, controllers, path = entry.split(":", 2)
        if "pids" in controllers.split(","):
            base = Path("/sys/fs/cgroup/pids") / path.lstrip("/")
        elif controllers == "":
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            try:
                if "pids" not in (base / "cgroup.subtree_control").read_text().split():
                    continue
            except OSError:
                continue
        else:
            continue
        if base.is_dir() and os.access(base, os.W_OK):
            return base
    return None


class SandboxWorker:
    """One worker process (its group, its cgroup, its directory) and the requests it answers."""

    def __init__(self, limits: SandboxLimits, cgroup_root: Optional[Path]):
        self.limits = limits
        self.cgroup_root = cgroup_root
        self.directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
        self.cgroup = None
        if self.cgroup_root is not None:
            self.cgroup = self.cgroup_root / f"{PREFIX}{os.getpid()}-{next(_worker_ids)}"
            try:
                self.cgroup.mkdir()
                (self.cgroup / "pids.max").write_text(str(self.limits.processes))
            except OSError:
                self.cgroup = None
        settings = {**asdict(self.limits), "cgroup": str(self.cgroup or ""), "parent": os.getpid(),
                    "paths": [os.getcwd(), *map(os.path.abspath, self.limits.paths)]}
        self.process = subprocess.Popen([sys.executable, str(WORKER_SCRIPT), str(self.directory), json.dumps(settings)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        start_new_session=True, cwd=self.directory, close_fds=True)
        self._buffer = b""
        ready = self._read(30.0)
        if ready is None or "ready" not in ready:
            self.kill()
            raise ConfigError("the sandbox worker did not start (see aligner/runtime/sandbox_worker.py)")
        self.containment = ready["ready"]

    def _read(self, timeout_s: float) -> Optional[dict]:
        """The next answer line, or None on a timeout or the worker's end."""
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    return None
                chunk = os.read(self.process.stdout.fileno(), 1 << 16)
                if not chunk or len(self._buffer) > MAX_ANSWER_BYTES:
                    return None
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def request(self, message: dict, timeout_s: float) -> SandboxResult:
        started = time.monotonic()
        try:
            self.process.stdin.write(json.dumps(message).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return SandboxResult("crashed", error="the sandbox worker had ended", seconds=0.0)
        answer = self._read(timeout_s)
        seconds = time.monotonic() - started
        if answer is None:
            if self.process.poll() is None and seconds >= timeout_s:
                return SandboxResult("timeout", error=f"no answer within {timeout_s:g} s", seconds=seconds)
            code = self.process.poll()
            if code is None:  # its output ended a moment before the kernel reaped it: wait for the exit status
                with contextlib.suppress(subprocess.TimeoutExpired):
                    code = self.process.wait(timeout=5.0)
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            return SandboxResult("crashed", error=f"the sandbox worker ended ({how})", seconds=seconds)
        if "error" in answer:
            return SandboxResult("error", error=answer["error"], seconds=seconds)
        return SandboxResult("ok", value=answer["value"], seconds=seconds)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """End the worker, everything in its process group and cgroup, and remove its directory."""
        for _ in range(100):
            pids = []
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            if self.cgroup is not None:
                with contextlib.suppress(OSError):
                    pids = [int(pid) for pid in (self.cgroup / "cgroup.procs").read_text().split()]
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            if not pids:
                break
            time.sleep(0.01)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        if self.cgroup is not None:
            for _ in range(100):
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
        shutil.rmtree(self.directory, ignore_errors=True)


class WorkerLease:
    """A worker held by one user (an episode): objects made with `new` live in it until the lease ends."""

    def __init__(self, pool: "SandboxPool", worker: SandboxWorker):
        self.pool, self.worker = pool, worker
        self.instance = f"instance-{id(self)}"

    def call(self, target: str, *args, timeout_s: Optional[float] = None, **kwargs) -> SandboxResult:
        message = {"op": "call", "target": _absolute(target), "args": list(args), "kwargs": kwargs}
        return self._request(message, timeout_s)

    def schema(self, target: str, timeout_s: Optional[float] = None) -> SandboxResult:
        """The JSON schema of the function `target` (transformers' get_json_schema, run in the worker)."""
        return self._request({"op": "schema", "target": _absolute(target)}, timeout_s or 60.0)

    def new(self, target: str, timeout_s: Optional[float] = None, **kwargs) -> SandboxResult:
        message = {"op": "new", "id": self.instance, "target": _absolute(target), "kwargs": kwargs}
        return self._request(message, timeout_s)

    def method(self, name: str, *args, timeout_s: Optional[float] = None, **kwargs) -> SandboxResult:
        return self._request({"op": "method", "id": self.instance, "name": name, "args": list(args),
                              "kwargs": kwargs}, timeout_s)

    def _request(self, message: dict, timeout_s: Optional[float]) -> SandboxResult:
        result = self.worker.request(message, timeout_s or self.pool.limits.timeout_s)
        if result.status in ("timeout", "crashed"):  # the worker (and any object in it) is gone: a new one
            self.worker = self.pool._replace(self.worker)
        return result


class SandboxPool:
    """`workers` sandboxed processes; `call` runs a function in an idle one, `lease` holds one for an object."""

    def __init__(self, workers: int = 2, limits: SandboxLimits = SandboxLimits()):
        if workers < 1:
            raise ConfigError(f"a sandbox pool needs at least one worker, got {workers}")
        unknown = sorted(set(limits.require) - set(LAYERS))
        if unknown:
            raise ConfigError(f"sandbox layer {unknown[0]!r} is not one of {', '.join(LAYERS)}")
        self.limits = limits
        self._cgroup_root = _pids_cgroup_root()
        sweep_stale([Path(tempfile.gettempdir())] + ([self._cgroup_root] if self._cgroup_root is not None else []))
        self._idle: queue.Queue[SandboxWorker] = queue.Queue()
        self._lock = threading.Lock()
        self._workers: set[SandboxWorker] = set()
        self.replaced = 0
        self.closed = False
        try:
            for _ in range(workers):
                self._idle.put(self._start())
        except BaseException:
            self.close()
            raise
        self.containment = self._peek_containment()
        missing = [layer for layer in limits.require if self.containment[layer].startswith("none")]
        if missing:
            self.close()
            raise ConfigError(f"the sandbox cannot hold {missing[0]} here ({self.containment[missing[0]]}); "
                              "remove it from the sandbox's required layers to run without it")

    def _peek_containment(self) -> dict:
        worker = self._idle.get()
        self._idle.put(worker)
        return dict(worker.containment)

    def _start(self) -> SandboxWorker:
        worker = SandboxWorker(self.limits, self._cgroup_root)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _replace(self, worker: SandboxWorker) -> SandboxWorker:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)
            self.replaced += 1
        return self._start()

    @contextlib.contextmanager
    def lease(self) -> Iterator[WorkerLease]:
        if self.closed:
            raise RuntimeError("the sandbox pool is closed")
        lease = WorkerLease(self, self._idle.get())
        try:
            yield lease
        finally:
            worker = lease.worker
            if worker.alive and worker.request({"op": "drop", "id": lease.instance}, 10.0).ok:
                self._idle.put(worker)
            else:
                self._idle.put(self._replace(worker))

    def call(self, target: str, *args, timeout_s: Optional[float] = None, **kwargs) -> SandboxResult:
        """Run `package.module:function` or `path/to/file.py:function` with JSON arguments in an idle worker."""
        with self.lease() as worker:
            return worker.call(target, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        """End every worker (and what it started); idempotent."""
        self.closed = True
        with self._lock:
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.kill()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _absolute(target: str) -> str:
    """A file target made absolute (the worker runs in its own directory)."""
    where, _, name = target.rpartition(":")
    return f"{os.path.abspath(where)}:{name}" if where.endswith(".py") else target
