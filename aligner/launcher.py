"""Start a PPO run's processes on one machine and stop them cleanly (used by examples/nlp/gpt/launch_ppo.py).

A run is up to three processes: the reward-model server (unless the critic server also serves
rewards, or the reward is a Python function), the critic server, and the actor (under torchrun
when it has several processes). Servers start first; the actor starts once every server printed
its ready line; when the actor ends the servers get SIGTERM, then SIGKILL if they have not exited
after a grace period; whatever a process leaves in its process group (even after it was killed)
is killed with it. Each process's output goes to `<log_dir>/<name>.log` and, prefixed with its
name, to the launcher's stdout.

SIGTERM or SIGINT to the launcher is passed on in order: the actor first (it stops at its next
step boundary and saves itself and the critic, within its checkpoint.stop_grace_s), then the
servers; each is killed if it has not exited within its grace period, and the launcher exits
128 + the signal number. A second signal kills every process at once. The children get SIGTERM
from the kernel if the launcher itself dies (even by SIGKILL; Linux, aligner/runtime/processes.py).
"""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from aligner.runtime import processes, stopping
from aligner.runtime.errors import ConfigError, UserError

READY_MARKER = "server ready on"
STOP_GRACE_S = 20.0  # how long a server may take to exit after SIGTERM
# The actor may take its checkpoint.stop_grace_s to save after SIGTERM (the trainers' default is
# 600 s); the launcher waits that long plus this margin for it to exit.
ACTOR_EXIT_MARGIN_S = 30.0


class LaunchError(UserError, RuntimeError):
    """A launch argument is wrong, or a process of the job failed in a way the message explains."""


