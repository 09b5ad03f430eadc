"""Reward sources of the RL actors and rejection sampling, and the checks every score passes.

    source = RuleRewardSource(reward_section)                       # or RewardServerSource(client, ...)
    source.probe(prompt, columns, "prompts.jsonl:1")                 # once, before the model is built
    pending = source.score_async(sequences, prompts, response_texts, records, columns)   # scoring starts
    scores = pending.result()                                        # Scores: values [B], replaced [B], parts

Sources answer `score_async(sequences, prompts, response_texts, records, columns)`: sequences are the prompt +
response token ids (what a reward model reads), prompts as the data gave them (text or messages, what a
reward function reads), records where each prompt came from ("file:line", for messages), columns each
prompt record's other fields (a ground-truth answer, test cases: what a reward function takes by keyword).

Reward functions (reward.function, or the weighted list reward.functions) are named "path/to/file.py:fn"
(imported by its path, from the working directory) or "package.module:fn" (the working directory is
importable). Each is called fn(prompt, response, **columns) -> float with the columns its signature names
(every column with **kwargs; a two-argument fn(prompt, response_text) gets none), or, batched, once per
request: fn(prompts, responses, **columns as lists) -> list of floats. A batched function whose parameters
use TRL's names gets TRL's call: fn(prompts=..., completions=..., **columns as lists) (TRL's reward_funcs
take the batch and the dataset's other columns as keyword lists). The score is the sum of weight x each
function's score; each function's own scores are kept (`Scores.parts`, the metrics reward/<name>).
`probe` calls them once on the first prompt record with the response "" so that a function that cannot
work ends the run before the model loads.

Every score is checked where it is produced, by one `ScoreCheck`: a real number (int, float, a numpy
scalar; not a str, bool, None or list), finite, |score| <= max_abs, one per response. A bad score ends
the run with one line naming the function or server, the prompt's record and the value, or, with
on_invalid=replace, is replaced by invalid_value and counted (each row says whether its score was).

The functions run on a thread of their own, one call at a time, and get deep copies of the prompt and
columns (a function that edits them cannot change the data set for later samples). An exception inside
one, or a call that runs longer than timeout_s, ends the run with one line naming the function and the
prompt's record; on a timeout, or when a stop request gives the wait up, the processes the call started
(this process's descendants created since the call began) are terminated first. A Python thread cannot
be killed: the worker is a daemon thread, so the process exits without it. `PendingScores.result()` polls
the stop flag (aligner/runtime/stopping.py): after SIGTERM/SIGINT the wait goes on while scores keep
arriving, and ends the run once none arrived for STOP_PATIENCE_S.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import threading
import time
import traceback
import zlib
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import psutil
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
class RewardFunctionEntry:
    """One function of `reward.functions`."""

    function: str = "???"  # "path/to/file.py:fn" (from the working directory) or "package.module:fn"
    weight: float = 1.0  # the score is the sum of weight x each function's score
    batched: bool = False  # one call per request: fn(prompts, responses, **columns as lists) -> list of scores
    name: Optional[str] = None  # its metric, reward/<name>; null: the function's own name

    def check_fields(self) -> Optional[tuple[str, str]]:
        if not math.isfinite(self.weight):
            return "weight", "must be a finite number"
        return None


@dataclass
class RewardFunctionSettings(RewardChecks):
    """The reward functions of a `reward:` section (source=function) and RewardChecks' checks of their scores."""

    function: Optional[str] = None  # one function, weight 1: "path/to/file.py:fn" or "package.module:fn"
    functions: list[RewardFunctionEntry] = field(default_factory=list)  # several, their scores summed by weight

    def function_entries(self) -> list[tuple[str, RewardFunctionEntry]]:
        """(its key, its entry) of each function to call: reward.function's, or each of reward.functions."""
        if self.function:
            return [("reward.function", RewardFunctionEntry(function=self.function))]
        return [(f"reward.functions[{index}].function", entry) for index, entry in enumerate(self.functions)]

    def check_fields(self) -> Optional[tuple[str, str]]:
        problem = super().check_fields()
        if problem is None and self.function and self.functions:
            return "function", "set reward.function (one function) or reward.functions (a weighted list), not both"
        return problem


