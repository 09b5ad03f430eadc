"""Reward sources of the RL actors and rejection sampling, and the checks every score passes.

    source = RuleRewardSource("package.module:function", checks)     # or RewardServerSource(client, ...)
    pending = source.score_async(sequences, prompts, response_texts, records)   # scoring starts
    scores = pending.result()                                        # Scores: values [B], replaced [B]

Sources answer `score_async(sequences, prompts, response_texts, records)`: sequences are the prompt +
response token ids (what a reward model reads), prompts as the data gave them (text or messages, what a
reward function reads), records where each prompt came from ("file:line", for messages).

Every score is checked where it is produced, by one `ScoreCheck`: a real number (int, float, a numpy
scalar; not a str, bool, None or list), finite, |score| <= max_abs, one per response. A bad score ends
the run with one line naming the function or server, the prompt's record and the value, or, with
on_invalid=replace, is replaced by invalid_value and counted (each row says whether its score was).

A reward function runs on a thread of its own, one call at a time, and gets a deep copy of its prompt
(a function that edits it cannot change the data set for later samples). An exception inside it, or a
call that runs longer than timeout_s, ends the run with one line naming the function and the prompt's
record. A Python thread cannot be killed: the worker is a daemon thread, so the process exits without
it. `PendingScores.result()` polls the stop flag (aligner/runtime/stopping.py): after SIGTERM/SIGINT the
wait goes on while scores keep arriving, and ends the run once none arrived for STOP_PATIENCE_S.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import math
import numbers
import sys
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from aligner.config import one_of
from aligner.runtime import stopping
from aligner.runtime.errors import ConfigError, UserError

ON_INVALID = ("error", "replace")
# After a stop request, how long a wait for scores goes on without any score arriving: a healthy source
# answers well within it (the step then ends at its boundary with a checkpoint); a hung one is given up.
STOP_PATIENCE_S = 3.0
_POLL_S = 0.1  # how often a wait looks at the stop flag, and an idle timeout watchdog at the running call


class RewardError(UserError):
    """A reward function or server gave no usable score; the message names it, the prompt's record and why."""


@dataclass
class RewardChecks:
    """The score checks of a `reward:` section (the RL actors' and rejection sampling's)."""

    timeout_s: float = 60.0  # source=function: the longest one call may take; past it the run ends
    # Scores become float32 tensors whose squares are summed (the reward std, whitening): past ~1e19 that is
    # inf. Reward models and rule rewards score in units to hundreds, so a score beyond 1e6 is a bug (an
    # overflow, an unnormalised model) that would swamp the step's advantages; a task on a larger scale
    # raises the bound.
    max_abs: float = 1.0e6
    on_invalid: str = one_of(ON_INVALID, "error")  # error: the run ends | replace: invalid_value, counted
    invalid_value: float = 0.0

    def check_fields(self) -> Optional[tuple[str, str]]:
        if not self.timeout_s > 0:
            return "timeout_s", "must be > 0 (seconds one call of the reward function may take)"
        if not 0 < self.max_abs < math.inf:
            return "max_abs", "must be a finite number > 0"
        if not abs(self.invalid_value) <= self.max_abs:
            return "invalid_value", f"must be a finite number with |invalid_value| <= max_abs={self.max_abs:g}"
        return None


@dataclass
class Scores:
    """The checked scores of one request."""

    values: torch.Tensor  # [B] float32
    replaced: torch.Tensor  # [B] bool: invalid, replaced by invalid_value (on_invalid=replace)

    @classmethod
    def of(cls, values: Sequence[float]) -> "Scores":
        """Scores of trusted values, none replaced (in-process sources of tests and benchmarks)."""
        values = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        return cls(values, torch.zeros(len(values), dtype=torch.bool))


