"""aligner/runtime/stopping.py and aligner/runtime/processes.py: what a signal does in each mode, the
grace period, a second signal, parent-death signals. Exits are checked in child processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from aligner.runtime import processes, stopping

from ..conftest import REPO_ROOT


def _run_child(code: str, timeout_s: float = 60, capture: bool = True) -> subprocess.CompletedProcess:
    """capture=False: output to /dev/null (a grandchild that outlives the child would hold the pipes open)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    output = {"capture_output": True} if capture else {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True, timeout=timeout_s, env=env,
                          cwd=REPO_ROOT, **output)


def test_exit_codes_follow_the_shell_convention():
    assert stopping.exit_code(signal.SIGTERM) == 143 and stopping.exit_code(signal.SIGINT) == 130
    assert stopping.Interrupted(signal.SIGTERM).exit_code == 143


def test_outside_a_loop_a_signal_interrupts_at_once(handlers):
    with pytest.raises(stopping.Interrupted) as raised:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises at the next bytecode
    assert raised.value.signal_number == signal.SIGTERM
    assert isinstance(raised.value, KeyboardInterrupt)  # code that handles Ctrl-C handles it


def test_in_a_loop_the_signal_waits_for_the_step_boundary_and_the_checkpoint(handlers, tmp_path):
    saved = []

    def save():
        saved.append(True)
        return tmp_path / "step_00000003"

    with pytest.raises(stopping.Stopped) as raised:
        with stopping.deferred(grace_s=60) as stop:
            stop.check(2, save)
            assert not saved
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler ran (and only recorded the signal)
            assert stopping.requested() == signal.SIGINT
            stop.check(3, save)
    assert saved == [True]
    assert raised.value.exit_code == 130
    assert raised.value.message == (f"stopped at step 3 by SIGINT; checkpoint {tmp_path / 'step_00000003'}; "
                                    "resume with the same command")


def test_a_boundary_that_cannot_be_resumed_stops_without_saving(handlers):
    with pytest.raises(stopping.Stopped) as raised:
        with stopping.deferred(grace_s=60) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            stop.check(7, None, unsaved_reason="mid-iteration")
    assert "stopped at step 7 by SIGTERM without a checkpoint (mid-iteration)" in raised.value.message


def test_no_checkpoint_once_the_grace_period_has_passed(handlers):
    called = []
    with pytest.raises(stopping.Stopped) as raised:
        with stopping.deferred(grace_s=5) as stop:
            # As if SIGTERM had come 10 s ago (set directly: no watchdog thread to end this process).
            stopping._state.signal_number, stopping._state.received_at = signal.SIGTERM, time.monotonic() - 10
            stop.check(4, lambda: called.append(1))
    assert not called and "checkpoint.stop_grace_s=5 s had passed" in raised.value.message


def test_a_duplicate_signal_within_the_window_is_the_same_request(handlers):
    with pytest.raises(stopping.Stopped):
        with stopping.deferred(grace_s=60) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)  # torchrun forwarding the terminal's Ctrl-C: ignored
            time.sleep(0.05)
            assert stopping.requested() == signal.SIGINT
            stop.check(1, None, unsaved_reason="test")


def test_grace_must_be_positive():
    with pytest.raises(ValueError, match="stop_grace_s must be > 0"):
        with stopping.deferred(grace_s=0):
            pass


def test_a_second_signal_while_stopping_exits_at_once():
    result = _run_child("""
        import os, signal, time
        from aligner.runtime import stopping
        stopping.install()
        with stopping.deferred(grace_s=60) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(stopping.DUPLICATE_WINDOW_S + 0.2)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        print("not reached")
    """)
    assert result.returncode == 143, result.stderr
    assert "not reached" not in result.stdout and "Traceback" not in result.stderr
    assert "SIGTERM again while stopping: exiting at once without a checkpoint" in result.stderr