@dataclass
class Scores:
    """The checked scores of one request."""

    values: torch.Tensor  # [B] float32
    replaced: torch.Tensor  # [B] bool: invalid, replaced by invalid_value (on_invalid=replace)
    parts: dict = field(default_factory=dict)  # reward functions: each one's name -> its own scores [B]

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

    def __call__(self, values: Sequence, records: Sequence[str], strict: bool = False) -> Scores:
        """strict: an invalid score is an error whatever on_invalid says (the probe before the model loads)."""
        if len(values) != len(records):
            raise RewardError(f"{self.producer} returned {len(values)} scores for {len(records)} responses")
        numbers_, replaced = [], []
        for value, record in zip(values, records):
            number, problem = score_problem(value, self.checks.max_abs)
            if problem is not None:
                said = f"{self.producer} returned {_shown(value)} for the prompt at {record}: {problem}"
                if strict or self.checks.on_invalid == "error":
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
    """Scores on their way; `result()` waits for them (see `wait_for`) and returns the checked `Scores`.
    on_abandon: called when a stop request gives the wait up (stops what the running call started)."""

    def __init__(self, future: Future, waiting_for: Callable[[], str], progress: Callable[[], int] = lambda: 0,
                 on_abandon: Callable[[], None] = lambda: None):
        self.future, self.waiting_for, self.progress, self.on_abandon = future, waiting_for, progress, on_abandon

    def result(self) -> Scores:
        try:
            return wait_for(self.future, self.waiting_for, self.progress)
        except stopping.Interrupted:
            self.on_abandon()
            raise


# ----------------------------------------------------------------------------- sources
class RewardServerSource:
    """Scores from a reward-model server (or a combined critic server's reward model)."""

    def __init__(self, client, attribute_index: int = 0, checks: Optional[RewardChecks] = None):
        self.client = client
        self.attribute_index = attribute_index
        self.name = f"reward server {client.host}:{client.port} (model {client.model_name})"
        self.check = ScoreCheck(self.name, checks or RewardChecks())

    def score_async(self, sequences: Sequence[list[int]], prompts: Sequence, response_texts: Sequence[str],
                    records: Sequence[str], columns: Optional[Sequence[dict]] = None) -> PendingScores:
        """Scores of prompt + response token ids (`sequences`); the model reads nothing else (the prompt
        records' other `columns` are for reward functions)."""
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
    """One score_async request of the reward functions: its calls run in order on the worker."""

    prompts: list
    responses: list
    records: list
    columns: list  # each prompt record's other columns (dicts)
    future: Future
    strict: bool = False  # the probe: an invalid score is an error whatever reward.on_invalid says


@dataclass
class _Call:
    """The call the worker is in (read by the timeout watchdog)."""

    job: _Job
    producer: str  # "reward function SPEC"
    what: str  # "the prompt at FILE:LINE", or the batch's prompts
    started: float  # time.monotonic()
    started_since_boot: float  # `_since_boot()`: processes the call started are those created since


class _GivenUp(Exception):
    """The watchdog failed the running call's job: the worker ends without answering it."""


@dataclass(frozen=True)
class _Signature:
    """What a reward function's signature takes."""

    takes_any_column: bool = False  # **kwargs: every column is passed
    keywords: frozenset = frozenset()  # the column names it takes by keyword
    required: frozenset = frozenset()  # those without a default: a record must have them
    positional: frozenset = frozenset()  # the names prompt(s) and response(s) go to (never a column's)
    trl: bool = False  # TRL's names: completions (and prompts, if taken) passed by keyword
    takes_prompts: bool = True  # trl: whether it takes `prompts`


