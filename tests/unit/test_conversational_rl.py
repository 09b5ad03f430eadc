"""Conversational data on the generation side: PPO/REINFORCE prompts, reward functions, SPIN
demonstrations and chat.py records, on SmolLM2's ChatML template, a Llama-3-style template with a
default system message, and no template (tests/chat_tokenizers.py).

The reference layout is the SFT encoding of the same conversation (`ChatEncoder.conversation_tokens`)
cut at the end of the final assistant span: prompt tokens + the answer's tokens must equal it, and
the answer's tokens must be exactly its loss-mask region. Token in, token out: the ids the engine
generated reach the reward source, the critic and the training batch unchanged, also when their
text would re-encode to other ids.
"""
from __future__ import annotations

import io

import pytest
import torch

from aligner.data.conversation import ChatEncoder
from aligner.data.jsonl import DataError
from aligner.generation.engine import GenerationEngine, Rollout
from aligner.generation.rewards import RuleRewardSource
from aligner.generation.rollouts import PromptDataset

from ..chat_tokenizers import build_chat_tokenizer
from ..conftest import write_jsonl
from ..null_critic import NullCritic

KINDS = ("smollm2", "llama3", "plain")
TEMPLATED = ("smollm2", "llama3")
ANSWER = "The capital of France is Paris."
PROMPTS = [
    "What is the capital of France?",
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."},
     {"role": "user", "content": "how are you"}],
    [{"from": "human", "value": "hello world"}, {"from": "gpt", "value": "fine thanks"},
     {"from": "human", "value": "Twelve plus seven?"}],  # NeMo-Aligner's from/value and human/gpt
]
CANONICAL = PROMPTS[:3] + [[{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "fine thanks"},
                            {"role": "user", "content": "Twelve plus seven?"}]]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {kind: build_chat_tokenizer(root / kind, kind) for kind in KINDS}


def as_messages(prompt) -> list:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def sft_reference(tokenizer, prompt, answer: str, templated: bool = True) -> tuple[list[int], list[int]]:
    """(prompt tokens, answer tokens) cut out of the SFT encoding of prompt + the assistant's answer:
    the answer is the final assistant span of the loss mask, the prompt everything before it."""
    if isinstance(prompt, str) and not (templated and tokenizer.has_chat_template):
        # NeMo-Aligner's input/output layout: [bos] + input, output + [eos]
        return [tokenizer.bos_id] + tokenizer.encode(prompt), tokenizer.encode(answer) + [tokenizer.eos_id]
    tokens, loss_mask = ChatEncoder(tokenizer, templated).conversation_tokens(
        as_messages(prompt) + [{"role": "assistant", "content": answer}])
    end = max(i for i, masked in enumerate(loss_mask) if masked) + 1
    start = end
    while start > 0 and loss_mask[start - 1]:
        start -= 1
    return tokens[:start], tokens[start:end]


def spelled_out(tokenizer, word: str) -> list[int]:
    """`word` as one token per character: ids whose text re-encodes to different (merged) ids."""
    ids = [tokenizer.encode(character)[0] for character in word]
    assert tokenizer.decode(ids) == word and tokenizer.encode(word) != ids, "the BPE should merge the word"
    return ids


# ----------------------------------------------------------------------------- PPO / REINFORCE prompts
@pytest.mark.parametrize("kind", KINDS)
def test_rl_prompt_tokens_plus_answer_equal_the_sft_encoding_cut_at_the_reply(tmp_path, tokenizers, kind):
    tokenizer = tokenizers[kind]
    prompts = PromptDataset(write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS]),
                            tokenizer, max_prompt_length=256)
    assert prompts.prompts == CANONICAL  # what reward functions receive: the data's prompt, aliases resolved
    generated_answer = tokenizer.encode(ANSWER) + [tokenizer.eos_id]  # what the policy emits: reply + end of turn
    for prompt, prompt_tokens in zip(CANONICAL, prompts.tokens):
        reference_prompt, reference_answer = sft_reference(tokenizer, prompt, ANSWER)
        assert reference_answer == generated_answer  # the SFT loss region is exactly the generated answer
        assert prompt_tokens == reference_prompt
        assert prompt_tokens + generated_answer == reference_prompt + reference_answer