@dataclass
class ManagedProcess:
    """A child process whose output is copied to a log file and the console by a reader thread."""

    name: str
    command: list
    log_path: Path
    echo: bool = True
    process: Optional[subprocess.Popen] = None
    ready: threading.Event = field(default_factory=threading.Event)
    _reader: Optional[threading.Thread] = None

    def start(self, env: dict) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Own process group: a Ctrl-C in the terminal reaches the launcher, which stops children in order.
        # preexec: SIGTERM to the child if the launcher dies without stopping it (e.g. SIGKILL).
        self.process = subprocess.Popen([str(c) for c in self.command], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                                        start_new_session=True, preexec_fn=processes.preexec_die_with_parent())
        self._reader = threading.Thread(target=self._copy_output, daemon=True, name=f"{self.name}-output")
        self._reader.start()

    def _copy_output(self) -> None:
        with open(self.log_path, "a") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if READY_MARKER in line:
                    self.ready.set()
                if self.echo:
                    sys.stdout.write(f"[{self.name}] {line}")
                    sys.stdout.flush()

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready.wait(0.2):
            if not self.running():
                raise LaunchError(f"{self.name} exited with code {self.process.returncode} before it was ready; "
                                  f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{self.name} was not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        if self.process is None:
            return
        if self.running():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Whatever the child left behind in its process group goes too: a killed or crashed actor
        # does not reap its own children (torch.compile's worker pool, which megatron-core's fused
        # kernels start), and they would outlive the job.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._reader is not None:
            self._reader.join(timeout=5)

    def kill(self) -> None:
        """SIGKILL to the child's whole process group, now."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def actor_rollouts_per_step(actor_cfg) -> tuple[int, str]:
    """(rollouts the PPO actor generates per step, the actor settings that say so). One critic_train
    request carries exactly these rollouts."""
    return actor_cfg.rollouts_per_step, "rollout.prompts_per_step x rollout.samples_per_prompt"


def check_critic_fits_actor(critic_cfg, actor_cfg, critic_data_parallel_size: Optional[int] = None) -> None:
    """Refuse, before anything starts, a critic server that would reject the actor's first critic_train
    request (a ConfigError naming the critic's and the actor's keys).

    critic_cfg: the critic server's config (servers/critic.py); actor_cfg: the PPO actor's config;
    critic_data_parallel_size: the critic job's data-parallel size, if known.
    """
    rollouts, rollouts_key = actor_rollouts_per_step(actor_cfg)
    train, server = critic_cfg.train, critic_cfg.server
    if rollouts % train.global_batch_size:
        raise ConfigError(f"the critic's train.global_batch_size={train.global_batch_size} must divide the actor's "
                          f"{rollouts} rollouts per step ({rollouts_key}): each critic_train request is one step's "
                          f"rollouts")
    if rollouts > server.max_train_rows:
        raise ConfigError(f"the actor's {rollouts} rollouts per step ({rollouts_key}) are more than the critic's "
                          f"server.max_train_rows={server.max_train_rows} rows of one critic_train request")
    # The largest request the actor can send: token ids (8 bytes) of the longest prompt + response,
    # returns and old values (4 bytes each) per response token, two lengths per row.
    longest_response = actor_cfg.generation.max_new_tokens
    longest_row = actor_cfg.data.max_prompt_length + longest_response
    largest_request = rollouts * (8 * longest_row + 8 * longest_response + 16)
    if largest_request > server.max_request_bytes:
        raise ConfigError(
            f"a critic_train request of the actor's {rollouts} rollouts ({rollouts_key}) of up to "
            f"data.max_prompt_length + generation.max_new_tokens = {longest_row} tokens can carry {largest_request} "
            f"bytes, more than the critic's server.max_request_bytes={server.max_request_bytes}")
    if critic_data_parallel_size is not None:
        critic_cfg.validate_layout(critic_data_parallel_size)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def actor_command(script: Path, nproc: int, overrides: Sequence[str], stop_grace_s: Optional[float] = None,
                  master_port: int = 0) -> list:
    """The command of one process (nproc=1) or of torchrun with nproc workers; stop_grace_s: how long
    torchrun lets its workers stop after it forwarded a SIGTERM (its default is 30 s); master_port: the
    workers' rendezvous port (torchrun's --master_port), 0: a free one."""
    if nproc == 1:
        return [sys.executable, script, *overrides]
    shutdown = [f"--shutdown-timeout={math.ceil(stop_grace_s)}"] if stop_grace_s is not None else []
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={master_port or free_port()}", *shutdown, script, *overrides]


def run_processes(servers: Sequence[ManagedProcess], actor: ManagedProcess, *, ready_timeout_s: float = 300.0,
                  env: Optional[dict] = None, actor_stop_grace_s: float = STOP_GRACE_S) -> int:
    """Start the servers, then the actor; return the actor's exit code after stopping the servers,
    or 128 + the signal number when the launcher got SIGTERM/SIGINT (see the module docstring).

    actor_stop_grace_s: how long the actor may take to exit after SIGTERM (give its
    checkpoint.stop_grace_s plus a margin). Call from the main thread.
    """
    env = dict(os.environ if env is None else env)
    started: list[ManagedProcess] = []
    stopping_children = threading.Event()

    def on_signal(signum, frame):
        if stopping_children.is_set():  # a second signal, or one while the children are being stopped
            print(f"launcher: {stopping.signal_name(signum)} while stopping: killing every process now", flush=True)
            for process in started:
                process.kill()
            os._exit(stopping.exit_code(signum))
        stopping_children.set()
        raise stopping.Interrupted(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in stopping.HANDLED_SIGNALS}
    try:
        for server in servers:
            server.start(env)
            started.append(server)
        for server in servers:
            server.wait_ready(ready_timeout_s)
        actor.start(env)
        started.append(actor)
        while actor.running():
            time.sleep(0.5)
        return actor.process.returncode  # its output is drained by `stop` below
    except KeyboardInterrupt as interrupt:
        signum = getattr(interrupt, "signal_number", signal.SIGINT)
        print(f"launcher: {stopping.signal_name(signum)}: stopping the actor (it saves a checkpoint), then the "
              f"servers; {stopping.signal_name(signum)} again kills every process now", flush=True)
        return stopping.exit_code(signum)
    finally:
        stopping_children.set()
        for process in reversed(started):  # the actor first: it saves (and has the critic save) while they serve
            process.stop(actor_stop_grace_s if process is actor else STOP_GRACE_S)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
