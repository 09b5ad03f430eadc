"""A generation worker: the native engine in a process of its own, fed prompts and weights by the trainer.

Asynchronous RL (`aligner.algorithms.rl_async`) generates the next steps' rollouts here while the trainer
trains on the current one. The worker holds its own copy of the policy (megatron-core chunks at TP=PP=1, LoRA
adapters where the trainer has them) and a `NativeEngine` on it; it answers commands from one queue, in order:

  ("weights", version, names)         copy those parameters from the shared buffers, refit; answers "loading"
                                      before the copy and "loaded" after it
  ("generate", step, work, params)    generate the step's work with the program (`WorkerSpec.program`) and
                                      answer "generated" with what it made and the weight version that made it;
                                      the default program takes the step's prompts (token-id lists) through the
                                      same `collect_rollouts` a synchronous step uses, those of its trainer
                                      rank's micro-batches (all of them with one trainer process), and answers
                                      the rows by position; multi-turn episodes have their own
                                      (`aligner.algorithms.rl_episodes.WorkerEpisodes`)
  ("stop",)                           exit

The weights travel through shared-memory tensors (`SharedWeights`, written by the trainer, read here): one
host copy of the parameters, no pickling per update. The trainer writes version v + 1 only after the worker
said "loaded" for v, so a copy is never torn. Because commands are taken in order, the version that
generates a step is fixed by when the trainer sent the step, not by timing: a run is reproducible.

`GenerationWorker` is the trainer's handle: start (wait for "ready"), send weights and requests, receive
answers with a deadline, notice a worker that died or went silent, stop it (no process outlives the trainer:
the worker gets SIGKILL from the kernel when the trainer dies, and is killed when the handle closes).

On another host the same worker is a server (`serve`, examples/nlp/gpt/serve_generation_worker.py): the
trainer's `RemoteGenerationWorker` connects over TCP, sends ("start", WorkerSpec), then the same commands, a
"weights" command carrying its tensors; both sides hold ALIGNER_WORKER_KEY. `WorkerPool` makes several such
workers one handle for a trainer rank, each generating its share of the rank's micro-batches.
"""
from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import pickle
import queue
import random
import signal
import socket
import threading
import time
import traceback
from multiprocessing import connection
from typing import Optional

import torch
import torch.multiprocessing as mp

from aligner.generation.native import NativeEngine
from aligner.generation.rollouts import RolloutRow, collect_rollouts
from aligner.generation.router_client import StaticRouter
from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.models.lora import PEFTConfig, apply_lora
from aligner.models.weight_swap import named_parameters
from aligner.runtime import distributed, processes
from aligner.runtime.errors import UserError
from aligner.tokenizer import Tokenizer

# The launcher's variables: the worker is a world of its own (one process), never a rank of the trainer's.
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")
# Fault injection for the tests (tests/unit/test_async_rl.py): "die_at_step:N", "stall_at_step:N",
# "stall_weights_at:V" make the worker exit, hang in a generation or hang in a weight copy (once, when
# FAULT_ONCE_VARIABLE names a file: the fault creates it and does not fire again while it exists);
# "delay:SECONDS:SEED" sleeps a random 0..SECONDS before each command.
FAULT_VARIABLE = "ALIGNER_GENERATION_WORKER_FAULT"
FAULT_ONCE_VARIABLE = "ALIGNER_GENERATION_WORKER_FAULT_ONCE"


class GenerationWorkerError(UserError, RuntimeError):
    """The generation worker died, went silent, or could not start (one line naming it and what it was doing)."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker builds: the policy's architecture and adapters, its tokenizer, the engine's limits."""

    model_config: dict  # GPTConfig.to_dict() of the trainer's model
    params_dtype: torch.dtype
    peft: Optional[PEFTConfig]  # LoRA adapters as the trainer has them, or None
    seed: int
    tokenizer_dir: str
    micro_batch_size: int  # prompts per router hand-out, the engine's cache rows
    max_sequence_length: int
    threads: int  # torch threads of the worker
    replica: int = 0  # the trainer's data-parallel rank: the worker generates the micro-batches the
    replicas: int = 1  # synchronous run's static router hands that rank (micro-batch b when b mod replicas = replica)
    # What a "generate" command runs: None, single-turn rollouts (`SingleTurnRollouts`); else a picklable object
    # like it (open(engine, tokenizer, spec) -> generate(work, sampling, version) -> a picklable answer; close()).
    # Given as an object, not imported here: programs of higher layers (episodes and their environments) plug in.
    program: Optional[object] = None