@dataclass
class RewardFunction:
    """One loaded function of the `reward:` section, what its signature takes and how its scores count."""

    key: str  # the setting that names it: reward.function, reward.functions[i].function
    spec: str  # "path/to/file.py:fn" or "module:fn"
    name: str  # its metric: reward/<name>
    weight: float
    batched: bool
    function: Callable
    signature: _Signature
    check: ScoreCheck

    @property
    def producer(self) -> str:
        return f"reward function {self.spec}"

    def column_arguments(self, columns: dict, what: str) -> dict:
        """The keyword arguments of one call: the columns its signature takes."""
        taken = self.signature
        given = {key: value for key, value in columns.items() if key in taken.keywords or (
            taken.takes_any_column and key not in taken.positional)}
        missing = sorted(taken.required - given.keys())
        if missing:
            raise RewardError(f"{self.producer} takes the column {missing[0]!r}, but the record of {what} has none "
                              f"(its columns: {', '.join(sorted(columns)) or 'none besides the prompt'})")
        return given

    def __call__(self, prompt, response, columns: dict):
        """One call: prompt(s) and response(s) positionally, or by TRL's keywords; `column_arguments`."""
        if not self.signature.trl:
            return self.function(prompt, response, **columns)
        given = {"prompts": prompt} if self.signature.takes_prompts else {}
        return self.function(completions=response, **given, **columns)


TRL_NAMES = ("prompts", "completions")  # TRL's reward_funcs take the batch by these keywords


def _function_parameters(function: Callable, said: str, batched: bool) -> _Signature:
    """The signature of a reward function; refuses one that cannot take (prompt, response) positionally
    (or, named as TRL names them, `completions` outside a batched entry)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some builtins): (prompt, response) only
        return _Signature()
    parameters = signature.parameters
    takes_any = any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    trl = "completions" in parameters
    if trl and not batched:
        raise ConfigError(f"{said}: the function takes TRL's `completions` (a batch of responses): list it in "
                          "reward.functions with batched: true")
    if trl:
        positional = frozenset(TRL_NAMES)
    else:
        try:
            positional = frozenset(signature.bind_partial("prompt", "response").arguments)
        except TypeError as error:
            raise ConfigError(f"{said}: the function must take (prompt, response, **columns): {error}") from None
    named = [parameter for parameter in parameters.values() if parameter.name not in positional and parameter.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    required = frozenset(parameter.name for parameter in named if parameter.default is inspect.Parameter.empty)
    return _Signature(takes_any, frozenset(parameter.name for parameter in named), required, positional, trl,
                      "prompts" in parameters or takes_any)


def load_reward_functions(settings: "RewardFunctionSettings") -> list[RewardFunction]:
    """The functions of reward.function / reward.functions, imported and their signatures read; one line
    naming the key for one that cannot work (see `load_function`)."""
    functions, names = [], {}
    for key, entry in settings.function_entries():
        said = f"{key}={entry.function}"
        function = load_function(entry.function, key)
        signature = _function_parameters(function, said, entry.batched)
        name = entry.name or entry.function.rpartition(":")[2]
        if name in names:
            raise ConfigError(f"{said}: its metric name reward/{name} is {names[name]}'s too: give one of them a "
                              "`name`")
        names[name] = key
        functions.append(RewardFunction(
            key=key, spec=entry.function, name=name, weight=float(entry.weight), batched=entry.batched,
            function=function, signature=signature, check=ScoreCheck(f"reward function {entry.function}", settings)))
    if not functions:
        raise ConfigError("reward.source=function needs reward.function='path/to/file.py:function' (or "
                          "'module:function', or a list in reward.functions)")
    return functions


def _batch_scores(value, count: int, producer: str, what: str) -> list:
    """A batched call's answer as a list of `count` values (each checked by its ScoreCheck)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 1:
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        raise RewardError(f"{producer} returned {_shown(value)} for {what}: a batched function returns a list of "
                          f"{count} scores, one per response")
    return list(value)


def _since_boot() -> float:
    """Seconds since boot on the clock process start times are counted on (Linux: CLOCK_BOOTTIME, exact to
    the clock tick; elsewhere the wall clock, which psutil's boot time may be off by a second)."""
    if hasattr(time, "CLOCK_BOOTTIME"):
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - psutil.boot_time()


def _stop_processes_started_since(started: float) -> list[int]:
    """Terminate (then kill) this process's descendants created since `started` (`_since_boot()`: those a
    hung call started, such as a subprocess it waits on); returns their pids."""
    margin = 0.02  # a start time is rounded down to the clock tick (10 ms)
    try:
        boot = psutil.boot_time()
        children = [child for child in psutil.Process().children(recursive=True)
                    if child.create_time() - boot >= started - margin]
    except psutil.Error:
        return []
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=2.0)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return [child.pid for child in children]


