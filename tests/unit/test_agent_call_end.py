"""A turn that calls a tool stops where the call ends (the format's `call_end`), and the episode is still the chat
template applied to the whole conversation, with a scripted model that stops as the native engine does."""
from __future__ import annotations

import pytest
import torch

from aligner.agents.builtin import calculate
from aligner.agents.environment import ToolEnvironment
from aligner.agents.renderer import ChatRenderer
from aligner.agents.rollout import EpisodeLimits, EpisodeRunner, episode_row
from aligner.agents.tools import Tool
from aligner.generation.engine import GenerationEngine, Rollout, SamplingParams
from aligner.runtime.sandbox import SandboxResult
from tests.chat_tokenizers import build_chat_tokenizer
from tests.unit.test_agent_rollout import Game

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "12+79"}}</tool_call>'
MADE_UP = "\n<tool_response>\n100\n</tool_response>\nSo 12+79 is 100."  # what the model would write next


class StoppingModel(GenerationEngine):
    """Writes reply(prompt text) + the end token, token by token, stopping as the native engine does: after a stop
    token (sampling.stop_token_ids, default the end token) or after the first token at which the decoded response
    (`Tokenizer.decode`, the engine's `decode`) contains one of sampling.stop_strings."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.samplings = tokenizer, reply, []

    def generate(self, prompts, sampling):
        self.samplings.append(sampling)
        stop_ids = set(sampling.stop_token_ids or [self.tokenizer.eos_id])
        rows, stopped = [], []
        for prompt in prompts:
            text = self.reply(self.tokenizer.hf.decode(prompt, skip_special_tokens=False))
            kept, ended = [], False
            for token in (self.tokenizer.encode(text) + [self.tokenizer.eos_id])[:sampling.max_new_tokens]:
                kept.append(token)
                if token in stop_ids or any(stop in self.tokenizer.decode(kept) for stop in sampling.stop_strings):
                    ended = True
                    break
            rows.append(kept)
            stopped.append(ended)
        tokens = torch.zeros(len(rows), sampling.max_new_tokens, dtype=torch.long)
        logprobs = torch.zeros(len(rows), sampling.max_new_tokens)
        for i, ids in enumerate(rows):
            tokens[i, :len(ids)] = torch.tensor(ids)
            logprobs[i, :len(ids)] = -0.5
        return Rollout(prompts, tokens, logprobs, torch.tensor([len(ids) for ids in rows]), torch.tensor(stopped))


def calculator_user(text: str) -> str:
    """Calls the calculator and goes on to make up its answer; once the tool has answered, answers with it."""
    return "12+79 = 91." if "91" in text else CALL + MADE_UP


class InProcessPool:
    """Runs the calculator in this process, answering as a sandbox pool does."""

    def call(self, target, **arguments):
        return SandboxResult("ok", calculate(**arguments))


def tool_environment(**options):
    tools = {"calculate": Tool.from_function(calculate, target="builtin.py:calculate")}
    return ToolEnvironment(InProcessPool(), tools, call_format="hermes",
                           reward=lambda record, answer: float("91" in answer), **options)


def run(tokenizer, max_turns=4):
    model = StoppingModel(tokenizer, calculator_user)
    runner = EpisodeRunner(model, lambda tools: ChatRenderer(tokenizer, tools=tools), tool_environment,
                           SamplingParams(max_new_tokens=160, seed=1),
                           EpisodeLimits(max_turns=max_turns, on_cut_turn="end"))  # a cut turn would end it
    return model, runner.run([{"prompt": "What is 12+79?"}], ["p:1"]).episodes[0]


def model_texts(tokenizer, episode):
    return [tokenizer.hf.decode(list(s.tokens), skip_special_tokens=False) for s in episode.segments
            if s.kind == "model"]


@pytest.mark.parametrize("kind", ["smollm2", "qwen_tools"])
def test_a_hermes_call_stops_the_turn_and_the_episode_is_the_template_on_the_conversation(kind, tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path, kind)
    model, episode = run(tokenizer)
    assert (episode.status, episode.reward, episode.model_turns) == ("done", 1.0, 2)
    sampling = model.samplings[0]
    if kind == "qwen_tools":  # </tool_call> is one added token: it stops as a token id, beside the end token
        assert sampling.stop_token_ids == sorted([tokenizer.eos_id, tokenizer.hf.convert_tokens_to_ids("</tool_call>")])
        assert sampling.stop_strings == []
    else:  # several tokens: a stop string, checked on the decoded response
        assert sampling.stop_strings == ["</tool_call>"] and sampling.stop_token_ids == []
    # the first turn ends with the call: what the model would have written after it was never generated
    first, second = model_texts(tokenizer, episode)
    assert first == CALL and second.startswith("12+79 = 91.")
    text = tokenizer.hf.decode(episode.tokens, skip_special_tokens=False)
    assert "100" not in text and "<tool_response>\n100" not in text
    # the template closed the stopped turn (its end token is a boundary token, not trained on) ...
    after_call = episode.segments[episode.segments.index(next(s for s in episode.segments if s.kind == "model")) + 1]
    assert after_call.kind == "boundary" and after_call.tokens[0] == tokenizer.eos_id
    # ... and the tool's answer is the environment's
    observed = [tokenizer.hf.decode(list(s.tokens)) for s in episode.segments if s.kind == "environment"]
    assert observed == ["91"]
    # the episode is the template applied to the whole conversation, trained on the model's tokens only
    messages = [{"role": "user", "content": "What is 12+79?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "91"}, {"role": "assistant", "content": "12+79 = 91."}]
    whole, mask = tokenizer.encode_chat(messages, tools=[tool_environment().tools["calculate"].schema])
    assert episode.tokens == whole[:len(episode)] and len(whole) - len(episode) <= 1
    # the SFT mask of the same conversation also trains on the end token after the call; the model never
    # generated that one (it stopped at the call's end), so the episode trains on everything else it does
    close = sum(len(s) for s in episode.segments[:episode.segments.index(after_call)])
    assert [i for i, (a, b) in enumerate(zip(episode.loss_mask, mask)) if a != b] == [close]
    assert mask[close] == 1 and whole[close] == tokenizer.eos_id
    assert episode_row(episode).ended_with_stop


def test_a_turn_stopped_at_the_call_is_a_stopped_turn_not_a_cut_one(tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path, "smollm2")
    _, episode = run(tokenizer, max_turns=1)
    assert episode.status == "max_turns" and episode.model_turns == 1  # on_cut_turn=end would say truncated
    assert model_texts(tokenizer, episode) == [CALL]
    assert episode.last_turn_stopped and episode_row(episode).ended_with_stop


def test_which_environments_stop_turns_at_a_call_end():
    assert tool_environment().stop_strings == ("</tool_call>",)
    # parallel calls: the turn ends with the model's end token, a stop at the first call would allow no second
    assert tool_environment(max_parallel_calls=2).stop_strings == ()
    for call_format in ("llama3_json", "plain"):  # the turn's end token ends the call / no fixed end
        assert ToolEnvironment(InProcessPool(), {}, call_format=call_format).stop_strings == ()
    assert Game().stop_strings == ()


def test_game_turns_keep_the_configured_sampling(tmp_path):
    tokenizer = build_chat_tokenizer(tmp_path, "smollm2")
    model = StoppingModel(tokenizer, lambda text: "50")
    sampling = SamplingParams(max_new_tokens=8, seed=1, stop_strings=["STOP"], stop_token_ids=[7])
    EpisodeRunner(model, lambda tools: ChatRenderer(tokenizer, tools=tools), Game, sampling,
                  EpisodeLimits(max_turns=2)).run([{"secret": 50}], ["p:1"])
    assert (model.samplings[0].stop_strings, model.samplings[0].stop_token_ids) == (["STOP"], [7])


@pytest.mark.parametrize("kind", ["smollm2", "qwen_tools", "llama3"])
def test_a_stopped_turn_ending_in_whitespace_is_rendered_once(kind, tmp_path):
    """A stop string's last token may carry text after it (">\\n"): a template that keeps replies verbatim must
    not render that whitespace a second time after the model's tokens."""
    tokenizer = build_chat_tokenizer(tmp_path, kind)
    renderer = ChatRenderer(tokenizer)
    messages = [{"role": "user", "content": "What is 12+79?"}]
    prompt, chat = renderer.start(messages)
    reply = CALL + "\n"
    model_ids = tokenizer.encode(reply)  # no end token: stopped by a stop string
    segments = renderer.continuation(chat, model_ids, [{"role": "tool", "content": "91"}])
    tokens = prompt + model_ids + [token for segment in segments for token in segment.tokens]
    whole, _ = tokenizer.encode_chat(messages + [{"role": "assistant", "content": reply},
                                                 {"role": "tool", "content": "91"}], add_generation_prompt=True)
    if kind == "llama3":  # its template trims replies: the model's newline stays, the template's text follows it
        assert tokens[len(prompt) + len(model_ids):] == whole[len(prompt) + len(tokenizer.encode(CALL)):]
    else:
        assert tokens == whole
