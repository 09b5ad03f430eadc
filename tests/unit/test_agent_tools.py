"""Typed functions as tools (schema, argument checks) and tool calls read from replies in each format."""
from __future__ import annotations

from typing import Literal, Optional

import pytest

from aligner.agents.tool_calls import TOOL_CALL_FORMATS, count_outcomes, resolve_calls
from aligner.agents.tools import Tool, ToolArgumentError
from aligner.runtime.errors import ConfigError


def add(a: int, b: int, note: Optional[str] = None) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
        note: ignored
    """
    return a + b


def scale(values: list[float], how: Literal["up", "down"] = "up") -> list[float]:
    """Scale numbers.

    Args:
        values: the numbers
        how: which way
    """
    return [v * (2 if how == "up" else 0.5) for v in values]


TOOLS = {tool.name: tool for tool in map(Tool.from_function, (add, scale))}


def test_the_schema_comes_from_the_signature_and_docstring():
    schema = TOOLS["add"].schema
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two integers."
    parameters = schema["function"]["parameters"]
    assert parameters["required"] == ["a", "b"]
    assert parameters["properties"]["a"] == {"type": "integer", "description": "the first term"}
    assert TOOLS["scale"].parameters["properties"]["how"]["enum"] == ["up", "down"]


def test_an_undocumented_parameter_is_refused_in_one_line():
    def mystery(x: int) -> int:
        """Does something."""
        return x

    with pytest.raises(ConfigError, match="tool 'mystery'.*'x'"):
        Tool.from_function(mystery)


@pytest.mark.parametrize("tool, arguments, message", [
    ("add", {"a": 1}, "missing argument 'b'"),
    ("add", {"a": 1, "b": 2, "c": 3}, "unknown argument 'c'"),
    ("add", {"a": 1, "b": "2"}, "argument 'b' must be integer, got '2'"),
    ("add", {"a": True, "b": 2}, "argument 'a' must be integer"),
    ("add", [1, 2], "must be a JSON object"),
    ("scale", {"values": [1, "x"]}, "argument 'values' must be array"),
    ("scale", {"values": [1.0], "how": "sideways"}, "must be string in \\['up', 'down'\\]"),
])
def test_arguments_that_do_not_fit_are_refused_naming_the_field(tool, arguments, message):
    with pytest.raises(ToolArgumentError, match=message):
        TOOLS[tool].check(arguments)


def test_fitting_arguments_pass_unchanged():
    assert TOOLS["add"].check({"a": 1, "b": 2, "note": None}) == {"a": 1, "b": 2, "note": None}
    assert TOOLS["scale"].check({"values": [1, 2.5], "how": "down"}) == {"values": [1, 2.5], "how": "down"}


# ----------------------------------------------------------------------------- formats
def test_hermes_reads_single_and_parallel_calls():
    fmt = TOOL_CALL_FORMATS["hermes"]
    one = fmt.parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 79}}\n</tool_call>')
    assert [(c.name, c.arguments) for c in one.calls] == [("add", {"a": 12, "b": 79})] and not one.malformed
    two = fmt.parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                    '<tool_call>{"name": "scale", "arguments": "{\\"values\\": [3]}"}</tool_call>')
    assert [(c.name, c.arguments) for c in two.calls] == [("add", {"a": 1, "b": 2}), ("scale", {"values": [3]})]
    assert not fmt.parse("The answer is 91.").has_calls


@pytest.mark.parametrize("text, problem", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "cannot read the call"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "unterminated <tool_call>"),
])
def test_hermes_malformed_calls_are_reported_not_raised(text, problem):
    parsed = TOOL_CALL_FORMATS["hermes"].parse(text)
    assert not parsed.calls and len(parsed.malformed) == 1 and problem in parsed.malformed[0]


def test_llama3_json_reads_a_json_reply_and_leaves_answers_alone():
    fmt = TOOL_CALL_FORMATS["llama3_json"]
    call = fmt.parse('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert [(c.name, c.arguments) for c in call.calls] == [("add", {"a": 2, "b": 3})]
    both = fmt.parse('[{"name": "add", "parameters": {"a": 2, "b": 3}}, {"name": "scale", "parameters": '
                     '{"values": [1]}}]')
    assert [c.name for c in both.calls] == ["add", "scale"]
    assert not fmt.parse("The sum is 5.").has_calls
    assert fmt.parse('{"name": "add", "parameters": ').malformed


def test_plain_reads_call_lines():
    parsed = TOOL_CALL_FORMATS["plain"].parse('I need help.\nCALL add {"a": 12, "b": 79}\nCALL add {oops}\n')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 12, "b": 79})]
    assert parsed.malformed == [parsed.malformed[0]] and "arguments of add" in parsed.malformed[0]


def test_every_outcome_is_resolved_and_counted():
    parsed = TOOL_CALL_FORMATS["hermes"].parse(
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": "x", "b": 2}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
        '<tool_call>not json</tool_call>')
    calls = resolve_calls(parsed, TOOLS, max_parallel_calls=3)
    assert [c.outcome for c in calls] == ["ok", "unknown_tool", "bad_arguments", "too_many_calls", "malformed"]
    assert calls[0].tool.function(**calls[0].arguments) == 3
    assert "the tools are add, scale" in calls[1].error and "only 3 tool call(s)" in calls[3].error
    assert count_outcomes(calls) == {"ok": 1, "malformed": 1, "unknown_tool": 1, "bad_arguments": 1,
                                     "too_many_calls": 1}