class SingleTurnRollouts:
    """The worker's default program: a step's prompts (token-id lists) as rows by position (`_compact`)."""

    def open(self, engine, tokenizer, spec: WorkerSpec):
        router = StaticRouter(micro_batch_size=spec.micro_batch_size, replica=spec.replica, replicas=spec.replicas)
        return lambda prompts, sampling, version: _compact(collect_rollouts(engine, router, prompts, sampling))

    def close(self) -> None:
        pass


class SharedWeights:
    """The policy's parameters in shared memory, by name (`aligner.models.weight_swap.named_parameters`)."""

    def __init__(self, chunks):
        named = named_parameters(chunks)
        self.tensors = {name: param.detach().clone().share_memory_() for name, param in named}
        self.trainable = [name for name, param in named if param.requires_grad]

    @torch.no_grad()
    def write(self, chunks, names) -> None:
        wanted = set(names)
        for name, param in named_parameters(chunks):
            if name in wanted:
                self.tensors[name].copy_(param.detach())

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _fault(kind: str, value: int) -> bool:
    name, _, number = os.environ.get(FAULT_VARIABLE, "").partition(":")
    if name != kind or not number.isdigit() or int(number) != value:
        return False
    once = os.environ.get(FAULT_ONCE_VARIABLE)
    if once:
        try:
            with open(once, "x"):
                pass
        except FileExistsError:
            return False
    return True


def _delays():
    """The random sleeps of a "delay:SECONDS:SEED" fault (an endless iterator of seconds), or None."""
    kind, _, rest = os.environ.get(FAULT_VARIABLE, "").partition(":")
    if kind != "delay":
        return None
    seconds, _, seed = rest.partition(":")
    draw = random.Random(int(seed or 0))
    return iter(lambda: draw.uniform(0.0, float(seconds)), None)


def _compact(rows: dict) -> dict:
    """Rows by position as plain lists (cheap to pickle, no shared-memory handle per tensor)."""
    return {position: (row.prompt, row.response.tolist(), row.logprobs.tolist(), row.ended_with_stop)
            for position, row in rows.items()}


def rows_from_compact(compact: dict, logprob_dtype: torch.dtype = torch.float32) -> dict:
    """`_compact`'s rows as RolloutRows again (the same values: float32 -> Python float -> float32 is exact)."""
    return {position: RolloutRow(prompt=list(prompt), response=torch.tensor(response, dtype=torch.long),
                                 logprobs=torch.tensor(logprobs, dtype=logprob_dtype), ended_with_stop=stopped)
            for position, (prompt, response, logprobs, stopped) in compact.items()}


def worker_main(spec: WorkerSpec, weights: dict, commands, answers, parent: int) -> None:
    """The worker process beside the trainer: build, say "ready", then serve commands until "stop" (or the
    trainer's death)."""
    processes.die_with_parent(signal.SIGKILL, parent)
    # A terminal's Ctrl-C or a scheduler's SIGTERM reaches the whole process group: the trainer stops at a step
    # boundary and needs the worker until its checkpoint is written; it stops the worker itself (or dies, and
    # the kernel kills the worker).
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)

    def die() -> None:
        answers.close()
        answers.join_thread()  # what was answered reaches the trainer; then the abrupt exit
        os._exit(3)

    if not _serve_commands(spec, weights, commands.get, answers.put, die):
        raise SystemExit(1)


