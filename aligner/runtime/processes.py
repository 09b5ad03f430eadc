"""No process of ours outlives its parent: parent-death signals and megatron's checkpoint writers.

Linux only: `PR_SET_PDEATHSIG` asks the kernel to send a signal to a process when the thread
that created it exits (elsewhere `die_with_parent` does nothing and returns False). Four uses:

* children we start with `subprocess` (the PPO launcher's servers and actor): `preexec_die_with_parent`;
* children forked by libraries from the main thread (megatron's checkpoint writer forks one
  process per file bucket for each save): `kill_forked_children_with_parent` registers an at-fork
  hook that gives each of them SIGKILL as its parent-death signal;
* megatron-core 0.16.1's `dist_checkpointing` collects the writers' results through a queue of a
  `multiprocessing` Manager it spawns at the first save and keeps for the life of the process (a
  server process that re-imports the entry script, ~280 MB, plus spawn's resource tracker). A
  SIGKILL or SIGTERM of the trainer leaves both behind, owned by PID 1, forever.
  `no_persistent_checkpoint_writers` replaces that queue with an in-process one: aligner saves
  synchronously, so the queue is written and read by the saving process only, and a save then
  starts no process that outlives it;
* torchrun's workers, each in a session of its own: `stop_with_torchrun` (SIGTERM when the agent dies).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
import signal
import sys
import threading
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_prctl: Optional[Callable] = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
        _prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl.restype = ctypes.c_int
    except (OSError, AttributeError):  # no usable libc: the helpers below do nothing
        _prctl = None


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: Optional[int] = None) -> bool:
    """Have the kernel send `sig` to this process when its parent exits; False where unsupported.

    expected_parent: the parent's pid as the parent knew it; if the parent already died before this
    call (the child now belongs to another process), the signal is sent at once, as it would have been.
    """
    if _prctl is None:
        return False
    if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def preexec_die_with_parent(sig: int = signal.SIGTERM) -> Optional[Callable[[], None]]:
    """A `subprocess.Popen(preexec_fn=...)` that gives the child `sig` when the caller exits.

    Popen must be called from the main thread (the parent-death signal follows the creating
    thread). The function only calls prctl, which takes no lock, so it is safe in the forked child
    even though the caller has other threads. None where prctl is unavailable.
    """
    if _prctl is None:
        return None
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        die_with_parent(sig, parent)

    return set_parent_death_signal


_fork_hook_installed = False


def kill_forked_children_with_parent() -> None:
    """Every child later forked from this process's main thread gets SIGKILL when the process dies.

    Only forks from the main thread: the signal fires when the *creating thread* exits, so a child
    forked by a short-lived worker thread would be killed early. Idempotent.
    """
    global _fork_hook_installed
    if _fork_hook_installed or _prctl is None:
        return
    _fork_hook_installed = True
    state = {"parent": 0, "main": False}

    def before_fork() -> None:
        state["parent"] = os.getpid()
        state["main"] = threading.current_thread() is threading.main_thread()

    def after_fork_in_child() -> None:
        if state["main"]:
            die_with_parent(signal.SIGKILL, state["parent"])

    os.register_at_fork(before=before_fork, after_in_child=after_fork_in_child)


def no_persistent_checkpoint_writers() -> None:
    """Make megatron's checkpoint saves start no process that outlives the save (see the module doc).

    Raises if megatron-core's writer no longer has the function this replaces: an upgrade must
    re-check which processes a save leaves (tests/unit/test_stopping.py and tests/faults/test_stop_sft.py count them).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_get_write_results_queue"):
        raise RuntimeError("megatron-core's FileSystemWriterAsync changed: re-check which processes a "
                           "checkpoint save leaves behind (aligner/runtime/processes.py)")
    local_queue: queue.Queue = queue.Queue()
    filesystem_async._get_write_results_queue = lambda: local_queue
    filesystem_async._results_queue = local_queue


def stop_with_torchrun() -> bool:
    """Under torchrun: SIGTERM this worker when the agent that started it dies; False elsewhere.

    torchrun starts each worker in a session of its own, so a SIGKILL of torchrun (what `kill -9 PID`
    or a kill of its process group reaches) left every rank running, owned by PID 1. SIGTERM, not
    SIGKILL: the worker stops as if torchrun had forwarded the signal (a trainer saves at the next step
    boundary, a server stops serving). The agent starts workers from its main thread, which lives as
    long as it does.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    parent = os.getppid()
    if parent == 1:  # torchrun died before this worker got here
        os.kill(os.getpid(), signal.SIGTERM)
        return True
    return die_with_parent(signal.SIGTERM, expected_parent=parent)


def prepare() -> None:
    """Process hygiene every entry point gets (called by `distributed.initialize`)."""
    kill_forked_children_with_parent()
    no_persistent_checkpoint_writers()
    stop_with_torchrun()