@pytest.mark.parametrize("kind", TEMPLATED)
def test_text_prompt_under_a_template_is_one_user_turn(tmp_path, tokenizers, kind):
    tokenizer = tokenizers[kind]
    prompts = PromptDataset(write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[0]}]), tokenizer, 256)
    # transformers' own rendering of a one-user-turn chat, with the template's default system message
    rendered = tokenizer.hf.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                                add_generation_prompt=True)
    assert prompts.tokens == [tokenizer.encode(rendered)]
    assert "system" in rendered and rendered.count(PROMPTS[0]) == 1


@pytest.mark.parametrize("kind", TEMPLATED)
def test_chat_template_false_gives_bos_plus_text_and_the_plain_layout(tmp_path, tokenizers, kind):
    tokenizer = tokenizers[kind]
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[0]}, {"prompt": PROMPTS[1]}])
    prompts = PromptDataset(path, tokenizer, 256, use_template=False)
    assert prompts.tokens[0] == [tokenizer.bos_id] + tokenizer.encode(PROMPTS[0])
    assert prompts.tokens[1] == ([tokenizer.bos_id] + tokenizer.encode("System: Answer briefly.\n")
                                 + tokenizer.encode("User: List three prime numbers.\n")
                                 + tokenizer.encode("Assistant: "))


ALTERNATING_TEMPLATE = (  # a template that complains, as many real ones do
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BAD_PROMPTS = [
    ({}, None),  # each reader names the keys it reads
    ({"prompt": "  "}, r"'prompt' is empty"),
    ({"prompt": 7}, r"'prompt' is a int"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, r"ends with an assistant"),
    ({"prompt": [{"role": "robot", "content": "a"}]}, r"unknown role 'robot'"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, r"roles must alternate"),
]


def _bad_record_readers(tmp_path, tokenizer):
    """(name, read(record at line 2)) of each reader here."""
    from aligner.algorithms.spin import load_demonstrations
    from aligner.generation.chat import ChatModel, encode_record

    good = {"prompt": "hello world"}

    def ppo(record):
        PromptDataset(write_jsonl(tmp_path / "prompts.jsonl", [good, record]), tokenizer, 256)

    def spin(record):
        with_answer = dict(record, response="fine thanks") if record else record
        load_demonstrations(write_jsonl(tmp_path / "prompts.jsonl", [dict(good, response="ok"), with_answer]),
                            tokenizer, 256)

    def chat(record):
        model = ChatModel(engine=None, tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_id], max_sequence_length=256,
                          vocab_size=tokenizer.vocab_size)
        encode_record(model, ChatEncoder(tokenizer), record, str(tmp_path / "prompts.jsonl"), 2)

    return {"ppo": ppo, "spin": spin, "chat": chat}


@pytest.mark.parametrize("reader", ("ppo", "spin", "chat"))
@pytest.mark.parametrize("record,message", BAD_PROMPTS)
def test_a_malformed_prompt_record_is_one_error_naming_file_and_line(tmp_path, reader, record, message):
    tokenizer = build_chat_tokenizer(tmp_path / "tokenizer", "smollm2", template=ALTERNATING_TEMPLATE)
    read = _bad_record_readers(tmp_path, tokenizer)[reader]
    if not record:
        message = {"ppo": r"missing key 'prompt'", "chat": r"record has neither 'prompt' nor 'messages'",
                   "spin": r"record has none of 'input'/'output', 'prompt'/'response'"}[reader]
    with pytest.raises(DataError, match=rf"prompts.jsonl:2: .*{message}") as error:
        read(record)
    assert "\n" not in str(error.value)


# ----------------------------------------------------------------------------- reward functions, token in / out
REWARD_CALLS: list = []


def recording_reward(prompt, response_text: str) -> float:
    """A reward function as users write them, loaded by name through RuleRewardSource."""
    REWARD_CALLS.append((prompt, response_text))
    return float(len(response_text))


class RecordingRewardSource(RuleRewardSource):
    def __init__(self):
        super().__init__(f"{__name__}:recording_reward")
        self.sequences: list = []  # per call: the token ids the source was given

    def score_async(self, sequences, prompts, response_texts, records, columns=None):
        self.sequences.append([list(sequence) for sequence in sequences])
        return super().score_async(sequences, prompts, response_texts, records, columns)