class RuleRewardSource:
    """Scores from Python functions (reward.function, or the weighted list reward.functions).

    Each function is called fn(prompt, response, **columns) -> float, or with `batched` once per request
    fn(prompts, responses, **columns as lists) -> list of floats. prompt: as the data gave it, a string or
    the list of {"role", "content"} messages the answer replies to (a deep copy); response: the decoded
    response, without its stop token; columns: the prompt record's other columns (a ground-truth answer, test
    cases...), those its signature names, or all with **kwargs. The score is the sum of weight x each
    function's score; `Scores.parts` keeps each function's own (metrics reward/<name>).
    """

    def __init__(self, settings: "RewardFunctionSettings | str", checks: Optional[RewardChecks] = None):
        if isinstance(settings, str):  # one function by its spec, with `checks` (tests, benchmarks)
            base = checks or RewardChecks()
            settings = RewardFunctionSettings(**{field_.name: getattr(base, field_.name)
                                                 for field_ in dataclasses.fields(RewardChecks)}, function=settings)
        self.functions = load_reward_functions(settings)
        self.names = [function.name for function in self.functions]
        self.name = "reward function" + ("s " if len(self.functions) > 1 else " ") + ", ".join(
            function.spec for function in self.functions)
        self.checks = settings
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
                    records: Sequence[str], columns: Optional[Sequence[dict]] = None) -> PendingScores:
        columns = [{} for _ in prompts] if columns is None else list(columns)
        return self._submit(_Job(list(prompts), list(response_texts), list(records), columns, Future()))

    def probe(self, prompt, columns: dict, record: str) -> None:
        """Call every function once on a prompt record with the response "" (before the model is built): an
        exception, a missing column, a score that is not a valid number or a call past the timeout ends the
        run here, naming the function, the record and what went wrong."""
        where = f'{record} (the probe before the model loads: the first prompt record, with the response "")'
        self._submit(_Job([prompt], [""], [where], [columns], Future(), strict=True)).result()

    def _submit(self, job: _Job) -> PendingScores:
        with self._lock:
            if self._failure is not None:
                job.future.set_exception(self._failure)
            else:
                self._jobs.append(job)
                self._lock.notify_all()
        return PendingScores(job.future, self.waiting_for, lambda: self._calls_done, self._stop_running_call)

    def _stop_running_call(self) -> None:
        """Stop the processes the running call started (the run is given up while it hangs)."""
        call = self._call
        if call is not None:
            _stop_processes_started_since(call.started_since_boot)

    def waiting_for(self) -> str:
        call = self._call
        if call is None:
            return f"the {self.name}"
        return f"the {call.producer} (its call for {call.what} running for {time.monotonic() - call.started:.0f} s)"

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._jobs and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            try:
                result = self._score(job)
            except _GivenUp:
                return
            except RewardError as error:
                result = error
            with self._lock:
                if self._failure is not None:
                    return
                if isinstance(result, BaseException):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def _score(self, job: _Job) -> Scores:
        """Every function's checked scores of the job, and their weighted sum."""
        total = torch.zeros(len(job.prompts), dtype=torch.float32)
        replaced = torch.zeros(len(job.prompts), dtype=torch.bool)
        parts = {}
        for function in self.functions:
            if function.batched:
                what = _batch_description(job.records)
                names = sorted({name for columns in job.columns for name in columns})
                lists = {name: [columns.get(name) for columns in job.columns] for name in names}
                answer = self._call_one(job, function, what, job.prompts, list(job.responses), lists)
                values = _batch_scores(answer, len(job.prompts), function.producer, what)
            else:
                values = [self._call_one(job, function, f"the prompt at {record}", prompt, response, columns)
                          for prompt, response, record, columns in zip(job.prompts, job.responses, job.records,
                                                                       job.columns)]
            scores = function.check(values, job.records, strict=job.strict)
            parts[function.name] = scores.values
            total += function.weight * scores.values
            replaced |= scores.replaced
        return Scores(total, replaced, parts)

    def _call_one(self, job: _Job, function: RewardFunction, what: str, prompt, response, columns: dict):
        """function(prompt, response, **the columns it takes) on deep copies (a function that edits them cannot
        change the data set for later samples), watched by the timeout; an exception becomes one RewardError
        line naming the function and `what`; _GivenUp once the watchdog has failed the job."""
        with self._lock:
            self._call = _Call(job, function.producer, what, time.monotonic(), _since_boot())
        try:
            arguments = copy.deepcopy(function.column_arguments(columns, what))
            return function(copy.deepcopy(prompt), response, arguments)
        except RewardError:
            raise
        except BaseException as error:  # noqa: BLE001 - SystemExit too: it would end only this thread
            raise RewardError(f"{function.producer} raised {describe_exception(error)} for {what}") from None
        finally:
            with self._lock:
                self._call = None
                self._calls_done += 1
                given_up = self._failure is not None
            if given_up:  # the watchdog gave this call up: its job has failed
                raise _GivenUp()

    def _watch(self) -> None:
        """Fail the running call's job (and every queued one) once the call has run past timeout_s, after
        stopping the processes the call started."""
        timeout = self.checks.timeout_s
        with self._lock:
            while not self._closed:
                call = self._call
                left = _POLL_S if call is None else call.started + timeout - time.monotonic()
                if left > 0:
                    self._lock.wait(timeout=left)  # a call that starts meanwhile is seen within _POLL_S
                    continue
                stopped = _stop_processes_started_since(call.started_since_boot)
                self._failure = RewardError(
                    f"{call.producer} did not return within reward.timeout_s={timeout:g} s for {call.what} (raise "
                    f"reward.timeout_s if its calls take that long)"
                    + (f"; the {len(stopped)} process(es) it started were stopped" if stopped else ""))
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


