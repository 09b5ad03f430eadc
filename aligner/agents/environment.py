"""Environments: what an agent talks to between its turns.

A user's environment is a class with two methods, one instance per episode (sync or async methods):

    class GuessTheNumber:
        def __init__(self, low: int = 1, high: int = 100):         # rollout.environment_args
            ...
        def reset(self, record: dict) -> dict:                      # the prompt record of the episode
            return {"messages": [{"role": "user", "content": "Guess my number."}]}   # and "tools": [schemas]
        def step(self, action: str) -> dict:                        # the model's reply, as text
            return {"messages": [{"role": "user", "content": "Higher."}], "reward": 0.0, "done": False}

named `package.module:GuessTheNumber` (or `path/to/file.py:GuessTheNumber`) by `rollout.environment`. It runs in a
sandbox worker (`aligner.runtime.sandbox`), never in the trainer: `SandboxedEnvironment` is its stand-in here,
moving JSON across. `ToolEnvironment` is built in: typed Python functions as tools (each call run in the
sandbox), the reply's calls read in a tool-call format, and the episode done when the model answers without
calling a tool; its reward is a reward function of the final answer.

A step's answer (`StepResult`): the new messages (a tool result is `{"role": "tool", "content": ...}`), a reward
for the turn (or None), done, and info (JSON, kept with the episode). A failure of the environment's code is
`EnvironmentFailure`, told apart from the model's mistakes (a bad tool call is an observation, not a failure).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from aligner.agents.tool_calls import TOOL_CALL_FORMATS, count_outcomes, resolve_calls
from aligner.agents.tools import Tool
from aligner.runtime.errors import ConfigError
from aligner.runtime.sandbox import SandboxPool, SandboxResult, WorkerLease


class EnvironmentFailure(RuntimeError):
    """The environment's code failed (raised, timed out, crashed, answered nonsense): not the model's doing.

    kind: "error" (it raised or answered wrongly), "timeout", "crashed" (the worker died)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


@dataclass
class StepResult:
    messages: list[dict]
    reward: Optional[float] = None
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class Start:
    """What `reset` gives: the first messages and the tools offered (JSON schemas), if any."""

    messages: list[dict]
    tools: Optional[list[dict]] = None


class Environment(Protocol):
    """What the episode runner calls; environments subclass it and inherit what they do not need."""

    def reset(self, record: dict) -> Start: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Texts after which the model's turn ends besides its end token (default: none)."""
        return ()


def _messages(value: Any, where: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                              and isinstance(m.get("content"), str) for m in value):
        raise EnvironmentFailure(f"{where}: \"messages\" must be a list of {{\"role\": str, \"content\": str}}, "
                                 f"got {json.dumps(value)[:120]}")
    return value


def start_from(answer: Any, where: str) -> Start:
    if not isinstance(answer, dict) or "messages" not in answer:
        raise EnvironmentFailure(f"{where}.reset must return {{\"messages\": [...], \"tools\": [...]}}, "
                                 f"got {json.dumps(answer)[:120]}")
    tools = answer.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise EnvironmentFailure(f"{where}.reset: \"tools\" must be a list of JSON schemas")
    return Start(_messages(answer["messages"], f"{where}.reset"), tools)


def step_from(answer: Any, where: str) -> StepResult:
    if not isinstance(answer, dict) or "messages" not in answer:
        raise EnvironmentFailure(f"{where}.step must return {{\"messages\": [...], \"reward\": float or null, "
                                 f"\"done\": bool, \"info\": {{...}}}}, got {json.dumps(answer)[:120]}")
    reward = answer.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or reward != reward or abs(reward) == float("inf")):
        raise EnvironmentFailure(f"{where}.step: reward must be a finite number or null, got {reward!r}")
    done = answer.get("done", False)
    if not isinstance(done, bool):
        raise EnvironmentFailure(f"{where}.step: done must be true or false, got {done!r}")
    info = answer.get("info", {})
    if not isinstance(info, dict):
        raise EnvironmentFailure(f"{where}.step: info must be an object, got {info!r}")
    return StepResult(_messages(answer["messages"], f"{where}.step"), None if reward is None else float(reward),
                      done, info)


def _value(result: SandboxResult, what: str) -> Any:
    if not result.ok:
        raise EnvironmentFailure(f"{what}: {result.error}", "error" if result.status == "error" else result.status)
    return result.value