def _serve_commands(spec: WorkerSpec, weights: Optional[dict], receive, answer, die) -> bool:
    """Build the policy and engine of `spec`, answer "ready", then serve commands in order until "stop" (or
    `receive()` returns None: the trainer is gone). weights: the shared tensors a "weights" command names, or None
    when each command carries its tensors (a worker server). False when it failed (the error answered)."""
    for name in _LAUNCH_VARIABLES:
        os.environ.pop(name, None)
    program = spec.program or SingleTurnRollouts()
    try:
        distributed.initialize(distributed.ParallelConfig())
        torch.manual_seed(spec.seed)
        model_cfg = GPTConfig.from_dict(spec.model_config)
        chunks = build_model_chunks(model_cfg, distributed.ParallelConfig(), spec.params_dtype)
        if spec.peft is not None:
            apply_lora(chunks, spec.peft, spec.seed)
        for chunk in chunks:
            chunk.eval()
        named = dict(named_parameters(chunks))
        if weights is not None and set(named) != set(weights):
            missing = sorted(set(weights) ^ set(named))[:3]
            raise RuntimeError(f"the worker's model does not match the trainer's (parameters {missing} differ)")
        tokenizer = Tokenizer(spec.tokenizer_dir)
        # The weights arrive with the trainer's first "weights" command, sent right after the start.
        engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                              max_batch_size=spec.micro_batch_size, max_sequence_length=spec.max_sequence_length,
                              decode=tokenizer.decode)
        generate = program.open(engine, tokenizer, spec)
        answer(("ready", os.getpid(), socket.gethostname()))
        version: Optional[int] = None
        delays = _delays()
        idle_since = time.perf_counter()
        while True:
            command = receive()
            idle = time.perf_counter() - idle_since
            kind = None if command is None else command[0]
            if delays is not None:
                time.sleep(next(delays))
            if kind in ("stop", None):
                return True
            if kind == "weights":
                _, version, given = command
                answer(("loading", version))
                tick = time.perf_counter()
                if _fault("stall_weights_at", version):
                    time.sleep(3600)
                source = given if isinstance(given, dict) else {name: weights[name] for name in given}
                unknown = sorted(set(source) - set(named))[:3]
                if unknown:
                    raise RuntimeError(f"the worker's model does not match the trainer's (no parameters {unknown})")
                with torch.no_grad():
                    for name, tensor in source.items():
                        named[name].copy_(tensor)
                engine.refit(chunks)  # the packed copies of the weights made again from the new values
                answer(("loaded", version, time.perf_counter() - tick, idle))
            elif kind == "generate":
                _, step, work, sampling = command
                if _fault("die_at_step", step):
                    die()
                if _fault("stall_at_step", step):
                    time.sleep(3600)
                tick = time.perf_counter()
                made = generate(work, sampling, version)
                answer(("generated", step, version, made,
                        {"generation_s": time.perf_counter() - tick, "idle_s": idle}))
            else:
                raise RuntimeError(f"unknown command {kind!r}")
            idle_since = time.perf_counter()
    except Exception as error:  # noqa: BLE001 - the trainer gets the one line; the traceback goes to stderr
        traceback.print_exc()
        answer(("error", f"{type(error).__name__}: {error}"))
        return False
    finally:
        program.close()  # (an episode program's environment processes)
        distributed.shutdown()


class _Handle:
    """What the trainer's handles on a worker share: what it builds, the weights it is sent, how long it may take
    to start (building its model and engine), and `receive` over the handle's own `poll` (each wait's silence
    limit is the caller's: a generation's, a weight copy's)."""

    def __init__(self, spec: WorkerSpec, weights: SharedWeights, *, start_timeout_s: float = 300.0):
        self.spec = spec
        self.weights = weights
        self.start_timeout_s = start_timeout_s

    def receive(self, silence_timeout_s: float, doing: str) -> tuple:
        """The worker's next answer; GenerationWorkerError (one line, naming the worker and `doing`) when it
        exited or lost its connection, reported an error, or said nothing for silence_timeout_s seconds."""
        deadline = time.monotonic() + silence_timeout_s
        while True:
            answer = self.poll(min(1.0, max(deadline - time.monotonic(), 0.01)), doing)
            if answer is not None:
                return answer
            if time.monotonic() > deadline:
                raise GenerationWorkerError(f"{self.name} said nothing for {silence_timeout_s:g} s while {doing}: "
                                            "stalled")


