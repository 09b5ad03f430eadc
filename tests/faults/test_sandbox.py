"""The sandbox holds what tool and environment code does: endless loops, memory and fork bombs, writes outside
its directory, the network, crashes, leftover processes; the pool keeps serving after each."""
from __future__ import annotations

import os
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from aligner.runtime.errors import ConfigError
from aligner.runtime.sandbox import SandboxLimits, SandboxPool

pytestmark = pytest.mark.faults

TOOLS = textwrap.dedent('''
    import os, signal, subprocess, time

    def add(a, b):
        return a + b

    def spin():
        while True:
            pass

    def sleep(seconds):
        time.sleep(seconds)

    def eat_memory():
        hoard = []
        while True:
            hoard.append(bytearray(50 * 2 ** 20))

    def fork_bomb():
        while True:
            try:
                os.fork()
            except OSError:
                pass

    def fork_a_few(n):
        made = 0
        for _ in range(n):
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                made += 1
            except OSError:
                break
        return made

    def write(path):
        with open(path, "w") as handle:
            handle.write("x")
        return os.path.abspath(path)

    def connect():
        import socket
        socket.create_connection(("10.255.255.1", 80), timeout=2)

    def leave_a_child():
        return subprocess.Popen(["sleep", "30"]).pid

    def child_and_sleep(seconds):
        subprocess.Popen(["sleep", "60"])
        time.sleep(seconds)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def hang_up_then_die(seconds):
        os.closerange(3, 1024)  # the answers' channel (a copy of the original stdout) among them
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    def not_json():
        return object()

    def fail():
        raise ValueError("bad input 7")

    class Counter:
        def __init__(self, start=0):
            self.value = start

        def step(self, by):
            self.value += by
            return self.value
''')


@pytest.fixture()
def tools(tmp_path, monkeypatch):
    (tmp_path / "sandbox_tools.py").write_text(TOOLS)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture()
def pool(tools):
    pool = SandboxPool(workers=2, limits=SandboxLimits(timeout_s=2.0, memory_mb=512, processes=16))
    yield pool
    pool.close()


def group_processes(pool) -> list[int]:
    """Processes alive in the pool's workers' process groups, the workers excluded."""
    leaders = {worker.process.pid for worker in pool._workers}
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in leaders:
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in leaders and fields[0] != "Z":
                found.append(int(entry))
    return found


def zombie_children() -> list[int]:
    me = str(os.getpid())
    zombies = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] == "Z":
                zombies.append(int(entry))
    return zombies


def test_an_endless_loop_times_out_within_the_limit_and_the_pool_serves_on(pool):
    started = time.monotonic()
    result = pool.call("sandbox_tools:spin")
    assert result.status == "timeout" and "2 s" in result.error
    assert time.monotonic() - started < 2.0 + 1.0
    assert pool.call("sandbox_tools:add", 2, 3).value == 5
    assert pool.replaced == 1


def test_a_memory_bomb_is_contained(pool):
    result = pool.call("sandbox_tools:eat_memory")
    assert result.status in ("error", "crashed")  # MemoryError under the address-space limit, or killed
    assert result.status == "crashed" or result.error.startswith("MemoryError")
    assert pool.call("sandbox_tools:add", 1, 1).value == 2


def test_a_fork_bomb_is_contained_and_reaped(pool):
    if pool.containment["processes"].startswith("none"):
        pytest.skip(f"no process limit here: {pool.containment['processes']}")
    assert pool.call("sandbox_tools:fork_a_few", 100).value <= 16  # the limit holds
    assert group_processes(pool) == []  # and what the call left was killed and reaped
    result = pool.call("sandbox_tools:fork_bomb")
    assert result.status == "timeout"
    assert group_processes(pool) == []
    assert pool.call("sandbox_tools:add", 2, 2).value == 4


def test_writes_outside_the_private_directory_fail(pool, tools):
    if pool.containment["files"].startswith("none"):
        pytest.skip(f"no file-system restriction here: {pool.containment['files']}")
    inside = pool.call("sandbox_tools:write", "result.txt")
    assert inside.ok and Path(inside.value).name == "result.txt" and not inside.value.startswith(str(tools))
    outside = tools / "escaped.txt"
    result = pool.call("sandbox_tools:write", str(outside))
    assert result.status == "error" and "PermissionError" in result.error
    assert not outside.exists()


def test_there_is_no_network(pool):
    if pool.containment["network"].startswith("none"):
        pytest.skip(f"no network isolation here: {pool.containment['network']}")
    result = pool.call("sandbox_tools:connect")
    assert result.status == "error" and "unreachable" in result.error.lower()