class SandboxedEnvironment(Environment):
    """A user's environment class, one instance in a leased sandbox worker for the episode."""

    def __init__(self, pool: SandboxPool, target: str, arguments: Optional[dict] = None):
        self.target = target
        self._lease_context = pool.lease()
        self.worker: WorkerLease = self._lease_context.__enter__()
        try:
            _value(self.worker.new(target, **(arguments or {})), f"environment {target}")
        except BaseException:
            self.close()
            raise

    def reset(self, record: dict) -> Start:
        return start_from(_value(self.worker.method("reset", record), f"{self.target}.reset"), self.target)

    def step(self, action: str) -> StepResult:
        return step_from(_value(self.worker.method("step", action), f"{self.target}.step"), self.target)

    def close(self) -> None:
        if self._lease_context is not None:
            context, self._lease_context = self._lease_context, None
            context.__exit__(None, None, None)


def sandboxed_tools(pool: SandboxPool, targets: list[str]) -> dict[str, Tool]:
    """{name: Tool} of functions named by targets ("module:function" or "file.py:function"), their schemas read in
    a sandbox worker (the trainer never imports tool code); a function that cannot be described is refused in
    one line naming it."""
    tools = {}
    with pool.lease() as worker:
        for target in targets:
            result = worker.schema(target)
            if not result.ok:
                raise ConfigError(f"tool {target}: {result.error}")
            tool = Tool.from_schema(result.value, target)
            if tool.name in tools:
                raise ConfigError(f"tool {target}: a tool named {tool.name!r} is already given")
            tools[tool.name] = tool
    return tools


BAD_CALL_POLICIES = ("feedback", "end", "fixed_advantage")


class ToolEnvironment(Environment):
    """Tools for one episode: the prompt record's messages with the tools offered; each reply's calls run in the
    sandbox and come back as tool messages; a reply without a call is the final answer (done), scored by
    `reward(record, answer) -> float` when given.

    tools: {name: Tool} with their sandbox targets (`sandboxed_tools`). on_bad_call: "feedback" (the error goes
    back to the model as the tool's answer), "end" (the episode ends, reward 0, info ended_by "bad tool call") or
    "fixed_advantage" (it ends as with "end"; the RL actor gives its tokens rollout.bad_call_advantage).
    """

    def __init__(self, pool: SandboxPool, tools: dict[str, Tool], *, call_format: str,
                 max_parallel_calls: int = 1, on_bad_call: str = "feedback",
                 reward: Optional[Callable[[dict, str], float]] = None, prompt_key: str = "prompt"):
        if call_format not in TOOL_CALL_FORMATS:
            raise ConfigError(f"tool call format {call_format!r} is not one of {', '.join(TOOL_CALL_FORMATS)}")
        if on_bad_call not in BAD_CALL_POLICIES:
            raise ConfigError(f"on_bad_call {on_bad_call!r} is not one of {', '.join(BAD_CALL_POLICIES)}")
        self.pool, self.tools = pool, tools
        self.format = TOOL_CALL_FORMATS[call_format]
        self.max_parallel_calls, self.on_bad_call, self.reward = max_parallel_calls, on_bad_call, reward
        self.prompt_key = prompt_key
        self.record: dict = {}
        self.outcomes = count_outcomes([])

    def reset(self, record: dict) -> Start:
        self.record = record
        prompt = record[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return Start(messages, [tool.schema for tool in self.tools.values()])

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The end of a call in the format (`</tool_call>`) when a turn may make one call: the turn stops there, so
        the model never writes (and is never trained on) a made-up tool answer after its call. With parallel calls
        the turn ends with the model's end token (a stop at the first call would leave no room for a second)."""
        end = self.format.call_end
        return (end,) if end is not None and self.max_parallel_calls == 1 else ()

    def step(self, action: str) -> StepResult:
        calls = resolve_calls(self.format.parse(action), self.tools, self.max_parallel_calls)
        for outcome, count in count_outcomes(calls).items():
            self.outcomes[outcome] += count
        if not calls:
            score = None if self.reward is None else float(self.reward(self.record, action))
            return StepResult([], score, True, {"tool_calls": dict(self.outcomes)})
        if self.on_bad_call != "feedback" and any(call.outcome != "ok" for call in calls):
            return StepResult([], 0.0, True, {"tool_calls": dict(self.outcomes), "ended_by": "bad tool call"})
        messages = []
        for call in calls:
            if call.outcome != "ok":
                content = f"error: {call.error}"
            else:
                result = self.pool.call(call.tool.target, **call.arguments)
                if result.status in ("timeout", "crashed"):
                    content = f"error: the tool {call.name} {'timed out' if result.status == 'timeout' else 'crashed'}"
                else:
                    content = (json.dumps(result.value) if not isinstance(result.value, str) else result.value) \
                        if result.ok else f"error: {result.error}"
            messages.append({"role": "tool", "content": content})
        return StepResult(messages, None, False, {"tool_calls": dict(self.outcomes)})

    def close(self) -> None:
        pass