class GenerationWorker(_Handle):
    """The trainer's handle on one worker process (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, weights: SharedWeights, **timeouts):
        super().__init__(spec, weights, **timeouts)
        self.context = mp.get_context("spawn")
        self.process = None
        self.commands = self.answers = None

    @property
    def pid(self) -> Optional[int]:
        return None if self.process is None else self.process.pid

    @property
    def name(self) -> str:
        return f"the generation worker (pid {self.pid})"

    def start(self) -> None:
        self.commands, self.answers = self.context.Queue(), self.context.Queue()
        self.process = self.context.Process(
            target=worker_main, name="generation-worker", daemon=True,
            args=(self.spec, self.weights.tensors, self.commands, self.answers, os.getpid()))
        self.process.start()
        # Before multiprocessing's own exit hook, which would SIGTERM (ignored here) and wait for the worker.
        atexit.register(self.close)
        answer = self.receive(self.start_timeout_s, "starting")
        if answer[0] != "ready":
            raise GenerationWorkerError(f"{self.name} sent {answer[0]!r} instead of 'ready' while starting")

    def send(self, *command) -> None:
        self.commands.put(command)

    def poll(self, timeout_s: float, doing: str) -> Optional[tuple]:
        """The next answer if one comes within timeout_s, else None; GenerationWorkerError when the worker
        exited or reported an error."""
        try:
            answer = self.answers.get(timeout=max(timeout_s, 0.001))
        except queue.Empty:
            if not self.process.is_alive():
                raise GenerationWorkerError(f"{self.name} exited with code {self.process.exitcode} while "
                                            f"{doing}") from None
            return None
        return _checked(self, answer, doing)

    def close(self) -> None:
        """Stop the worker (asked first, killed if it does not exit within 5 s); idempotent."""
        if self.process is None:
            return
        if self.process.is_alive():
            try:
                self.commands.put(("stop",))
            except (OSError, ValueError):
                pass
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for channel in (self.commands, self.answers):
            channel.cancel_join_thread()
            channel.close()
        self.process = None
        atexit.unregister(self.close)


def _checked(worker, answer: tuple, doing: str) -> tuple:
    """`answer`, unless it says the worker failed ("error") or its connection ended ("lost": a worker server)."""
    if answer[0] == "error":
        raise GenerationWorkerError(f"{worker.name} failed while {doing}: {answer[1]}")
    if answer[0] == "lost":
        raise GenerationWorkerError(f"{worker.name} {answer[1]} while {doing}")
    return answer


# -- a worker on another host: the same commands over TCP
# The shared secret both sides must hold: messages are pickles, so a worker server only talks to a trainer that
# proves it knows the key (multiprocessing.connection's HMAC challenge), and never listens without one.
KEY_VARIABLE = "ALIGNER_WORKER_KEY"


def worker_key() -> bytes:
    key = os.environ.get(KEY_VARIABLE, "")
    if not key:
        raise UserError(f"{KEY_VARIABLE} is not set: a generation worker server and its trainer share a secret key "
                        f"(e.g. export {KEY_VARIABLE}=$(openssl rand -hex 16) in the job, before both start)")
    return key.encode()


def parse_address(address: str, key: str) -> tuple[str, int]:
    """"host:port" as (host, port); one line naming `key` otherwise."""
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"{key}: {address!r} is not HOST:PORT")
    return host, int(port)


def _send(connection, message) -> None:
    # By value (the standard pickler): torch.multiprocessing's reducers would send tensors as shared-memory handles.
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _reader(connection, inbox: "queue.Queue") -> None:
    """A thread that moves every message arriving on `connection` into `inbox`, so neither side's sends wait
    for the other to read; at the end of the connection it puts ("lost", why)."""

    def read() -> None:
        try:
            while True:
                inbox.put(pickle.loads(connection.recv_bytes()))
        except (EOFError, OSError) as error:
            inbox.put(("lost", "closed the connection" if isinstance(error, EOFError) else f"lost the connection "
                       f"({error.strerror or error})"))

    threading.Thread(target=read, name="worker-connection-reader", daemon=True).start()


def serve(host: str, port: int, threads: int, address_file: Optional[str] = None) -> None:
    """A generation worker server: one trainer at a time connects, sends ("start", WorkerSpec) and then the
    commands `worker_main` takes (a "weights" command carrying its tensors); when that trainer disconnects, the
    next may connect. Runs until SIGTERM or SIGINT. address_file: "host:port" is written there once listening
    (host as given: the name the trainer reaches it by)."""
    key = worker_key()
    torch.set_num_threads(threads)
    try:
        listener = connection.Listener((host, port), authkey=key)
    except OSError as error:
        raise UserError(f"the generation worker server cannot listen on {host}:{port}: {error.strerror}") from None
    with listener:
        port = listener.address[1]
        print(f"generation worker server ready on {host}:{port} ({listener.address[0]}; pid {os.getpid()}, "
              f"{threads} thread(s))", flush=True)
        if address_file:
            partial = f"{address_file}.partial"
            with open(partial, "w") as file:
                file.write(f"{host}:{port}\n")
            os.replace(partial, address_file)
        while True:
            try:
                peer = listener.accept()
            except (connection.AuthenticationError, OSError) as error:
                print(f"refused a connection: {type(error).__name__}: {error}", flush=True)
                continue
            with peer:
                _serve_trainer(peer)


def _serve_trainer(peer) -> None:
    """One trainer's session on a worker server: its ("start", spec), then its commands until it leaves."""
    inbox: queue.Queue = queue.Queue()
    _reader(peer, inbox)
    first = inbox.get()
    if first[0] != "start":
        print(f"a connection sent {first[0]!r} instead of 'start'; closed", flush=True)
        return
    spec = first[1]
    print(f"serving a trainer ({spec.model_config.get('num_layers', '?')} layers, replica {spec.replica + 1} of "
          f"{spec.replicas})", flush=True)

    def receive():
        command = inbox.get()
        return None if command[0] == "lost" else command

    def answer(message) -> None:
        try:
            _send(peer, message)
        except OSError:
            pass  # the trainer is gone; the next receive() says so

    def die() -> None:
        peer.close()
        os._exit(3)

    done = _serve_commands(spec, None, receive, answer, die)
    print(f"the trainer {'disconnected' if done else 'was sent the error above'}; waiting for the next", flush=True)


