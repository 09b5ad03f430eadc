"""Tool calls read from a model's reply, in the formats models are trained on, and checked against the tools.

    fmt = TOOL_CALL_FORMATS["hermes"]
    parsed = fmt.parse(reply_text)          # the reply's text is decoded once from the generated ids, for this
    calls = resolve_calls(parsed, tools, max_parallel_calls=2)
    for call in calls: call.outcome, call.tool, call.arguments, call.error   # error: what the model is told

Formats:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5/3, Hermes).
- `llama3_json`: the whole reply is `{"name": ..., "parameters": {...}}` (or a list of them), optionally after
  `<|python_tag|>` (Llama 3.1-3.3's JSON tool calling); a reply that is not JSON-shaped is an answer.
- `plain`: lines `CALL name {json arguments}` (for models without a tool format, e.g. the toy demo's).

Each format declares `call_end`, the text that ends a call, where generation stops when a turn may make one call
(`ToolEnvironment.stop_strings`) so that the model does not go on to write the tool's answer itself:
- `hermes`: `</tool_call>`.
- `llama3_json`: none of its own. The call is the whole reply, so it ends where the turn ends, with the model's
  end-of-turn token (`<|eot_id|>`, a stop token already): Llama 3.1's templates close a JSON tool call that way.
  `<|eom_id|>` ("more to come") ends the turns of its built-in tools and code interpreter (`<|python_tag|>` code
  run in an ipython environment), which this format does not run.
- `plain`: none. A call is a line, and the only fixed text after it is a newline, which also ends every line of an
  answer; a stop there would cut multi-line answers.

A malformed call (bad JSON, no name, an unterminated block), an unknown tool, arguments that do not fit the
tool's signature and calls beyond `max_parallel_calls` each become an error outcome whose message the
environment can return to the model; every outcome is counted (`OUTCOMES`) for the step's metrics.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from aligner.agents.tools import Tool, ToolArgumentError

OUTCOMES = ("ok", "malformed", "unknown_tool", "bad_arguments", "too_many_calls")


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: a name and its arguments (not yet checked)."""

    name: str
    arguments: Any


@dataclass
class ParsedReply:
    """A reply's tool calls and the malformed call texts (each with why it could not be read)."""

    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls or self.malformed)


@dataclass(frozen=True)
class ResolvedCall:
    """A call's outcome: the tool and its checked arguments when ok, else the error the model is told."""

    outcome: str
    name: Optional[str] = None
    tool: Optional[Tool] = None
    arguments: Optional[dict] = None
    error: Optional[str] = None


def _call_from_json(value: Any, arguments_key: str) -> ToolCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError('a call is a JSON object with a string "name"')
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments object as a JSON string
        arguments = json.loads(arguments)
    return ToolCall(value["name"], arguments)


class HermesFormat:
    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"
    call_end: Optional[str] = close

    def parse(self, text: str) -> ParsedReply:
        parsed = ParsedReply()
        position = 0
        while (start := text.find(self.open, position)) >= 0:
            end = text.find(self.close, start)
            if end < 0:
                parsed.malformed.append(f"unterminated {self.open} block (no {self.close})")
                break
            body = text[start + len(self.open):end].strip()
            try:
                parsed.calls.append(_call_from_json(json.loads(body), "arguments"))
            except ValueError as error:  # json.JSONDecodeError is a ValueError
                parsed.malformed.append(f"cannot read the call {body[:80]!r}: {error}")
            position = end + len(self.close)
        return parsed


class Llama3JSONFormat:
    name = "llama3_json"
    python_tag = "<|python_tag|>"
    call_end: Optional[str] = None  # the turn's end token ends the call

    def parse(self, text: str) -> ParsedReply:
        body = text.strip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag):].strip()
        if not body.startswith(("{", "[")):
            return ParsedReply()  # an answer, not a call
        parsed = ParsedReply()
        try:
            value = json.loads(body)
        except ValueError as error:
            parsed.malformed.append(f"cannot read the call {body[:80]!r}: {error}")
            return parsed
        for item in value if isinstance(value, list) else [value]:
            try:
                parsed.calls.append(_call_from_json(item, "parameters"))
            except ValueError as error:
                parsed.malformed.append(f"cannot read the call {json.dumps(item)[:80]!r}: {error}")
        return parsed


class PlainFormat:
    name = "plain"
    line = re.compile(r"^CALL\s+(\S+)\s*(.*)$")
    call_end: Optional[str] = None  # a newline would also cut multi-line answers

    def parse(self, text: str) -> ParsedReply:
        parsed = ParsedReply()
        for raw in text.splitlines():
            match = self.line.match(raw.strip())
            if not match:
                continue
            try:
                arguments = json.loads(match.group(2)) if match.group(2).strip() else {}
                parsed.calls.append(ToolCall(match.group(1), arguments))
            except ValueError as error:
                parsed.malformed.append(f"cannot read the arguments of {match.group(1)}: {error}")
        return parsed


TOOL_CALL_FORMATS = {fmt.name: fmt for fmt in (HermesFormat(), Llama3JSONFormat(), PlainFormat())}


def resolve_calls(parsed: ParsedReply, tools: dict[str, Tool], max_parallel_calls: int) -> list[ResolvedCall]:
    """Each call (and each malformed one) with its outcome, in the reply's order (malformed ones last)."""
    resolved = []
    for index, call in enumerate(parsed.calls):
        if index >= max_parallel_calls:
            resolved.append(ResolvedCall("too_many_calls", call.name, error=(
                f"only {max_parallel_calls} tool call(s) per turn; {call.name} was not run")))
        elif call.name not in tools:
            resolved.append(ResolvedCall("unknown_tool", call.name, error=(
                f"unknown tool {call.name!r}; the tools are {', '.join(sorted(tools)) or 'none'}")))
        else:
            tool = tools[call.name]
            try:
                resolved.append(ResolvedCall("ok", call.name, tool, tool.check(call.arguments)))
            except ToolArgumentError as error:
                resolved.append(ResolvedCall("bad_arguments", call.name, tool, error=str(error)))
    resolved += [ResolvedCall("malformed", error=problem) for problem in parsed.malformed]
    return resolved


def count_outcomes(calls: list[ResolvedCall]) -> dict[str, int]:
    """{outcome: count} over OUTCOMES (zeros included), for the step's metrics."""
    counts = dict.fromkeys(OUTCOMES, 0)
    for call in calls:
        counts[call.outcome] += 1
    return counts
