"""Episodes of token segments and the renderer that owns the chat template across turns."""
from __future__ import annotations

import pytest

from aligner.agents.episode import Episode, Segment
from aligner.agents.renderer import PROBES, ChatRenderer, Probe
from aligner.runtime.errors import ConfigError
from tests.chat_tokenizers import THINKING_TEMPLATE, build_chat_tokenizer

CALCULATOR = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


@pytest.fixture(scope="module", params=["smollm2", "qwen_tools", "llama3"])
def tokenizer(request, tmp_path_factory):
    return build_chat_tokenizer(tmp_path_factory.mktemp(request.param), request.param)


# ----------------------------------------------------------------------------- the record
def test_segments_concatenate_to_the_row_and_only_model_tokens_are_trained():
    episode = Episode([Segment.prompt([5, 6, 7])])
    episode.add_model([8, 9], [-0.5, -1.5], policy_version=3)
    episode.add([Segment.boundary([1]), Segment.environment([20, 21, 22]), Segment.boundary([2, 3])])
    episode.add_model([10], [-0.25], policy_version=4)
    episode.end("done")
    assert episode.tokens == [5, 6, 7, 8, 9, 1, 20, 21, 22, 2, 3, 10]
    assert episode.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert episode.behaviour_logprobs == [0, 0, 0, -0.5, -1.5, 0, 0, 0, 0, 0, 0, -0.25]
    assert episode.policy_versions == [3, 4]
    assert (episode.model_turns, episode.prompt_length, len(episode)) == (2, 3, 12)
    assert [episode.count(kind) for kind in ("prompt", "model", "environment", "boundary")] == [3, 3, 3, 3]


def test_a_single_turn_rollout_is_an_episode_of_one_model_segment():
    episode = Episode.single_turn([1, 2, 3], [4, 5], [-0.1, -0.2], policy_version=0)
    assert episode.tokens == [1, 2, 3, 4, 5]
    assert episode.loss_mask == [0, 0, 0, 1, 1]
    assert episode.behaviour_logprobs == [0, 0, 0, -0.1, -0.2]


