"""Typed Python functions as tools: their JSON schema for the chat template, and a call's arguments checked.

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first term
            b: the second term
        '''
    tool = Tool.from_function(add)
    tool.schema                  # {"type": "function", "function": {"name": "add", "description", "parameters"}}
    tool.check({"a": 1, "b": 2}) # the arguments, or ToolArgumentError naming the field (what the model is told)

The schema is transformers' `get_json_schema` (types from the annotations, the description from the docstring,
each parameter described in an `Args:` section, a default making it optional). Checking a model's call
against it is not in transformers or in a dependency of ours (jsonschema is not one), and needs only the
handful of types such a schema holds, so it is here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from aligner.runtime.errors import ConfigError


class ToolArgumentError(ValueError):
    """A call's arguments do not fit the tool's signature; the message is what the model is told."""


def _fits(value: Any, schema: dict) -> bool:
    """Whether `value` is of the JSON schema's type (a union is a list of types)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        return any(_fits(value, {**schema, "type": option}) for option in kind)
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and all(_fits(item, schema["items"]) for item in value) \
            if "items" in schema else isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return True


@dataclass(frozen=True)
class Tool:
    """A named function the model may call, with the JSON schema the chat template shows it."""

    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    target: Optional[str] = None  # "module:function" or "file.py:function": where the sandbox finds it
    function: Optional[Callable[..., Any]] = None  # the function itself, for tools built in this process

    @classmethod
    def from_function(cls, function: Callable[..., Any], target: Optional[str] = None) -> "Tool":
        try:
            schema = get_json_schema(function)
        except (DocstringParsingException, TypeHintParsingException) as error:
            raise ConfigError(f"tool {getattr(function, '__name__', function)!r}: {error}") from error
        return cls.from_schema(schema, target, function)

    @classmethod
    def from_schema(cls, schema: dict, target: Optional[str] = None,
                    function: Optional[Callable[..., Any]] = None) -> "Tool":
        """A tool from its JSON schema ({"type": "function", "function": {name, description, parameters}})."""
        body = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(body, dict) or not isinstance(body.get("name"), str) \
                or not isinstance(body.get("parameters", {}), dict):
            raise ConfigError(f"tool {target or ''}: not a function schema: {str(schema)[:120]}")
        parameters = {"type": "object", "properties": {}, "required": [], **body.get("parameters", {})}
        return cls(body["name"], body.get("description", ""), parameters, target, function)

    @property
    def schema(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def check(self, arguments: Any) -> dict:
        """The arguments of a call, checked against the signature (ToolArgumentError names the field)."""
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"{self.name}: arguments must be a JSON object, got {type(arguments).__name__}")
        properties = self.parameters["properties"]
        unknown = sorted(set(arguments) - set(properties))
        if unknown:
            raise ToolArgumentError(f"{self.name}: unknown argument {unknown[0]!r}; it takes "
                                    f"{', '.join(properties) or 'no arguments'}")
        missing = [key for key in self.parameters["required"] if key not in arguments]
        if missing:
            raise ToolArgumentError(f"{self.name}: missing argument {missing[0]!r}")
        for key, value in arguments.items():
            if value is None and properties[key].get("nullable"):
                continue
            if not _fits(value, properties[key]):
                raise ToolArgumentError(f"{self.name}: argument {key!r} must be {properties[key]['type']}"
                                        f"{' in ' + repr(properties[key]['enum']) if 'enum' in properties[key] else ''}"
                                        f", got {value!r}")
        return dict(arguments)