class RecordingCritic(NullCritic):
    def __init__(self):
        self.inferred: list = []
        self.trained: list = []

    def infer_async(self, sequences):
        self.inferred.append([list(sequence) for sequence in sequences])
        return super().infer_async(sequences)

    def train_async(self, sequences, prompt_lengths, returns, old_values, loss_mask=None):
        self.trained.append(([list(s) for s in sequences], list(prompt_lengths)))
        return super().train_async(sequences, prompt_lengths, returns, old_values, loss_mask)


class SpellingEngine(GenerationEngine):
    """The actor's real engine, except that the first row of each call answers `spelled` + eos: ids
    that decode to a word the tokenizer would encode as other (merged) ids. Streams by the protocol's
    default (one generate call per request), so every call goes through `generate` here."""

    def __init__(self, engine, spelled: list[int], pad_id: int):
        self.engine, self.spelled, self.pad_id = engine, spelled, pad_id
        self.calls: list = []  # per call: [(prompt ids, response ids)]

    def refit(self, chunks) -> None:
        self.engine.refit(chunks)

    def release_for_update(self) -> None:
        self.engine.release_for_update()

    def free(self) -> None:
        self.engine.free()

    def generate(self, prompts, sampling):
        rollout = self.engine.generate(prompts, sampling)
        width = max(rollout.response_tokens.shape[1], len(self.spelled))
        responses = torch.nn.functional.pad(rollout.response_tokens, (0, width - rollout.response_tokens.shape[1]),
                                            value=self.pad_id)
        logprobs = torch.nn.functional.pad(rollout.logprobs, (0, width - rollout.logprobs.shape[1]))
        responses[0] = self.pad_id
        responses[0, :len(self.spelled)] = torch.tensor(self.spelled)
        lengths, ended = rollout.response_lengths.clone(), rollout.ended_with_stop.clone()
        lengths[0], ended[0] = len(self.spelled), True
        rollout.response_tokens, rollout.logprobs = responses, logprobs
        rollout.response_lengths, rollout.ended_with_stop = lengths, ended
        self.calls.append([(list(prompt), responses[row, :int(rollout.response_lengths[row])].tolist())
                           for row, prompt in enumerate(prompts)])
        return rollout


def _tiny_policy(root, tokenizer_dir, tokenizer):
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import seeds

    seeds.set_seed(11)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, max_position_embeddings=128)
    return checkpointing.save(root / "policy", [build_gpt_model(cfg, transformer_config(cfg))],
                              model_config=cfg.to_dict(), tokenizer_dir=tokenizer_dir)


