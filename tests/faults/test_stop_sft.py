"""Graceful stops of a trainer (SFT through its real entry point) and no process left behind.

SIGTERM / SIGINT mid-training: a checkpoint at the stop step, one line saying so, exit 128 + signal,
and the same command resumes to losses bit-identical to an uninterrupted run. Ctrl-C while the run
is still being built: one line. A 2-rank job where one rank gets SIGTERM: both stop at one step with
a complete checkpoint. After kill -9 or SIGTERM of a trainer that has saved, every process it
started is gone.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import REPO_ROOT, free_port_block, metrics_rows, processes_alive, write_jsonl

SFT_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
MAX_STEPS = 400  # ~10 ms each: long enough to be stopped in the middle, short enough to finish


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("stop_sft")
    records = arithmetic.sft_records(256, seed=5)
    train = write_jsonl(root / "train.jsonl", records)
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    common = [
        f"tokenizer.path={root / 'tokenizer'}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
        "data.max_seq_length=16", "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64", "trainer.global_batch_size=8", "trainer.micro_batch_size=4",
        "trainer.val_check_interval=0", "optim.lr=1e-3", "logging.progress_bar=false", "logging.tensorboard=false",
        "logging.peak_tflops=1.0", "checkpoint.save_interval=50", "checkpoint.keep_last=0",
    ]
    return root, common


def _command(sft_data, run: Path, *extra: str) -> list[str]:
    return [sys.executable, str(SFT_SCRIPT), *sft_data[1], f"checkpoint.save_dir={run / 'ckpt'}",
            f"logging.log_dir={run / 'logs'}", *extra]


def _env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _losses(run: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics_rows(run / "logs", "train")}


def _logged_step(run: Path) -> int:
    path = run / "logs" / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [row["step"] for row in metrics_rows(run / "logs", "train")] if path.read_text().endswith("\n") else []
    return max(steps, default=0)


class Run:
    """A trainer (or torchrun) started in the background; every process it starts is recorded."""

    def __init__(self, command: list[str], run: Path):
        run.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.out, self.err = open(run / "stdout.txt", "w"), open(run / "stderr.txt", "w")
        self.process = subprocess.Popen(command, stdout=self.out, stderr=self.err, cwd=REPO_ROOT, env=_env())
        self.descendants: set[psutil.Process] = set()
        self._watching = True
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        # psutil.Process compares by pid and start time: a reused pid is another process.
        root = psutil.Process(self.process.pid)
        while self._watching:
            try:
                self.descendants.update(root.children(recursive=True))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.02)

    def wait_for_step(self, step: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while _logged_step(self.run) < step:
            assert self.process.poll() is None, f"exited {self.process.returncode} early:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"step {step} never came:\n{self.stderr()[-3000:]}"
            time.sleep(0.01)

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self._watching = False

    def stderr(self) -> str:
        self.err.flush()
        return (self.run / "stderr.txt").read_text()

    def left_behind(self, timeout_s: float = 10.0) -> list[str]:
        """Processes this run started that are still alive after timeout_s (zombies count as gone)."""
        self._watching = False
        return processes_alive(self.descendants, timeout_s)

    def close(self) -> None:
        self._watching = False
        for process in [*self.descendants, psutil.Process(self.process.pid) if self.process.poll() is None else None]:
            try:
                if process is not None:
                    process.kill()
            except psutil.NoSuchProcess:
                pass
        self.process.wait(timeout=30)
        self.out.close()
        self.err.close()


def _mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text` (the run's directory)."""
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(text in part for part in process.info["cmdline"] or []) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.info["pid"])
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def uninterrupted(sft_data, tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("uninterrupted")
    result = subprocess.run(_command(sft_data, run, f"trainer.max_steps={MAX_STEPS}"), capture_output=True, text=True,
                            cwd=REPO_ROOT, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(run)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_run_saves_at_the_stop_step_and_resumes_bit_identically(sft_data, uninterrupted, tmp_path, sig):
    command = _command(sft_data, tmp_path, f"trainer.max_steps={MAX_STEPS}")
    run = Run(command, tmp_path)
    try:
        run.wait_for_step(60)  # after the first interval save (step 50): the checkpoint writer has run
        os.kill(run.process.pid, sig)
        code = run.wait()
        stderr = run.stderr()
        assert code == 128 + sig, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
        assert not run.left_behind(), "processes of the stopped trainer are still running"
    finally:
        run.close()
    stopped_at = max(_losses(tmp_path))
    assert 60 <= stopped_at < MAX_STEPS, "the run was not stopped in the middle"
    checkpoint = tmp_path / "ckpt" / f"step_{stopped_at:08d}"
    assert (checkpoint / "aligner_meta.json").is_file()
    name = signal.Signals(sig).name
    assert f"stopped at step {stopped_at} by {name}; checkpoint {checkpoint}; resume with the same command" in stderr

    resumed = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step {stopped_at}" in resumed.stdout
    assert _losses(tmp_path) == uninterrupted  # every step, bit for bit


def test_ctrl_c_while_the_run_is_built_prints_one_line(sft_data, tmp_path):
    """The training data is a FIFO nobody writes: the run waits in data loading, before training."""
    fifo = tmp_path / "train.fifo"
    os.mkfifo(fifo)
    command = _command(sft_data, tmp_path, "trainer.max_steps=5", f"data.train=[{{path: {fifo}}}]")
    run = Run(command, tmp_path)
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # a writer can open the FIFO (without blocking) once the run opened it to read
            try:
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                assert run.process.poll() is None, run.stderr()[-3000:]
                assert time.monotonic() < deadline, "the run never opened the training data"
                time.sleep(0.05)
        time.sleep(0.2)  # the run now waits to read its first line
        os.kill(run.process.pid, signal.SIGINT)
        code = run.wait()
        stderr = run.stderr()
    finally:
        run.close()
        if writer is not None:
            os.close(writer)
    assert code == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "interrupted by SIGINT; exiting"
    assert "Traceback" not in stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_no_process_outlives_a_trainer_that_has_saved(sft_data, tmp_path, sig):
    """Before the fix megatron's checkpoint writer left a Manager server (~280 MB) and a resource
    tracker behind after every kill, owned by PID 1 forever."""
    baseline = _mentioning(str(tmp_path))
    run = Run(_command(sft_data, tmp_path, "trainer.max_steps=100000", "checkpoint.save_interval=5"), tmp_path)
    try:
        run.wait_for_step(30)  # several saves done
        os.kill(run.process.pid, sig)
        code = run.wait()
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 143), run.stderr()[-3000:]
        assert not run.left_behind(), "processes of the killed trainer are still running"
        assert _mentioning(str(tmp_path)) == baseline
    finally:
        run.close()


def _torchrun_command(sft_data, run: Path, *extra: str) -> list[str]:
    """The SFT command under torchrun with 2 ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port_block(1)}", *_command(sft_data, run, *extra)[1:]]


def _workers(run: Run) -> list[psutil.Process]:
    """The trainer processes torchrun started."""
    return [child for child in psutil.Process(run.process.pid).children(recursive=True)
            if str(SFT_SCRIPT) in " ".join(child.cmdline())]


@pytest.mark.distributed
@pytest.mark.slow
def test_workers_of_a_killed_torchrun_stop_and_save_instead_of_running_on(sft_data, tmp_path):
    """torchrun starts each worker in a session of its own: a SIGKILL of torchrun (all `kill -9` or a killpg of
    its group reaches) used to leave both ranks training, owned by PID 1. They now get SIGTERM as their parent
    dies, and stop at one step with a complete checkpoint, as if torchrun had forwarded a SIGTERM."""
    run = Run(_torchrun_command(sft_data, tmp_path, "trainer.max_steps=100000"), tmp_path)
    try:
        run.wait_for_step(20)
        workers = _workers(run)
        assert len(workers) == 2
        os.kill(run.process.pid, signal.SIGKILL)  # torchrun only
        assert run.wait() == -signal.SIGKILL
        gone, alive = psutil.wait_procs(workers, timeout=60)
        assert not alive, f"workers still running after torchrun was killed: {alive}"
        stderr = run.stderr()
        assert not run.left_behind()
    finally:
        run.close()
    stopped_at = max(_losses(tmp_path))
    assert f"stopped at step {stopped_at} by SIGTERM" in stderr, stderr[-3000:]
    assert (tmp_path / "ckpt" / f"step_{stopped_at:08d}").is_dir()


@pytest.mark.distributed
@pytest.mark.slow
def test_one_rank_signalled_stops_both_at_one_step_with_a_complete_checkpoint(sft_data, tmp_path):
    command = _torchrun_command(sft_data, tmp_path, f"trainer.max_steps={MAX_STEPS}")
    run = Run(command, tmp_path)
    try:
        run.wait_for_step(20)
        ranks = {int(worker.environ()["RANK"]): worker for worker in _workers(run)}
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1].pid, signal.SIGTERM)  # only rank 1: rank 0 learns of it at the step boundary
        code = run.wait()
        stderr = run.stderr()
        assert not run.left_behind()
    finally:
        run.close()
    assert code != 0, stderr[-3000:]
    # torchrun itself reports the workers' non-zero exit with a traceback of its own; the workers print none.
    # (Our frames only: a clone's .venv lies under the repository root too, and torchrun's frames are there.)
    assert not re.search(rf'File "{re.escape(str(REPO_ROOT))}/(aligner|servers|examples)/', stderr), stderr[-3000:]
    stopped_at = max(_losses(tmp_path))
    assert stopped_at < MAX_STEPS
    checkpoint = tmp_path / "ckpt" / f"step_{stopped_at:08d}"
    assert f"stopped at step {stopped_at} by SIGTERM; checkpoint {checkpoint}; resume with the same command" in stderr
    # Complete: both ranks wrote their part (a collective save), and a run resumes from it.
    resumed = subprocess.run([*command[:5], f"--master_port={free_port_block(1)}", *command[6:]], capture_output=True,
                             text=True, cwd=REPO_ROOT, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} at step {stopped_at}" in resumed.stdout
    assert max(_losses(tmp_path)) == MAX_STEPS