class RemoteGenerationWorker(_Handle):
    """The trainer's handle on a worker server at `address` ("host:port"): `GenerationWorker`'s interface over
    TCP. The weights of a "weights" command travel in it, read from `weights` (the trainer's host copy)."""

    def __init__(self, address: str, spec: WorkerSpec, weights: SharedWeights, **timeouts):
        super().__init__(spec, weights, **timeouts)
        self.address = address
        self.connection = None
        self.inbox: queue.Queue = queue.Queue()
        self.pid: Optional[int] = None

    @property
    def name(self) -> str:
        return f"the generation worker at {self.address}" + (f" (pid {self.pid})" if self.pid else "")

    def start(self) -> None:
        host, port = parse_address(self.address, "rollout.asynchronous.workers")
        key = worker_key()
        done: "queue.Queue" = queue.Queue()

        def connect() -> None:  # (Client has no timeout of its own: a server that accepts no one would hang it)
            try:
                done.put(connection.Client((host, port), authkey=key))
            except (OSError, connection.AuthenticationError) as error:
                done.put(error)

        threading.Thread(target=connect, name="worker-connect", daemon=True).start()
        try:
            result = done.get(timeout=self.start_timeout_s)
        except queue.Empty:
            raise GenerationWorkerError(f"{self.name} did not accept a connection within {self.start_timeout_s:g} s "
                                        "(busy with another trainer, or stalled)") from None
        if isinstance(result, BaseException):
            why = ("the keys differ: set the same ALIGNER_WORKER_KEY on both sides"
                   if isinstance(result, connection.AuthenticationError) else
                   getattr(result, "strerror", None) or str(result) or type(result).__name__)
            raise GenerationWorkerError(f"cannot reach {self.name}: {why}")
        self.connection = result
        _reader(self.connection, self.inbox)
        self.send("start", self.spec)
        answer = self.receive(self.start_timeout_s, "starting")
        if answer[0] != "ready":
            raise GenerationWorkerError(f"{self.name} sent {answer[0]!r} instead of 'ready' while starting")
        self.pid = answer[1]

    def send(self, *command) -> None:
        if command[0] == "weights":
            _, version, names = command
            command = ("weights", version, {name: self.weights.tensors[name] for name in names})
        try:
            _send(self.connection, command)
        except OSError as error:
            self.inbox.put(("lost", f"lost the connection ({error.strerror or error})"))

    def poll(self, timeout_s: float, doing: str) -> Optional[tuple]:
        try:
            answer = self.inbox.get(timeout=max(timeout_s, 0.001))
        except queue.Empty:
            return None
        return _checked(self, answer, doing)

    def close(self) -> None:
        """Tell the server this trainer is done (it then waits for the next); idempotent."""
        if self.connection is None:
            return
        try:
            _send(self.connection, ("stop",))
        except OSError:
            pass
        self.connection.close()
        self.connection = None