def test_the_grace_period_bounds_a_stop_that_never_reaches_a_boundary():
    start = time.monotonic()
    result = _run_child("""
        import os, signal, time
        from aligner.runtime import stopping
        stopping.install()
        with stopping.deferred(grace_s=1.0) as stop:
            stop.check(5, None)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # a step (or a save) that takes too long
    """)
    assert result.returncode == 130, result.stderr
    assert time.monotonic() - start < 20
    assert ("stopped after step 5 by SIGINT without a checkpoint: checkpoint.stop_grace_s=1 s passed"
            in result.stderr), result.stderr


def test_the_entry_point_handler_prints_one_line_and_exits_128_plus_signal():
    result = _run_child("""
        import os, signal, time
        from aligner.config import run_main
        def main():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        run_main(main)
    """)
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "interrupted by SIGINT; exiting"


# ------------------------------------------------------------------------------------------ processes.py
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _pid_from(path: Path, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    pytest.fail(f"no pid in {path}")


@linux_only
@pytest.mark.parametrize("hooked", [True, False])
def test_a_forked_child_dies_with_its_parent_once_the_hook_is_installed(tmp_path, hooked):
    """The parent forks a sleeping child, then SIGKILLs itself: with the hook the child goes too."""
    pid_file = tmp_path / "child.pid"
    result = _run_child(f"""
        import multiprocessing, os, signal, time
        from aligner.runtime import processes
        if {hooked}:
            processes.kill_forked_children_with_parent()
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    """, capture=False)
    assert result.returncode == -signal.SIGKILL
    child = _pid_from(pid_file)
    try:
        assert _gone(child, timeout_s=5 if hooked else 1) == hooked
    finally:
        if not hooked and psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


@linux_only
def test_a_subprocess_gets_sigterm_when_its_parent_is_killed(tmp_path):
    pid_file, got = tmp_path / "child.pid", tmp_path / "got_sigterm"
    child_code = (f"import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (open({str(got)!r}, 'w')"
                  f".write('yes'), sys.exit(0))); time.sleep(60)")
    result = _run_child(f"""
        import os, signal, subprocess, sys, time
        from aligner.runtime import processes
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}],
                                 preexec_fn=processes.preexec_die_with_parent())
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(1.0)  # the child installed its handler
        os.kill(os.getpid(), signal.SIGKILL)
    """, capture=False)
    assert result.returncode == -signal.SIGKILL
    child = _pid_from(pid_file)
    try:
        assert _gone(child)
        assert got.read_text() == "yes"  # SIGTERM, so a trainer stops gracefully
    finally:
        if psutil.pid_exists(child):
            os.kill(child, signal.SIGKILL)


def test_megatron_checkpoint_saves_keep_no_process(tmp_path):
    """A save through aligner's runtime leaves this process without children (megatron-core 0.16.1
    would otherwise keep a Manager server and a resource tracker for the life of the process)."""
    result = _run_child(f"""
        import psutil
        from aligner import checkpointing
        from aligner.models.gpt import GPTConfig
        from aligner.runtime import distributed
        from aligner.runtime.distributed import ParallelConfig
        from aligner.models.gpt import build_model_chunks
        import torch

        if __name__ == "__main__":
            distributed.initialize(ParallelConfig())
            cfg = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                            ffn_hidden_size=32, vocab_size=32, max_position_embeddings=16)
            chunks = build_model_chunks(cfg, ParallelConfig(), torch.float32)
            checkpointing.save({str(tmp_path / 'ckpt')!r}, chunks, model_config=cfg.to_dict())
            print("children", [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)
                               if child.status() != psutil.STATUS_ZOMBIE])
    """, timeout_s=180)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "children []" in result.stdout, result.stdout
    assert (tmp_path / "ckpt" / "aligner_meta.json").is_file()


def test_the_queue_replacement_refuses_an_unknown_megatron(monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.delattr(filesystem_async, "_get_write_results_queue")
    with pytest.raises(RuntimeError, match="re-check which processes"):
        processes.no_persistent_checkpoint_writers()