@pytest.mark.usefixtures("single_process")
@pytest.mark.parametrize("actor,chat_template", [("ppo", True), ("reinforce", True), ("ppo", False)])
def test_token_in_token_out_from_engine_to_reward_critic_and_training_batch(tmp_path, actor, chat_template):
    """A step on multi-turn ChatML prompts: the reward source and critic get prompt_tokens + the engine's
    ids, the training micro batches hold the same rows, and the reward function gets the messages."""
    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.algorithms.rl_config import RLActorConfig
    from aligner.config import CONF_DIR, load_config

    tokenizer = build_chat_tokenizer(tmp_path / "tokenizer", "smollm2")
    policy = _tiny_policy(tmp_path, tmp_path / "tokenizer", tokenizer)
    spelled = spelled_out(tokenizer, "Paris") + [tokenizer.eos_id]
    prompts_file = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    common = [f"model.init_from={policy}", f"data.prompts={prompts_file}", "data.max_prompt_length=96",
              f"data.chat_template={str(chat_template).lower()}", "generation.max_new_tokens=8",
              "generation.micro_batch_size=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
              "logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
              "logging.samples_interval=1", f"checkpoint.save_dir={tmp_path / 'ckpt'}",
              f"logging.log_dir={tmp_path / 'logs'}", "checkpoint.resume=false"]
    reward, critic = RecordingRewardSource(), RecordingCritic()
    if actor == "ppo":
        cfg = load_config(RLActorConfig, CONF_DIR / "gpt_ppo_actor.yaml", common + ["rollout.prompts_per_step=4"])
        trainer = build_rl_actor(cfg, critic=critic, reward_source=reward)
    else:
        cfg = load_config(RLActorConfig, CONF_DIR / "gpt_reinforce_actor.yaml",
                          common + ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2"])
        trainer = build_rl_actor(cfg, reward_source=reward)
    trainer.rollouts.engine = engine = SpellingEngine(trainer.rollouts.engine, spelled, tokenizer.pad_id)
    trained_rows = []
    train_step = trainer.policy.train_step

    def recording_train_step(microbatches):
        for mb in microbatches:
            for row in range(len(mb.prompt_lengths)):  # each sequence, from padded or packed rows
                p, n = int(mb.prompt_lengths[row]), int(mb.response_lengths[row])
                tokens = mb.tokens[row] if mb.packed is None else mb.packed.sequence(row)
                trained_rows.append((tokens[:p].tolist(), tokens[p:p + n].tolist()))
        return train_step(microbatches)

    trainer.policy.train_step = recording_train_step
    REWARD_CALLS.clear()
    try:
        trainer.train_step()
    finally:
        trainer.rollouts.router.close()
        trainer.metrics.close()

    encoder = ChatEncoder(tokenizer, chat_template)
    generated = [row for call in engine.calls for row in call]  # (prompt ids, response ids) as generated
    assert (generated[0][1] == spelled and tokenizer.encode(tokenizer.decode(spelled[:-1])) + [tokenizer.eos_id]
            != spelled)  # decode -> encode would have changed this response
    assert all(prompt in [encoder.prompt_tokens(p) for p in CANONICAL] for prompt, _ in generated)
    sequences = [[prompt + response for prompt, response in call] for call in engine.calls]
    assert reward.sequences == sequences
    assert sorted(trained_rows) == sorted(generated)
    if actor == "ppo":
        assert critic.inferred == sequences
        [(trained_sequences, prompt_lengths)] = critic.trained
        assert sorted(zip(trained_sequences, prompt_lengths)) == sorted((p + r, len(p)) for p, r in generated)
    # The reward function got each row's prompt as the file gave it (messages for conversations) and its text.
    assert len(REWARD_CALLS) == len(generated)
    for (given, text), (prompt_ids, response) in zip(REWARD_CALLS, generated):
        assert given in CANONICAL and encoder.prompt_tokens(given) == prompt_ids
        assert text == tokenizer.decode([t for t in response if t != tokenizer.eos_id])
    assert any(isinstance(given, list) and len(given) == 3 for given, _ in REWARD_CALLS)


def test_the_demo_reward_reads_a_conversation_as_its_last_user_turn():
    from aligner.demo.arithmetic import score_response

    assert score_response("12+7=", "19") == 1.0 and score_response("12+7=", "18") == 0.0
    conversation = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="},
                    {"role": "assistant", "content": "2"}, {"role": "user", "content": "12+7="}]
    assert score_response(conversation, "19") == 1.0 and score_response(conversation, "2") == 0.0


# ----------------------------------------------------------------------------- SPIN
SPIN_RECORDS = [  # (record, its prompt, its demonstration)
    ({"input": "What is the capital of France?", "output": ANSWER}, "What is the capital of France?", ANSWER),
    ({"prompt": "hello world", "response": "fine thanks"}, "hello world", "fine thanks"),
    ({"prompt": PROMPTS[2], "response": {"role": "assistant", "content": ANSWER}}, PROMPTS[2], ANSWER),
    ({"prompt": PROMPTS[1], "response": [{"role": "assistant", "content": "2, 3 and 5."}]}, PROMPTS[1], "2, 3 and 5."),
    ({"system": "Answer briefly.", "conversations": [
        {"from": "User", "value": "hello world"}, {"from": "Assistant", "value": "fine thanks"},
        {"from": "User", "value": "What is the capital of France?"}, {"from": "Assistant", "value": "Paris."}]},
     [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello world"},
      {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "What is the capital of France?"}],
     "Paris."),
    ({"messages": PROMPTS[2] + [{"role": "assistant", "content": ANSWER}]}, PROMPTS[2], ANSWER),
]


@pytest.mark.parametrize("chat_template", (True, False))
@pytest.mark.parametrize("kind", KINDS)
def test_spin_demonstrations_equal_the_sft_encoding(tmp_path, tokenizers, kind, chat_template):
    from aligner.algorithms.spin import load_demonstrations

    tokenizer = tokenizers[kind]
    path = write_jsonl(tmp_path / "sft.jsonl", [record for record, _, _ in SPIN_RECORDS])
    demonstrations = load_demonstrations(path, tokenizer, 512, use_template=chat_template)
    expected = [sft_reference(tokenizer, prompt, answer, chat_template) for _, prompt, answer in SPIN_RECORDS]
    assert demonstrations == expected
    assert all(answer[-1] == tokenizer.eos_id for _, answer in demonstrations)