class WorkerPool:
    """Several workers for one trainer rank, with `GenerationWorker`'s interface: each member is sent every
    command and generates its own share of the rank's micro-batches (its spec's replica among replicas: the
    static router's split, so which member makes a rollout changes nothing in it). Members take the same
    commands in the same order, so they answer in the same order; the pool answers once all members have,
    merged (the rollouts of a step joined by position, the slowest member's seconds)."""

    POLL_S = 0.02  # how long one member is listened to before the next, while the pool waits

    def __init__(self, members: list):
        self.members = members
        self.pending: list[collections.deque] = [collections.deque() for _ in members]

    @property
    def name(self) -> str:
        return "the generation workers " + ", ".join(member.name.removeprefix("the generation worker ")
                                                      for member in self.members)

    @property
    def pid(self) -> Optional[int]:
        return None

    def start(self) -> None:
        try:
            for member in self.members:
                member.start()
        except BaseException:
            self.close()
            raise

    def send(self, *command) -> None:
        for member in self.members:
            member.send(*command)

    def receive(self, silence_timeout_s: float, doing: str) -> tuple:
        """Every member's next answer, merged; GenerationWorkerError naming the member that failed, or the
        first that said nothing for silence_timeout_s seconds."""
        deadline = time.monotonic() + silence_timeout_s
        while not all(self.pending):
            for member, pending in zip(self.members, self.pending):
                if not pending:
                    answer = member.poll(self.POLL_S, doing)
                    if answer is not None:
                        pending.append(answer)
            if not all(self.pending) and time.monotonic() > deadline:
                silent = next(member for member, pending in zip(self.members, self.pending) if not pending)
                raise GenerationWorkerError(f"{silent.name} said nothing for {silence_timeout_s:g} s while {doing}: "
                                            "stalled")
        answers = [pending.popleft() for pending in self.pending]
        if len({answer[:2] for answer in answers}) != 1:
            raise GenerationWorkerError(f"{self.name} answered out of step while {doing}: "
                                        f"{[answer[:2] for answer in answers]}")
        kind = answers[0][0]
        if kind == "loaded":
            return ("loaded", answers[0][1], max(answer[2] for answer in answers),
                    max(answer[3] for answer in answers))
        if kind == "generated":
            made = {}
            for answer in answers:
                made.update(answer[3])
            seconds = {key: max(answer[4][key] for answer in answers) for key in answers[0][4]}
            return ("generated", answers[0][1], answers[0][2], made, seconds)
        return answers[0]

    def close(self) -> None:
        for member in self.members:
            member.close()