def _batch_description(records: Sequence[str]) -> str:
    shown = list(dict.fromkeys(records))
    return (f"the batch of {len(records)} responses to the prompts at {', '.join(shown[:3])}"
            f"{', ...' if len(shown) > 3 else ''}")


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


def load_function(spec: Optional[str], key: str = "reward.function") -> Callable:
    """"path/to/file.py:function" (the file imported by its path, relative to the working directory) or
    "package.module:function" (the working directory importable, after the installed packages) -> the
    function. A ConfigError naming `key` says what is wrong: no such file or module, a module that fails
    while importing (the error and its file:line), no such function."""
    target, _, attribute = (spec or "").rpartition(":")
    said = f"{key}={spec}"
    if not target or not attribute:
        raise ConfigError(f"{said}: expected 'path/to/file.py:function' or 'package.module:function'")
    if target.endswith(".py") or "/" in target or os.sep in target:
        module, where = _import_file(Path(target), said), target
    else:
        module, where = _import_module(target, said), f"module {target}"
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ConfigError(f"{said}: {where} has no function {attribute!r}")
    return function


def _import_file(path: Path, said: str):
    """The module of a reward file, imported once per path (its directory importable, for helpers beside it)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{said}: there is no file {path} (a relative path is read from the working directory "
                          f"{Path.cwd()})")
    name = f"aligner_reward_file_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - whatever the file's own code raises (SyntaxError included)
        del sys.modules[name]
        raise ConfigError(f"{said}: importing {path} failed: {describe_exception(error)}") from None
    return module


def _import_module(module_name: str, said: str):
    """`module_name` imported with the working directory on sys.path (after the installed packages: a
    module there cannot shadow one a library imports later)."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise ConfigError(f"{said}: cannot import {module_name!r} (no such module in the working directory "
                              f"{cwd} or on PYTHONPATH; a file can be named as path/to/file.py:function)") from None
        raise ConfigError(f"{said}: importing {module_name} failed: {describe_exception(error)}") from None
    except Exception as error:  # noqa: BLE001 - whatever the module's own code raises (SyntaxError included)
        raise ConfigError(f"{said}: importing {module_name} failed: {describe_exception(error)}") from None
    top = module_name.split(".")[0]
    own = Path(cwd) / f"{top}.py"
    found = getattr(sys.modules.get(top), "__file__", None)
    if own.is_file() and found is not None and Path(found).resolve() != own.resolve():
        raise ConfigError(f"{said}: {top!r} is the module at {found}, not {own}: name the file instead "
                          f"({top}.py:{said.rpartition(':')[2]})")
    return module