def test_a_crash_is_answered_and_the_worker_replaced(pool):
    result = pool.call("sandbox_tools:die")
    assert result.status == "crashed" and "SIGKILL" in result.error
    assert pool.call("sandbox_tools:add", 3, 4).value == 7


def test_a_worker_that_hangs_up_before_it_dies_is_named_by_its_signal(pool):
    """Its answers' pipe closes a moment before it exits (as when a crash tears the process down): the pool waits
    for the exit status instead of reporting 'exit code None'."""
    result = pool.call("sandbox_tools:hang_up_then_die", 0.5)
    assert result.status == "crashed" and "SIGKILL" in result.error, result.error
    assert pool.call("sandbox_tools:add", 3, 4).value == 7


def test_errors_come_back_in_one_line(pool):
    result = pool.call("sandbox_tools:fail")
    assert result.status == "error" and result.error.startswith("ValueError: bad input 7 (sandbox_tools.py:")
    assert "\n" not in result.error
    assert pool.call("sandbox_tools:not_json").error.startswith("the result is not JSON")
    assert pool.call("sandbox_tools.py:add", 5, 6).value == 11  # a file target, made absolute for the worker


def test_an_object_lives_in_its_leased_worker_until_the_lease_ends(pool):
    with pool.lease() as worker:
        assert worker.new("sandbox_tools:Counter", start=10).ok
        assert [worker.method("step", by).value for by in (1, 2, 3)] == [11, 13, 16]
        assert worker.method("sleep_forever").status == "error"  # no such method: an error, the object lives on
        assert worker.method("step", 1).value == 17


def test_a_thousand_calls_leave_no_process_and_no_zombie(pool):
    for index in range(1000):
        target = "sandbox_tools:leave_a_child" if index % 100 == 0 else "sandbox_tools:add"
        result = pool.call(target, *(() if index % 100 == 0 else (index, 1)))
        assert result.ok, result
    assert group_processes(pool) == []
    assert zombie_children() == []
    assert pool.replaced == 0


def test_closing_the_pool_ends_every_worker_and_removes_its_directory(tools):
    pool = SandboxPool(workers=2, limits=SandboxLimits(timeout_s=2.0))
    workers = list(pool._workers)
    pool.call("sandbox_tools:leave_a_child")
    pool.close()
    for worker in workers:
        assert worker.process.poll() is not None and not worker.directory.exists()
    assert zombie_children() == []


def test_a_required_layer_that_cannot_hold_stops_the_pool_in_one_line(tools):
    with pytest.raises(ConfigError, match="sandbox layer 'disk'"):
        SandboxPool(workers=1, limits=SandboxLimits(require=("disk",)))
    if os.geteuid() != 0:
        pytest.skip("the pids cgroup needs root")
    pool = SandboxPool(workers=1, limits=SandboxLimits(require=("processes", "network", "files")))
    assert all(not value.startswith("none") for value in pool.containment.values())  # as root, on Linux >= 5.13
    pool.close()


def test_killing_the_pools_process_ends_its_workers_and_their_children(tools):
    import signal
    import subprocess
    import sys

    script = textwrap.dedent('''
        import sys, time
        from aligner.runtime.sandbox import SandboxLimits, SandboxPool
        pool = SandboxPool(workers=2, limits=SandboxLimits(timeout_s=30))
        child = pool.call("sandbox_tools:leave_a_child")  # killed after its call: one that outlives no call
        with pool.lease() as worker:
            worker.call("sandbox_tools:fork_a_few", 0)
            print(" ".join(str(w.process.pid) for w in pool._workers), flush=True)
            worker.call("sandbox_tools:child_and_sleep", 60)  # busy, with a child, when the pool's process dies
    ''')
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tools,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    workers = [int(pid) for pid in process.stdout.readline().split()]
    assert len(workers) == 2

    def living(pids):
        found = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(pid)
            except OSError:
                pass
        return found

    def in_groups():
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) \
                        in workers and int(entry) not in workers:
                    found.append(int(entry))
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 10
    while not in_groups() and time.monotonic() < deadline:
        time.sleep(0.1)
    children = in_groups()
    assert children  # the busy worker's child
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 5
    while living(workers + children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert living(workers + children) == []
    # what the killed pool could not remove (its workers' directories, its cgroups) the next pool sweeps away
    left = [path for path in Path(tempfile.gettempdir()).glob(f"aligner-sandbox-{process.pid}-*")]
    cgroups = Path("/sys/fs/cgroup/pids")
    left += list(cgroups.glob(f"aligner-sandbox-{process.pid}-*")) if cgroups.is_dir() else []
    assert left  # the kill left them
    SandboxPool(workers=1).close()
    assert [path for path in left if path.exists()] == []