def test_spin_refuses_a_conversation_that_does_not_end_with_the_reply(tmp_path, tokenizers):
    from aligner.algorithms.spin import load_demonstrations

    only_reply = {"conversations": [{"from": "gpt", "value": "hi"}]}
    for record, message in (({"messages": PROMPTS[2]}, "'messages' ends with a user turn"),
                            (only_reply, r"'conversations' opens with an assistant turn \(conversations\[0\]\)")):
        with pytest.raises(DataError, match=f"sft.jsonl:1: {message}"):
            load_demonstrations(write_jsonl(tmp_path / "sft.jsonl", [record]), tokenizers["smollm2"], 512)


@pytest.mark.usefixtures("single_process")
def test_spin_self_play_answer_is_the_engines_ids_token_in_token_out(tmp_path, tokenizers):
    """The rejected response of a multi-turn ChatML demonstration is the engine's ids, unchanged, in
    the pair and in the training batch."""
    from aligner.algorithms.spin import load_demonstrations, self_play_pairs
    from aligner.data.preference import PreferenceDataset, collate_preferences
    from aligner.generation.engine import SamplingParams
    from aligner.generation.native import NativeEngine
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    tokenizer = tokenizers["smollm2"]
    demonstrations = load_demonstrations(write_jsonl(tmp_path / "sft.jsonl", [SPIN_RECORDS[5][0], SPIN_RECORDS[4][0]]),
                                         tokenizer, 512)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, max_position_embeddings=128)
    model = build_gpt_model(cfg, transformer_config(cfg))
    native = NativeEngine([model], cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, max_batch_size=2,
                          max_sequence_length=128)
    spelled = spelled_out(tokenizer, "Paris") + [tokenizer.eos_id]
    engine = SpellingEngine(native, spelled, tokenizer.pad_id)
    pairs, _ = self_play_pairs(engine, demonstrations, SamplingParams(max_new_tokens=8, greedy=True), batch_size=2)
    generated = engine.calls[0]
    assert [(pair.prompt, pair.rejected) for pair in pairs] == generated and pairs[0].rejected == spelled
    assert [(pair.prompt, pair.chosen) for pair in pairs] == demonstrations
    batch = collate_preferences([PreferenceDataset(pairs)[i] for i in range(len(pairs))], tokenizer.pad_id)
    for index, (prompt, rejected) in enumerate(generated):  # rows: chosen, rejected interleaved
        assert batch["tokens"][2 * index + 1, :len(prompt) + len(rejected)].tolist() == prompt + rejected


# ----------------------------------------------------------------------------- chat.py
def _chat_model(tokenizer, engine=None):
    from aligner.generation.chat import ChatModel

    return ChatModel(engine=engine, tokenizer=tokenizer, stop_token_ids=[tokenizer.eos_id], max_sequence_length=1024,
                     vocab_size=tokenizer.vocab_size)


@pytest.mark.parametrize("kind", KINDS)
def test_chat_batch_records_of_each_layout_encode_as_the_conversation(tokenizers, kind):
    from aligner.generation.chat import encode_record

    tokenizer = tokenizers[kind]
    model, encoder = _chat_model(tokenizer), ChatEncoder(tokenizer)
    for prompt in PROMPTS:
        reference, _ = sft_reference(tokenizer, prompt if isinstance(prompt, str) else CANONICAL[PROMPTS.index(prompt)],
                                     ANSWER)
        layouts = [{"prompt": prompt}] + ([] if isinstance(prompt, str) else [{"messages": prompt}])
        for record in layouts:
            assert encode_record(model, encoder, record, "prompts.jsonl", 1) == reference, record
    # A text prompt and the one-user-turn conversation are the same request under a template.
    text_prompt = encode_record(model, encoder, {"prompt": PROMPTS[0]}, "prompts.jsonl", 1)
    one_turn = encode_record(model, encoder, {"messages": as_messages(PROMPTS[0])}, "prompts.jsonl", 1)
    assert (text_prompt == one_turn) == tokenizer.has_chat_template
    no_template = encode_record(model, ChatEncoder(tokenizer, use_template=False), {"prompt": PROMPTS[0]}, "p", 1)
    assert no_template == [tokenizer.bos_id] + tokenizer.encode(PROMPTS[0])