@pytest.mark.parametrize("make, message", [
    (lambda: Segment("tool", (1,)), "segment kind 'tool'"),
    (lambda: Segment("model", (1, 2), (-0.1,), 0), "2 tokens has 1 logprobs"),
    (lambda: Segment("model", (1,), None, 0), "needs the engine's logprobs"),
    (lambda: Segment("environment", (1,), (-0.1,)), "carries no logprobs"),
    (lambda: Episode([Segment.boundary([1])]), "starts with its prompt"),
    (lambda: Episode([Segment.prompt([1])]).add([Segment.prompt([2])]), "one prompt segment"),
    (lambda: Episode([Segment.prompt([1])]).end("finished"), "episode status 'finished'"),
])
def test_malformed_records_are_refused(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_nothing_is_added_after_the_end():
    episode = Episode([Segment.prompt([1])])
    episode.end("max_turns")
    with pytest.raises(ValueError, match="already ended"):
        episode.add_model([2], [-1.0], 0)


# ----------------------------------------------------------------------------- the renderer
def play(renderer, messages):
    """Turn by turn, as an agent rollout does: the episode and the renderer's chat at the end."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt, chat = renderer.start(messages[:first])
    episode = Episode([Segment.prompt(prompt)])
    index = first
    while index < len(messages):
        following = index + 1
        while following < len(messages) and messages[following]["role"] != "assistant":
            following += 1
        ids = renderer.tokenizer.encode(messages[index]["content"]) + [renderer.tokenizer.eos_id]
        episode.add_model(ids, [-1.0] * len(ids), policy_version=0)
        episode.add(renderer.continuation(chat, ids, messages[index + 1:following]))
        index = following
    return episode, chat


@pytest.mark.parametrize("tools", [None, [CALCULATOR]])
def test_turn_by_turn_tokens_equal_the_template_on_the_whole_conversation(tokenizer, tools):
    renderer = ChatRenderer(tokenizer, tools=tools)  # self-tests the probes
    messages = [{"role": "user", "content": "What is 12+79?"},
                {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 79}}'
                                                 '</tool_call>'},
                {"role": "tool", "content": "91"}, {"role": "tool", "content": "(checked)"},
                {"role": "assistant", "content": "12+79=91."},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": "You are welcome."}]
    episode, chat = play(renderer, messages)
    whole, sft_mask = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
    assert episode.tokens == whole
    assert episode.loss_mask == sft_mask  # the model's tokens are exactly what SFT trains on
    assert chat.text == tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools)
    environment = [tokenizer.hf.decode(list(s.tokens)) for s in episode.segments if s.kind == "environment"]
    assert environment == ["91", "(checked)", "Thanks!"]
    prompt = tokenizer.hf.decode(list(episode.segments[0].tokens))
    assert ('"name": "add"' in prompt) == (tools is not None and "tools" in tokenizer.hf.chat_template)


def test_model_ids_are_kept_as_generated_when_their_text_encodes_to_other_ids(tokenizer):
    renderer = ChatRenderer(tokenizer)
    prompt, chat = renderer.start([{"role": "user", "content": "Hello"}])
    canonical = tokenizer.encode("The capital of France is Paris.")
    # the same text spelled one byte-level token per character: decodes to the same text, encodes back to others
    spelled = [tokenizer.hf.convert_tokens_to_ids(piece)
               for piece in tokenizer.hf.convert_ids_to_tokens(canonical) for piece in piece] + [tokenizer.eos_id]
    assert tokenizer.hf.decode(spelled[:-1]) == "The capital of France is Paris."
    assert spelled[:-1] != canonical and tokenizer.encode(tokenizer.hf.decode(spelled[:-1])) == canonical
    episode = Episode([Segment.prompt(prompt)])
    episode.add_model(spelled, [-0.5] * len(spelled), policy_version=1)
    episode.add(renderer.continuation(chat, spelled, [{"role": "user", "content": "And Spain?"}]))
    model = [s for s in episode.segments if s.kind == "model"]
    assert [list(s.tokens) for s in model] == [spelled]
    start = len(prompt)
    assert episode.tokens[start:start + len(spelled)] == spelled
    assert sum(episode.loss_mask) == len(spelled)


def test_a_turn_cut_by_the_token_limit_is_closed_by_the_template(tokenizer):
    renderer = ChatRenderer(tokenizer)
    prompt, chat = renderer.start([{"role": "user", "content": "Hello"}])
    cut = tokenizer.encode("The capital of")  # no end token: max_new_tokens reached
    segments = renderer.continuation(chat, cut, [{"role": "user", "content": "Go on."}])
    boundary = tokenizer.hf.decode(list(segments[0].tokens), skip_special_tokens=False)
    assert segments[0].kind == "boundary" and boundary.startswith(renderer.end_text)


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path / "thinking", "thinking")
    with pytest.raises(ConfigError) as error:
        ChatRenderer(tokenizer)
    message = str(error.value)
    assert "\n" not in message
    assert "'reasoning block before a later user turn'" in message and "rollout.chat_template" in message
    # the same model with a training template that keeps reasoning in earlier turns
    keeping = THINKING_TEMPLATE.replace("and '</think>' in content", "and false")
    renderer = ChatRenderer(tokenizer, template=keeping)
    episode, _ = play(renderer, PROBES[2].messages)
    assert episode.tokens == tokenizer.encode_chat(PROBES[2].messages, add_generation_prompt=True,
                                                   template=keeping)[0]


def test_the_self_test_compares_tokens_not_only_text(tmp_path):
    """A template whose text is a concatenation but whose pieces the SFT encoding cuts elsewhere is caught: here
    the generation prompt differs from the assistant header the template renders for a finished reply."""
    tokenizer = build_chat_tokenizer(tmp_path / "odd", "smollm2", template=(
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n ' }}{% endif %}"))
    with pytest.raises(ConfigError, match="self-test"):
        ChatRenderer(tokenizer, probes=[Probe("one reply", [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello there."}])])