def score_problem(value, max_abs: float) -> tuple[float, Optional[str]]:
    """(the score as a float, None) or (nan, why it is not a valid score)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()  # a 0-dim tensor or array holds one number (or one bool, refused below)
    if isinstance(value, (bool, np.bool_)):
        return math.nan, "a bool is not a score (return a number, e.g. 1.0 for a pass)"
    if value is None:
        return math.nan, "a score must be a number (does the function miss a `return`?)"
    if isinstance(value, (str, bytes)):
        return math.nan, f"a {type(value).__name__} is not a score (return a number, not its text)"
    if not isinstance(value, numbers.Real):
        return math.nan, f"a {type(value).__name__} is not a score (one real number per response)"
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        return math.nan, "a score must be finite"
    if abs(number) > max_abs:
        return math.nan, f"|score| must be <= reward.max_abs={max_abs:g}"
    return number, None


def _truncated(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _shown(value) -> str:
    return _truncated(repr(value), 60)


class ScoreCheck:
    """Checks the scores of one producer (a function, a server): `check(values, records) -> Scores`."""

    def __init__(self, producer: str, checks: RewardChecks):
        self.producer, self.checks = producer, checks
        self._warned = False  # on_invalid=replace: the first replacement is said in the log, the rest counted

    def __call__(self, values: Sequence, records: Sequence[str]) -> Scores:
        if len(values) != len(records):
            raise RewardError(f"{self.producer} returned {len(values)} scores for {len(records)} responses")
        numbers_, replaced = [], []
        for value, record in zip(values, records):
            number, problem = score_problem(value, self.checks.max_abs)
            if problem is not None:
                said = f"{self.producer} returned {_shown(value)} for the prompt at {record}: {problem}"
                if self.checks.on_invalid == "error":
                    raise RewardError(f"{said} (reward.on_invalid=replace would replace such scores by "
                                      "reward.invalid_value and count them)")
                if not self._warned:
                    self._warned = True
                    print(f"warning: {said}; replaced by reward.invalid_value={self.checks.invalid_value:g} "
                          "(reward.on_invalid=replace); further replacements are counted in the metrics",
                          file=sys.stderr, flush=True)
                number = self.checks.invalid_value
            numbers_.append(number)
            replaced.append(problem is not None)
        return Scores(torch.tensor(numbers_, dtype=torch.float32), torch.tensor(replaced, dtype=torch.bool))


# ----------------------------------------------------------------------------- waiting
def wait_for(future: Future, waiting_for: Callable[[], str], progress: Callable[[], int] = lambda: 0):
    """future.result(), looking at the stop flag meanwhile: after SIGTERM/SIGINT, once nothing arrived for
    STOP_PATIENCE_S (progress() unchanged: a count of answers, for a future made of many), raise
    `stopping.abandoned` naming `waiting_for()`. Without a stop request it waits as long as the source does
    (a reward function's calls have their timeout, a server request the client's)."""
    quiet_since, seen = None, progress()
    while True:
        wait_futures([future], timeout=_POLL_S)
        if future.done():
            return future.result()
        if not stopping.requested():
            continue
        now, count = time.monotonic(), progress()
        if quiet_since is None or count != seen:
            quiet_since, seen = now, count
        elif now - quiet_since > STOP_PATIENCE_S:
            raise stopping.abandoned(f"{waiting_for()} sent no score for {STOP_PATIENCE_S:g} s after the signal")


class PendingScores:
    """Scores on their way; `result()` waits for them (see `wait_for`) and returns the checked `Scores`."""

    def __init__(self, future: Future, waiting_for: Callable[[], str], progress: Callable[[], int] = lambda: 0):
        self.future, self.waiting_for, self.progress = future, waiting_for, progress

    def result(self) -> Scores:
        return wait_for(self.future, self.waiting_for, self.progress)


# ----------------------------------------------------------------------------- sources
class RewardServerSource:
    """Scores from a reward-model server (or a combined critic server's reward model)."""

    def __init__(self, client, attribute_index: int = 0, checks: Optional[RewardChecks] = None):
        self.client = client
        self.attribute_index = attribute_index
        self.name = f"reward server {client.host}:{client.port} (model {client.model_name})"
        self.check = ScoreCheck(self.name, checks or RewardChecks())

    def score_async(self, sequences: Sequence[list[int]], prompts: Sequence, response_texts: Sequence[str],
                    records: Sequence[str]) -> PendingScores:
        """Scores of prompt + response token ids (`sequences`); the model reads nothing else."""
        answer: Future = Future()
        sent = self.client.infer_async(sequences)
        records = list(records)

        def settle(done: Future) -> None:
            try:
                outputs = np.asarray(done.result())  # [B, attributes]
                if outputs.ndim != 2 or not self.attribute_index < outputs.shape[1]:
                    raise RewardError(f"{self.name} answered with an array of shape {outputs.shape}: there is no "
                                      f"reward.attribute_index={self.attribute_index} in it")
                answer.set_result(self.check(outputs[:, self.attribute_index].tolist(), records))
            except BaseException as error:  # noqa: BLE001 - the caller's future carries every failure
                answer.set_exception(error)

        sent.add_done_callback(settle)
        return PendingScores(answer, lambda: f"the {self.name}")

    def close(self) -> None:
        self.client.close()


@dataclass
class _Job:
    """One score_async request of a reward function: its calls run in order on the worker."""

    prompts: list
    responses: list
    records: list
    future: Future


@dataclass
class _Call:
    """The call the worker is in (read by the timeout watchdog)."""

    job: _Job
    record: str
    started: float


class RuleRewardSource:
    """Scores from a Python function `fn(prompt, response_text) -> float`, named "module:function".

    prompt: as the data gave it, a string or the list of {"role", "content"} messages the answer
    replies to (a deep copy); response_text: the decoded response, without its stop token.
    """

    def __init__(self, function_path: str, checks: Optional[RewardChecks] = None):
        self.function = load_function(function_path)
        self.name = f"reward function {function_path}"
        self.checks = checks or RewardChecks()
        self.check = ScoreCheck(self.name, self.checks)
        self._lock = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._call: Optional[_Call] = None
        self._failure: Optional[RewardError] = None  # a timed-out call: every job fails with it
        self._calls_done = 0
        self._closed = False
        # Daemon threads: a call that never returns cannot be stopped, and must not keep the process alive.
        for target, role in ((self._work, "calls"), (self._watch, "timeout")):
            threading.Thread(target=target, name=f"reward-function-{role}", daemon=True).start()

    def score_async(self, sequences: Sequence[list[int]], prompts: Sequence, response_texts: Sequence[str],
                    records: Sequence[str]) -> PendingScores:
        job = _Job(list(prompts), list(response_texts), list(records), Future())
        with self._lock:
            if self._failure is not None:
                job.future.set_exception(self._failure)
            else:
                self._jobs.append(job)
                self._lock.notify_all()
        return PendingScores(job.future, self.waiting_for, lambda: self._calls_done)

    def waiting_for(self) -> str:
        call = self._call
        if call is None:
            return f"the {self.name}"
        return (f"the {self.name} (its call for the prompt at {call.record} running for "
                f"{time.monotonic() - call.started:.0f} s)")

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            values, failure = [], None
            for prompt, response, record in zip(job.prompts, job.responses, job.records):
                with self._lock:
                    self._call = _Call(job, record, time.monotonic())
                try:
                    values.append(self.function(copy.deepcopy(prompt), response))
                except BaseException as error:  # noqa: BLE001 - SystemExit too: it would end only this thread
                    failure = RewardError(f"{self.name} raised {describe_exception(error)} for the prompt at "
                                          f"{record}")
                with self._lock:
                    self._call = None
                    self._calls_done += 1
                    if self._failure is not None:  # the watchdog gave this call up: its job has failed
                        return
                if failure is not None:
                    break
            try:
                result = self.check(values, job.records) if failure is None else failure
            except RewardError as error:
                result = error
            with self._lock:
                if self._failure is not None:
                    return
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _watch(self) -> None:
        """Fail the running call's job (and every queued one) once the call has run past timeout_s."""
        timeout = self.checks.timeout_s
        with self._lock:
            while not self._closed:
                call = self._call
                left = _POLL_S if call is None else call.started + timeout - time.monotonic()
                if left > 0:
                    self._lock.wait(timeout=left)  # a call that starts meanwhile is seen within _POLL_S
                    continue
                self._failure = RewardError(
                    f"{self.name} did not return within reward.timeout_s={timeout:g} s for the prompt at "
                    f"{call.record} (raise reward.timeout_s if its calls take that long)")
                for job in (call.job, *self._jobs):
                    if not job.future.done():
                        job.future.set_exception(self._failure)
                self._jobs.clear()
                return

    def close(self) -> None:
        """Stop the threads once they are idle (a call that never returns is left to the process's exit)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()


def describe_exception(error: BaseException) -> str:
    """"Type: message (at file:line)": the first line of the message, and where it was raised (the
    innermost frame outside Python's import machinery; a SyntaxError's own file and line)."""
    message = str(error).splitlines()[0] if str(error) else ""
    if isinstance(error, SyntaxError) and error.filename:
        message, where = error.msg, f"{error.filename}:{error.lineno}"
    else:
        frames = [frame for frame in traceback.extract_tb(error.__traceback__) if not frame.filename.startswith("<")]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    message = _truncated(message, 200)
    return f"{type(error).__name__}{f': {message}' if message else ''}{f' (at {where})' if where else ''}"


def load_function(path: Optional[str]) -> Callable:
    """"package.module:function" -> the function, with an error that says what is wrong (a module that
    cannot be found, or fails while importing: the error and its file:line; no such function; a function
    that cannot take (prompt, response_text))."""
    module_name, _, attribute = (path or "").partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"reward.function={path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise ConfigError(f"reward function {path!r}: cannot import {module_name!r} ({error}; is its "
                              "directory on PYTHONPATH?)") from None
        raise ConfigError(f"reward function {path!r}: importing {module_name} failed: "
                          f"{describe_exception(error)}") from None
    except Exception as error:  # noqa: BLE001 - whatever the module's own code raises (SyntaxError included)
        raise ConfigError(f"reward function {path!r}: importing {module_name} failed: "
                          f"{describe_exception(error)}") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"reward function {path!r}: {module_name} has no function {attribute!r}")
    try:
        inspect.signature(function).bind("prompt", "response")
    except TypeError as error:
        raise ConfigError(f"reward function {path!r} must take (prompt, response_text): {error}") from None
    except ValueError:  # no signature to read (some builtins): the first call will tell
        pass
    return function