def test_chat_batch_steering_conditions_text_and_messages_as_training_does(tokenizers):
    from aligner.data.steerlm import SteerLMConfig, condition_messages, condition_prompt
    from aligner.generation.chat import encode_record

    tokenizer = tokenizers["smollm2"]
    model, encoder = _chat_model(tokenizer), ChatEncoder(tokenizer)
    model.steerlm = SteerLMConfig(attributes=["correctness", "helpfulness"])
    model.steer = {"correctness": 4, "helpfulness": 2}
    text = encode_record(model, encoder, {"prompt": "hello world"}, "p", 1)
    conditioned = condition_prompt("hello world", model.steer, model.steerlm)  # as SFT input records are
    assert text == tokenizer.encode(tokenizer.hf.apply_chat_template(
        [{"role": "user", "content": conditioned}], tokenize=False, add_generation_prompt=True))
    messages = encode_record(model, encoder, {"prompt": PROMPTS[1]}, "p", 1)
    assert messages == encoder.prompt_tokens(condition_messages(PROMPTS[1], model.steer, model.steerlm))
    assert text != encoder.prompt_tokens("hello world")


class _PromptRecordingEngine(GenerationEngine):
    """Answers every prompt with eos at once and keeps the prompts it was given."""

    def __init__(self, eos_id: int, pad_id: int):
        self.eos_id, self.pad_id, self.prompts = eos_id, pad_id, []

    def generate(self, prompts, sampling):
        self.prompts += [list(prompt) for prompt in prompts]
        rows = len(prompts)
        return Rollout([list(p) for p in prompts], torch.full((rows, 1), self.eos_id), torch.zeros(rows, 1),
                       torch.ones(rows, dtype=torch.long), torch.ones(rows, dtype=torch.bool))


@pytest.mark.parametrize("chat_template", (True, False))
def test_interactive_chat_honours_chat_template(tokenizers, chat_template):
    from aligner.generation.chat import ChatConfig, chat_interactive

    tokenizer = tokenizers["llama3"]
    engine = _PromptRecordingEngine(tokenizer.eos_id, tokenizer.pad_id)
    cfg = ChatConfig(init_from="x", system_prompt="Answer briefly.", chat_template=chat_template)
    assert chat_interactive(_chat_model(tokenizer, engine), cfg, io.StringIO("hello world\n"), io.StringIO()) == 1
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello world"}]
    if chat_template:
        rendered = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert engine.prompts == [tokenizer.encode(rendered)]
    else:
        assert engine.prompts == [[tokenizer.bos_id] + tokenizer.encode("System: Answer briefly.\n")
                                  + tokenizer.encode("User: hello world\n") + tokenizer.encode("Assistant: ")]



def test_prompts_longer_than_max_prompt_length_are_counted_and_all_skipped_is_one_line(tmp_path, tokenizers):
    """A chat template's own tokens count (SmolLM2's default system prompt): the warning counts the skipped
    prompts, and a file none of whose prompts fit says by how much, naming the key."""
    tokenizer = tokenizers["smollm2"]
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": prompt} for prompt in PROMPTS])
    lengths = sorted(len(ChatEncoder(tokenizer).prompt_tokens(prompt)) for prompt in CANONICAL)
    prompts = PromptDataset(path, tokenizer, lengths[1])
    assert (len(prompts), prompts.too_long) == (2, 2)
    assert prompts.skipped_note == (f"{path}: 2 of 4 prompts are longer than data.max_prompt_length={lengths[1]} "
                                    f"tokens as rendered (chat template included; the shortest of them has "
                                    f"{lengths[2]}) and are skipped")
    assert PromptDataset(path, tokenizer, lengths[-1]).skipped_note == ""
    with pytest.raises(DataError, match=rf"^{path}: all 4 prompts are longer than data.max_prompt_length="
                                        rf"{lengths[0] - 1} tokens as rendered \(chat template included; the shortest "
                                        rf"has {lengths[0]}\): raise data.max_prompt_length to at least {lengths[0]}$"):
        PromptDataset(path, tokenizer, lengths[0] - 1)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'empty.jsonl'}: the file holds no prompts"):
        PromptDataset(write_jsonl(tmp_path / "empty.jsonl", []), tokenizer, 64)
