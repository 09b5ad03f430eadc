"""SteerLM attribute conditioning: attribute values rendered into the prompt, for training and generation.

SteerLM (Dong et al., 2023) trains on responses annotated with attribute values (e.g. correctness
0..4) by an attribute-prediction model, with the values written into the prompt; at inference
the user writes the values they want. This module owns that rendering, so training examples and
generation prompts are laid out by the same code.

The layout (fixed; `SteerLMConfig.format` picks how the values are spelled):

    <attribute line>\n<prompt>

    format "named":  correctness:4,helpfulness:3   (the label syntax of the regression reward data)
    format "values": 4 3                            (values in `attributes` order, space-separated)

"values" exists for tokenizers that cannot spell attribute names (the demo's character tokenizer
knows only digits, '+', '=', space and newline). Values are non-negative integers (the attribute
scales, e.g. 0..4); annotation (examples/nlp/data/steerlm/annotate.py) rounds and clips the
predicted scores onto them.

Where the line goes: in an {"input", "output"} record it is prefixed to "input"; in a
{"conversations"} or {"messages"} record it becomes the system message (prefixed to an existing
one, on its own line; `condition_messages`, as generation does for a conversational prompt), so
with a plain chat template both layouts give the same tokens. Annotated records carry their values
as "attributes": {"correctness": 4} (or a label string "correctness:4").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from aligner import checkpointing, config
from aligner.config import one_of
from aligner.data.jsonl import DataError
from aligner.data.reward import parse_label
from aligner.data.sft import conversation_key, parse_conversation
from aligner.runtime.errors import ConfigError

FORMATS = ("named", "values")
ATTRIBUTES_KEY = "attributes"  # the annotated record's key holding its attribute values
CHECKPOINT_META_KEY = "steerlm"  # the section of a checkpoint's meta that says how it was conditioned


@dataclass
class SteerLMConfig:
    """`data.steerlm` of aligner/conf/gpt_sft.yaml: attribute-conditioned SFT when `attributes` is non-empty."""

    attributes: list[str] = field(default_factory=list)  # names, in rendering order; empty: plain SFT
    format: str = one_of(FORMATS, "named")  # named: "correctness:4,helpfulness:3" | values: "4 3"

    @property
    def enabled(self) -> bool:
        return bool(self.attributes)

    def validate(self) -> None:
        config.check_values(self, "data.steerlm.")  # the format again: a checkpoint's meta skips load_config
        for name in self.attributes:
            if not isinstance(name, str) or not name.strip() or name != name.strip() or any(c in name for c in ",: \n"):
                raise ConfigError(f"steerlm attribute name {name!r} must be non-empty, "
                                  "without ',', ':', spaces or newlines")
        if len(set(self.attributes)) != len(self.attributes):
            raise ConfigError(f"steerlm attributes {self.attributes} name an attribute twice")

    def to_dict(self) -> dict:
        return {"attributes": list(self.attributes), "format": self.format}


# ----------------------------------------------------------------------------- the attribute line
def check_values(values: Mapping[str, Any], cfg: SteerLMConfig, where: str = "") -> dict[str, int]:
    """The values of every attribute of `cfg`, as ints, in `cfg.attributes` order; errors say what is off.

    where: a prefix for error messages (e.g. "data.jsonl:3: ").
    """
    unknown = [name for name in values if name not in cfg.attributes]
    missing = [name for name in cfg.attributes if name not in values]
    if unknown or missing:
        parts = ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else []) + (
            [f"missing {', '.join(map(repr, missing))}"] if missing else [])
        raise DataError(f"{where}attribute values {dict(values)} do not match the conditioned attributes "
                        f"{cfg.attributes}: {'; '.join(parts)}")
    checked = {}
    for name in cfg.attributes:
        value = values[name]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or value != int(value) or value < 0:
            raise DataError(f"{where}attribute {name!r} has value {value!r}; expected a non-negative integer "
                            "(annotate.py rounds predicted scores onto the attribute's integer scale)")
        checked[name] = int(value)
    return checked


def render_attributes(values: Mapping[str, Any], cfg: SteerLMConfig) -> str:
    """The attribute line (no newline): "correctness:4,helpfulness:3" or "4 3"."""
    checked = check_values(values, cfg)
    if cfg.format == "named":
        return ",".join(f"{name}:{checked[name]}" for name in cfg.attributes)
    return " ".join(str(checked[name]) for name in cfg.attributes)


def parse_attributes(line: str, cfg: SteerLMConfig) -> dict[str, int]:
    """The inverse of render_attributes: attribute values of an attribute line."""
    if cfg.format == "named":
        items = [item.partition(":") for item in line.split(",")]
        if any(not colon for _, colon, _ in items):
            raise DataError(f"attribute line {line!r} is not 'name:value,...'")
        raw = {name: text for name, _, text in items}
        if len(raw) != len(items):
            raise DataError(f"attribute line {line!r} names an attribute twice")
    else:
        texts = line.split(" ")
        if len(texts) != len(cfg.attributes):
            raise DataError(f"attribute line {line!r} has {len(texts)} values, expected {len(cfg.attributes)} "
                            f"({' '.join(cfg.attributes)})")
        raw = dict(zip(cfg.attributes, texts))
    if not all(text.isascii() and text.isdigit() for text in raw.values()):
        raise DataError(f"attribute line {line!r} has a value that is not a non-negative integer")
    return check_values({name: int(text) for name, text in raw.items()}, cfg)


def condition_prompt(prompt: str, values: Mapping[str, Any], cfg: SteerLMConfig) -> str:
    """A prompt asking for the given attribute values: attribute line, newline, prompt."""
    return f"{render_attributes(values, cfg)}\n{prompt}"


def split_conditioned_prompt(text: str, cfg: SteerLMConfig) -> tuple[dict[str, int], str]:
    """(attribute values, prompt) of a conditioned prompt: the inverse of condition_prompt."""
    line, newline, prompt = text.partition("\n")
    if not newline:
        raise DataError(f"{text!r} has no attribute line (expected '<attributes>\\n<prompt>')")
    return parse_attributes(line, cfg), prompt


def condition_messages(messages: list[dict], values: Mapping[str, Any], cfg: SteerLMConfig) -> list[dict]:
    """Chat messages asking for the given values: the attribute line becomes (or opens) the system message."""
    line = render_attributes(values, cfg)
    if messages and messages[0].get("role") == "system":
        system = messages[0]["content"]
        return [{"role": "system", "content": f"{line}\n{system}" if system.strip() else line}, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


# ----------------------------------------------------------------------------- training records
class AttributeConditioning:
    """Turns an annotated SFT record into a plain SFT record with its attribute line in the prompt.

    Used as `SFTDataset(..., prepare_record=AttributeConditioning(cfg, tokenizer))`. With a
    tokenizer, each distinct attribute line is checked to encode and decode back unchanged: a
    line the tokenizer cannot spell (characters mapped to <unk>) would condition on nothing.
    """

    def __init__(self, cfg: SteerLMConfig, tokenizer=None):
        cfg.validate()
        if not cfg.enabled:
            raise ConfigError("AttributeConditioning needs at least one attribute name")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._spelled: set[str] = set()

    def __call__(self, record: dict, path: str | Path, line: int) -> dict:
        where = f"{path}:{line}: "
        if ATTRIBUTES_KEY not in record:
            raise DataError(f"{where}record has no {ATTRIBUTES_KEY!r} (keys present: "
                            f"{', '.join(sorted(map(repr, record))) or 'none'}); SteerLM training needs annotated "
                            "records: run examples/nlp/data/steerlm/annotate.py on the SFT data first")
        label, mask = parse_label(record[ATTRIBUTES_KEY], self.cfg.attributes, path, line)
        values = {name: value for name, value, present in zip(self.cfg.attributes, label, mask) if present}
        try:
            attribute_line = render_attributes(values, self.cfg)
        except ValueError as error:
            raise DataError(f"{where}{error}") from None
        self._check_spelling(attribute_line, where)
        conditioned = {key: value for key, value in record.items() if key != ATTRIBUTES_KEY}
        if conversation_key(record) is not None:
            # Either layout becomes {"messages"}: the record's own system turns stay after the line.
            messages = condition_messages(parse_conversation(record, path, line), values, self.cfg)
            conditioned = {key: value for key, value in conditioned.items() if key not in ("system", "conversations")}
            conditioned["messages"] = messages
        elif "input" in record:
            if not isinstance(record["input"], str):
                raise DataError(f"{where}key 'input' is a {type(record['input']).__name__}; expected a string")
            conditioned["input"] = f"{attribute_line}\n{record['input']}"
        # else: encode_record reports the missing input/output/conversations/messages keys with file and line
        return conditioned

    def _check_spelling(self, attribute_line: str, where: str) -> None:
        if self.tokenizer is None or attribute_line in self._spelled:
            return
        text = attribute_line + "\n"
        if self.tokenizer.decode(self.tokenizer.encode(text)) != text:
            raise DataError(
                f"{where}the tokenizer cannot spell the attribute line {attribute_line!r} (it decodes back as "
                f"{self.tokenizer.decode(self.tokenizer.encode(text))!r}: characters outside its vocabulary); "
                "use data.steerlm.format=values (digits and spaces only) or a tokenizer that knows these characters")
        self._spelled.add(attribute_line)


# ----------------------------------------------------------------------------- checkpoints
def conditioning_from_meta(meta: dict) -> Optional[SteerLMConfig]:
    """How a checkpoint was conditioned (its meta's "steerlm" section), or None for a plain model."""
    section = meta.get(CHECKPOINT_META_KEY)
    if not section:
        return None
    cfg = SteerLMConfig(attributes=list(section["attributes"]), format=section["format"])
    cfg.validate()
    return cfg


def steering_for_checkpoint(checkpoint_dir: str | Path, values: Optional[Mapping[str, Any]]) -> Optional[SteerLMConfig]:
    """The conditioning of a checkpoint that is asked for `values`; errors if the two do not fit.

    values None: no steering asked for (None is returned whatever the checkpoint).
    """
    if values is None:
        return None
    cfg = conditioning_from_meta(checkpointing.read_meta(checkpoint_dir))
    if cfg is None:
        raise ConfigError(f"attribute values {dict(values)} were asked for, but {checkpoint_dir} was not trained with "
                          "attribute conditioning (no 'steerlm' section in its meta); "
                          "train it with data.steerlm.attributes")
    check_values(values, cfg, where=f"{checkpoint_dir}: ")
    return cfg


def parse_requested_values(text: str) -> dict[str, int]:
    """Command-line attribute values "correctness=4,helpfulness=2" -> {"correctness": 4, "helpfulness": 2}."""
    values = {}
    for item in text.split(","):
        name, equals, value = item.strip().partition("=")
        if not equals or not name.strip() or not value.strip().isdigit():
            raise ConfigError(f"attribute request {text!r}: item {item.strip()!r} is not name=<non-negative integer>, "
                              "e.g. correctness=4,helpfulness=2")
        if name.strip() in values:
            raise ConfigError(f"attribute request {text!r} names {name.strip()!r} twice")
        values[name.strip()] = int(value)
    return values
