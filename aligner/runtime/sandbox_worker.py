"""A sandbox worker: one process that runs tool and environment code for `aligner.runtime.sandbox.SandboxPool`.

Started by the pool as a script (`python sandbox_worker.py DIR LIMITS_JSON`), not as a module of the package,
so that it imports nothing of the training stack (no torch). Before it reads a request it confines itself,
in this order: joins its pids cgroup (the pool made it; root), sets its resource limits, leaves the network
(a user namespace with an empty network namespace; root alone can also take the network namespace without
the user namespace), restricts writes to its private directory with Landlock, and moves into that
directory. Each layer that the kernel refuses is reported back in the first line it writes, so the pool
can say what holds.

Requests and answers are single lines of JSON on stdin / the original stdout (the code it runs sees
/dev/null as its stdout and stderr). JSON and not pickle: the pool reads what this process writes, and
unpickling would hand the code in here a way out.
"""
from __future__ import annotations

import asyncio
import ctypes
import importlib
import importlib.util
import inspect
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_NO_NEW_PRIVS = 38
PARENT_POLL_S = 0.5
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_RULE_PATH_BENEATH = 1
# Landlock file-system rights that write (ABI 1: bits 1, 4-12; ABI 2 adds REFER 13; ABI 3 TRUNCATE 14).
LANDLOCK_WRITE_RIGHTS = {1: (1 << 1) | sum(1 << bit for bit in range(4, 13)), 2: 1 << 13, 3: 1 << 14}


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _error() -> str:
    return os.strerror(ctypes.get_errno())


def die_with_parent(parent: int) -> None:
    """End this worker's process group when the pool's process ends, however it ends (kill -9 included), so no
    worker or tool process outlives it. A watcher thread, not PR_SET_PDEATHSIG: that signal follows the parent
    *thread*, and pools start workers from whichever thread replaces one."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os.killpg(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="sandbox-parent-watch", daemon=True).start()


def join_cgroup(cgroup: str) -> str:
    if not cgroup:
        return "none"
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
        return "cgroup"
    except OSError as error:
        return f"none ({error.strerror})"


def set_limits(limits: dict) -> str:
    memory = limits["memory_mb"] * 2 ** 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["open_files"], limits["open_files"]))
    size = limits["file_size_mb"] * 2 ** 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # the kernel does not count processes against root's RLIMIT_NPROC
        mine = sum(1 for entry in os.listdir("/proc") if entry.isdigit() and _uid_of(entry) == os.getuid())
        resource.setrlimit(resource.RLIMIT_NPROC, (mine + limits["processes"], mine + limits["processes"]))
        return "rlimit"
    return ""


def _uid_of(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return -1


def leave_network() -> str:
    """An empty network namespace: in a new user namespace (which also takes away the capabilities this
    process had outside, so the limits above cannot be raised again), or alone (root without user namespaces)."""
    libc = _libc()
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        with open("/proc/self/setgroups", "w") as setgroups:
            setgroups.write("deny")
        with open("/proc/self/uid_map", "w") as uid_map:
            uid_map.write(f"0 {uid} 1")
        with open("/proc/self/gid_map", "w") as gid_map:
            gid_map.write(f"0 {gid} 1")
        return "user+net namespace"
    if libc.unshare(CLONE_NEWNET) == 0:
        return "net namespace"
    return f"none ({_error()})"


def restrict_writes(directory: str) -> str:
    """Landlock: writing, creating, removing or renaming files is allowed only under `directory` and /dev
    (/dev/null and the like); reading is not restricted."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return f"none (Landlock: {_error()})"
    rights = sum(value for version, value in LANDLOCK_WRITE_RIGHTS.items() if version <= abi)
    attr = ctypes.c_uint64(rights)  # struct landlock_ruleset_attr: handled_access_fs (the first field)
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(8), ctypes.c_uint32(0))
    if ruleset < 0:
        return f"none (Landlock: {_error()})"
    try:
        for path in (directory, "/dev"):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(rights, fd)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    return f"none (Landlock rule for {path}: {_error()})"
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
                libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            return f"none (Landlock: {_error()})"
    finally:
        os.close(ruleset)
    return f"landlock abi {abi}"


def end_leftovers() -> None:
    """Kill what a call left running in this worker's process group (background children, a fork bomb's
    survivors) and reap it, so that no call leaves a process or a zombie behind."""
    me = os.getpid()
    for _ in range(50):
        left = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == me:  # process group: the worker leads its own
                left.append(int(entry))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        if not left:
            return


def load(target: str, cache: dict):
    """`package.module:name` or `/absolute/path.py:name`."""
    if target not in cache:
        where, _, name = target.rpartition(":")
        if where.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"sandboxed_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        cache[target] = getattr(module, name)
    return cache[target]


def call(function, args: list, kwargs: dict):
    value = function(*args, **kwargs)
    return asyncio.run(value) if inspect.isawaitable(value) else value


def _forked_copy_ends() -> None:
    """In a process the code forked (it holds copies of this loop, stdin and the answer channel): end it rather
    than let it answer or read a request. Called wherever control could come back to the loop."""
    if os.getpid() != WORKER_PID:
        os._exit(0)


WORKER_PID = os.getpid()


def serve(channel, requests) -> None:
    targets: dict = {}
    instances: dict = {}
    for line in requests:
        request = json.loads(line)
        try:
            op = request["op"]
            if op == "call":
                value = call(load(request["target"], targets), request.get("args", []), request.get("kwargs", {}))
            elif op == "new":
                instances[request["id"]] = call(load(request["target"], targets), [], request.get("kwargs", {}))
                value = None
            elif op == "method":
                value = call(getattr(instances[request["id"]], request["name"]), request.get("args", []),
                             request.get("kwargs", {}))
            elif op == "schema":  # a tool's JSON schema, read from its signature and docstring here
                from transformers.utils import get_json_schema  # only workers that describe tools need it

                value = get_json_schema(load(request["target"], targets))
            elif op == "drop":
                instances.pop(request["id"], None)
                value = None
            else:
                raise ValueError(f"unknown request {op!r}")
            try:
                answer = json.dumps({"value": value})
            except (TypeError, ValueError) as error:
                answer = json.dumps({"error": f"the result is not JSON: {error}"})
        except BaseException as error:  # noqa: BLE001 - every failure of the code run here is the answer
            _forked_copy_ends()
            if isinstance(error, KeyboardInterrupt):
                raise
            where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
            at = f" ({os.path.basename(where.filename)}:{where.lineno})" if where else ""
            answer = json.dumps({"error": f"{type(error).__name__}: {error}{at}"})
        _forked_copy_ends()
        end_leftovers()
        channel.write(answer + "\n")
        channel.flush()


def main() -> None:
    directory, limits = sys.argv[1], json.loads(sys.argv[2])
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # the package's runtime directory is not a place to import from
    sys.path[:0] = limits["paths"]
    channel = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    processes = join_cgroup(limits["cgroup"])
    processes = set_limits(limits) or processes
    network = leave_network() if not limits["network"] else "allowed"
    die_with_parent(limits["parent"])  # a thread: only after unshare, which a threaded process cannot do
    files = restrict_writes(directory)
    os.chdir(directory)
    os.environ.update(TMPDIR=directory, HOME=directory)
    channel.write(json.dumps({"ready": {"processes": processes, "network": network, "files": files}}) + "\n")
    channel.flush()
    serve(channel, sys.stdin)


if __name__ == "__main__":
    main()
