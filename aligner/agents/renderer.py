"""The chat template of a multi-turn episode, owned in one place.

    renderer = ChatRenderer(tokenizer, tools=schemas)     # self-tests the template (see below)
    prompt_ids, chat = renderer.start(messages)            # the rendered start, ready for the model's turn
    segments = renderer.continuation(chat, model_ids, [{"role": "tool", "content": "19"}])
    # -> boundary / environment segments: the template's text after the model's turn, the observation,
    #    and the next generation prompt; the past is never rendered into tokens again

The model's ids go into the episode as generated. Their text (decoded once) is what the template is given
for the model's turn, so that the text after it is the template's; nothing before the new turn is encoded
again. That only works for templates that render a conversation as the concatenation of its turns: a
template that rewrites earlier turns (Qwen3's removes `<think>` blocks from replies before the last user
message) would make the episode's tokens differ from what the model sees at its next turn and from the
SFT encoding of the same conversation. `ChatRenderer` checks this when it is built, on probe conversations
(initial, model, tool and user turns, a reply with a reasoning block): the incremental tokens must equal
the template applied to the whole conversation (`Tokenizer.encode_chat`, the SFT encoding), else it refuses
in one line; give it a training template (`template=`) that keeps earlier turns as they were.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from jinja2.exceptions import TemplateError

from aligner.agents.episode import Segment
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer


@dataclass
class RenderedChat:
    """A conversation so far: its messages (what the template is given) and the text its tokens spell."""

    messages: list[dict]
    text: str
    ended_turns: int = 0  # model turns appended so far


@dataclass
class Probe:
    """A conversation the self-test renders turn by turn; model turns are assistant messages."""

    name: str
    messages: list[dict] = field(default_factory=list)


# Conversations every template must render as the concatenation of their turns: a tool turn, a user turn after
# a model turn, a reply with a reasoning block followed by more turns, and text whose pieces tokenize
# differently alone than together.
PROBES = (
    Probe("tool turn", [
        {"role": "user", "content": "What is 12+79?"},
        {"role": "assistant", "content": "I will use the calculator."},
        {"role": "tool", "content": "91"},
        {"role": "assistant", "content": "12+79=91."},
    ]),
    Probe("user turn after a reply", [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ]),
    Probe("reasoning block before a later user turn", [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "<think>2 plus 3 is 5.</think>The answer is 5."},
        {"role": "user", "content": "And 3+4?"},
        {"role": "assistant", "content": "<think>3 plus 4 is 7.</think>7."},
    ]),
)


class ChatRenderer:
    """Renders an episode's start and appends each environment turn as boundary + environment tokens.

    tools: JSON schemas for the template's tools slot. template: a training chat template used instead of the
    tokenizer's (for models whose own template rewrites earlier turns). The template is self-tested on PROBES
    when the renderer is built (ConfigError in one line if it fails).
    """

    def __init__(self, tokenizer: Tokenizer, *, tools: Optional[list[dict]] = None, template: Optional[str] = None,
                 probes=PROBES):
        if template is None and not tokenizer.has_chat_template:
            raise ConfigError("multi-turn episodes need a chat template: the tokenizer has none; set a training "
                              "template (rollout.chat_template)")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template = template
        self.end_text = tokenizer.hf.convert_ids_to_tokens(tokenizer.eos_id)  # what closes a model turn
        # The roles the template renders (a plain template may know no tool or system role): probes with others
        # are skipped, and an environment message in one of them is refused by `continuation`.
        self.roles = {"user", "assistant"} | {role for role in ("system", "tool") if self._renders(role)}
        for probe in probes:
            if {message["role"] for message in probe.messages} <= self.roles:
                self._self_test(probe)

    def _renders(self, role: str) -> bool:
        messages = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"},
                    {"role": role, "content": "3"}]
        try:
            self.render(messages if role != "system" else messages[2:] + messages[:2], add_generation_prompt=True)
        except TemplateError:
            return False
        return True

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt, tools=self.tools, template=self.template)

    def start(self, messages: list[dict]) -> tuple[list[int], RenderedChat]:
        """The prompt's tokens, ending where the model's first token goes, and the chat to continue."""
        text = self.render(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text), RenderedChat(list(messages), text)

    def model_text(self, model_ids: list[int]) -> tuple[str, bool]:
        """(the text the template is given for a model turn, whether the turn ended with the end token)."""
        ended = bool(model_ids) and model_ids[-1] == self.tokenizer.eos_id
        body = model_ids[:-1] if ended else model_ids
        return self.tokenizer.hf.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False), ended

    def continuation(self, chat: RenderedChat, model_ids: list[int], observation: list[dict]) -> list[Segment]:
        """The segments after the model's turn `model_ids`: the template's close of that turn (what the model did
        not generate of it), each message of `observation` (boundary + environment tokens) and the generation
        prompt of the next model turn. `chat` moves on to the end of them."""
        unknown = sorted({message["role"] for message in observation} - self.roles)
        if unknown:
            raise ConfigError(f"the chat template cannot render a {unknown[0]!r} message (it renders "
                              f"{', '.join(sorted(self.roles))}); set a training template (rollout.chat_template) "
                              "that does, or answer in those roles")
        content, ended = self.model_text(model_ids)
        messages = chat.messages + [{"role": "assistant", "content": content}]
        through = self.render(messages, add_generation_prompt=False)
        after = self.render(messages + list(observation), add_generation_prompt=True)
        turn = chat.ended_turns + 1
        if not through.startswith(chat.text) or not after.startswith(through):
            raise ConfigError(f"the chat template rewrites earlier turns (model turn {turn} renders the "
                              "conversation before it differently), so an episode's tokens would differ from what "
                              "the model reads; set a training template (rollout.chat_template) that keeps earlier "
                              "turns as they were")
        model_part = through[len(chat.text):]
        # Where the model's turn ends in the template's text: after its end token when it generated one (the
        # template may trim the reply's whitespace, so the end token is searched for after the reply's text),
        # else right after the reply's text (the template then closes the turn itself). A turn stopped by a stop
        # string may end in whitespace (the stop's last token ">\n"): a template that keeps it verbatim is given
        # the reply whole, so that whitespace is not rendered a second time.
        reply = content if content and content in model_part else content.strip()
        start = model_part.find(reply) if reply else 0
        if start < 0:
            raise ConfigError(f"the chat template changes the text of model turn {turn} (it does not contain the "
                              "reply as generated); set a training template that renders replies verbatim")
        reply_end = start + len(reply)
        if ended:
            close = model_part.find(self.end_text, reply_end)
            if close < 0:
                raise ConfigError(f"the chat template does not close model turn {turn} with the end token "
                                  f"{self.end_text!r} the model generated")
            reply_end = close + len(self.end_text)
        text = model_part[reply_end:] + after[len(through):]
        # Encoded as one piece, as the SFT encoding does (so the tokens are the same); each token is then the
        # observation's when it starts inside a message's text, the template's otherwise.
        observed = []
        cursor = 0
        for message in observation:
            body = str(message.get("content", ""))
            found = text.find(body, cursor) if body else -1
            if found >= 0:  # else the template renders it in a form of its own: the template's tokens
                observed.append((found, found + len(body)))
                cursor = found + len(body)
        segments: list[Segment] = []
        for token, (begin, _) in zip(*self._encode_with_offsets(text)):
            kind = "environment" if any(low <= begin < high for low, high in observed) else "boundary"
            if segments and segments[-1].kind == kind:
                segments[-1] = Segment(kind, segments[-1].tokens + (token,))
            else:
                segments.append(Segment(kind, (token,)))
        chat.messages = messages + list(observation)
        chat.text = after
        chat.ended_turns = turn
        return segments

    def _encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = self.tokenizer.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        return encoded["input_ids"], encoded["offset_mapping"]

    def _self_test(self, probe: Probe) -> None:
        """The incremental tokens of `probe` equal the SFT encoding of the whole conversation."""
        messages = probe.messages
        first = next(index for index, message in enumerate(messages) if message["role"] == "assistant")
        tokens, chat = self.start(messages[:first])
        index = first
        try:
            while index < len(messages):
                reply = messages[index]
                model_ids = self.tokenizer.encode(reply["content"]) + [self.tokenizer.eos_id]
                following = index + 1
                while following < len(messages) and messages[following]["role"] != "assistant":
                    following += 1
                segments = self.continuation(chat, model_ids, messages[index + 1:following])
                tokens += model_ids + [token for segment in segments for token in segment.tokens]
                index = following
        except ConfigError as error:
            raise ConfigError(f"chat template self-test '{probe.name}': {error}") from error
        whole = self.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=self.tools,
                                           template=self.template)[0]
        if tokens != whole:
            at = next((i for i, (a, b) in enumerate(zip(tokens, whole)) if a != b), min(len(tokens), len(whole)))
            raise ConfigError(f"chat template self-test '{probe.name}': turn-by-turn tokens differ from the template "
                              f"applied to the whole conversation at token {at} "
                              f"({self.tokenizer.hf.decode(tokens[at:at + 8])!r} vs "
                              f"{self.tokenizer.hf.decode(whole[at:at + 8])!r}); the template rewrites earlier turns: "
                              "set a training template (rollout.chat_template) that keeps them as they were")
