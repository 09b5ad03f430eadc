"""The real-model demo's instruction-following task: every checker on hand-written answers, prompts parse
back to what was drawn, the held-out split shares no topic or parameter with training."""
from __future__ import annotations

import pytest

from aligner.demo import instructions as ifc

REQUEST = "Give some advice about flying a kite."

# (constraint, params, an answer that satisfies it, one that does not)
CASES = [
    ("lowercase", (), "hold the string and run into the wind.", "Hold the string and run."),
    ("uppercase", (), "HOLD THE STRING, RUN!", "HOLD the string."),
    ("max_words", ("5",), "Run into the wind.", "Run into the wind with your kite."),
    ("bullets", ("2",), "- Pick a windy day.\n- Run against the wind.", "- Pick a windy day.\n- Run.\n- Smile."),
    ("include_word", ("patience",), "It takes Patience, really.", "It takes patient hands."),
    ("exclude_word", ("make",), "Build a frame first.", "Make a frame first."),
    ("end_phrase", ("Good luck!",), "Run into the wind. Good luck!", "Good luck! Run into the wind."),
    ("no_commas", (), "Run fast and hold on.", "Run fast, hold on."),
    ("start_word", ("Okay",), "Okay, first find a field.", "First, okay, find a field."),
    ("json_keys", ("advice", "why"), '```json\n{"advice": "run", "why": "lift"}\n```', '{"advice": "run"}'),
    ("repeat_request", (), f"{REQUEST} Run into the wind.", "Run into the wind."),
    ("quoted", (), '"Run into the wind."', 'Run "into" the wind.'),
]


def test_there_are_at_least_ten_constraint_types_and_every_one_is_tested_here():
    assert len(ifc.CONSTRAINT_TYPES) >= 10
    assert {case[0] for case in CASES} == set(ifc.CONSTRAINT_TYPES)


@pytest.mark.parametrize("name, params, good, bad", CASES)
def test_each_checker_accepts_a_satisfying_answer_and_rejects_a_violating_one(name, params, good, bad):
    prompt = ifc.Instruction(REQUEST, ((name, params),)).prompt
    assert ifc.check(prompt, good) == {name: True}
    assert ifc.check(prompt, bad) == {name: False}
    assert ifc.check(prompt, "") == {name: False}  # an empty answer satisfies nothing
    # The reward's partial credit: 1 exactly when satisfied, below 1 otherwise.
    assert ifc.credit(prompt, good) == {name: 1.0}
    assert 0.0 <= ifc.credit(prompt, bad)[name] < 1.0 and ifc.credit(prompt, "")[name] < 1.0


def test_two_constraints_score_half_when_one_is_met_and_prompts_may_be_messages():
    item = ifc.Instruction(REQUEST, (("lowercase", ()), ("max_words", ("4",))))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": item.prompt}]
    assert ifc.satisfied_fraction(messages, "run with it now.") == 1.0
    assert ifc.satisfied_fraction(messages, "run into the strong wind.") == 0.5
    assert ifc.satisfied_fraction(item.prompt, "Run into the strong wind.") == 0.0
    # The reward adds partial credit: 5 words against a limit of 4 earns 0.9 x 4 / 5 of that constraint.
    assert ifc.score_response(messages, "run with it now.") == 1.0
    assert ifc.score_response(messages, "run into the strong wind.") == pytest.approx((1 + 0.72) / 2)
    with pytest.raises(ValueError, match="no constraint found"):
        ifc.score_response("Tell me a joke.", "no")


@pytest.mark.parametrize("split", ifc.SPLITS)
def test_prompts_parse_back_to_what_was_drawn_and_never_combine_conflicting_constraints(split):
    drawn = ifc.instructions(split, 500, seed=3)
    assert drawn == ifc.instructions(split, 500, seed=3)  # a pure function of its arguments
    for item in drawn:
        parsed = ifc.parse_instruction(item.prompt)
        assert parsed.request == item.request
        assert sorted(parsed.constraints) == sorted(item.constraints), item.prompt
        names = [name for name, _ in item.constraints]
        assert 1 <= len(names) <= 2 and len(set(names)) == len(names)
        for name in names:
            assert not set(names) & set(ifc.CONSTRAINT_TYPES[name].conflicts), item.prompt
    assert {name for item in drawn for name, _ in item.constraints} == set(ifc.CONSTRAINT_TYPES)


def test_the_heldout_split_shares_no_topic_and_no_parameter_with_training():
    assert not set(ifc.TOPICS["train"]) & set(ifc.TOPICS["heldout"])
    for kind in ifc.CONSTRAINT_TYPES.values():
        if kind.pools is not None:
            assert not set(kind.pools["train"]) & set(kind.pools["heldout"]), kind.name
    train_params = {(name, params) for item in ifc.instructions("train", 2000, seed=1)
                    for name, params in item.constraints if params}
    for item in ifc.instructions("heldout", 300, seed=1):
        assert not any(topic in item.request for topic in ifc.TOPICS["train"]), item.request
        assert not {(name, params) for name, params in item.constraints if params} & train_params


def test_satisfaction_counts_prompts_and_constraints_per_type():
    prompts = [ifc.Instruction(REQUEST, (("lowercase", ()), ("no_commas", ()))).prompt,
               ifc.Instruction(REQUEST, (("no_commas", ()),)).prompt]
    rates = ifc.satisfaction(prompts, ["all fine here.", "One, two."])
    assert rates["prompt_level"] == 0.5
    assert rates["constraint_level"] == pytest.approx(2 / 3)
    assert rates["per_type"] == {"lowercase": (1.0, 1), "no_commas": (0.5, 2)}


def test_the_kl_to_the_base_is_the_mean_float64_log_ratio_of_the_sampled_answers(single_process):
    """instruction_eval's KL estimate on a tiny adapted model against its base: the engine's samples scored by
    an independent float64 forward of the same adapted model built again and of the base."""
    from types import SimpleNamespace

    import torch

    from aligner.demo.instruction_eval import _kl_to_base
    from aligner.models import lora

    from .test_lora import _adapted, _randomise_b
    from .test_native_engine import EOS, VOCAB, make_engine, make_model, make_prompts

    cfg, model, peft = _adapted("llama")
    lora.apply_lora([model], peft, seed=1)
    _randomise_b(model)
    engine, prompts = make_engine(cfg, model), make_prompts(4)
    chat_model = SimpleNamespace(engine=engine, chunks=[model], stop_token_ids=[EOS], vocab_size=VOCAB)
    estimate = _kl_to_base(chat_model, [make_model("llama")[1]], prompts, samples=3, max_new_tokens=8, seed=5)

    from aligner.generation.engine import SamplingParams

    repeated = [prompt for prompt in prompts for _ in range(3)]
    rollout = engine.generate(repeated, SamplingParams(max_new_tokens=8, temperature=1.0, seed=5,
                                                       stop_token_ids=[EOS]))
    _, adapted = make_model("llama")
    lora.apply_lora([adapted], peft, seed=1)
    _randomise_b(adapted)
    adapted, base = adapted.double(), make_model("llama")[1].double()

    def logprob(net, tokens, start):
        positions = torch.arange(tokens.shape[1])[None]
        logits = net(tokens[:, :-1], positions[:, :-1], None)[0, start - 1:, :VOCAB]
        return torch.log_softmax(logits, -1).gather(-1, tokens[0, start:, None]).sum()

    ratios = []
    with torch.no_grad():
        for row, prompt in enumerate(repeated):
            length = int(rollout.response_lengths[row])
            tokens = torch.tensor([prompt + rollout.response_tokens[row, :length].tolist()])
            ratios.append(float(logprob(adapted, tokens, len(prompt)) - logprob(base, tokens, len(prompt))))
    expected = sum(ratios) / len(ratios)
    assert abs(expected) > 0.05  # the adapters moved the model: the check is not of zeros
    assert estimate == pytest.approx(expected, abs=1e-4)


def test_partial_credit_grows_as_an_answer_comes_closer():
    def reward(constraint, params, answer):
        return ifc.score_response(ifc.Instruction(REQUEST, ((constraint, params),)).prompt, answer)

    assert reward("lowercase", (), "ALL CAPS HERE") < reward("lowercase", (), "Mostly lower case") < 1.0
    assert reward("max_words", ("4",), "one two three four five six seven eight") < reward(
        "max_words", ("4",), "one two three four five") < reward("max_words", ("4",), "one two three four")
    keys = ("advice", "why")
    json_rewards = [reward("json_keys", keys, answer) for answer in
                    ("Sure!", '{"x": 1}', '{"advice": 1}', '{"advice": 1, "why": 2}')]
    assert json_rewards == sorted(set(json_rewards)) and json_rewards[-1] == 1.0
    assert reward("repeat_request", (), "Fly it.") < reward("repeat_request", (), "Give some advice. Fly.") < 1.0


def test_dpo_pairs_take_each_prompts_best_and_worst_answer_and_skip_ties():
    first = ifc.Instruction(REQUEST, (("lowercase", ()),)).prompt
    second = ifc.Instruction(REQUEST, (("no_commas", ()),)).prompt
    samples = [{"prompt": first, "response": "HALF lower"}, {"prompt": first, "response": "all lower"},
               {"prompt": first, "response": "ALL UPPER"}, {"prompt": first, "response": None},
               {"prompt": second, "response": "a, b"}, {"prompt": second, "response": "c, d"},
               {"prompt": second, "response": "e, f"}, {"prompt": second, "response": "g, h"}]
    assert ifc.best_worst_pairs(samples, 4) == [{"prompt": first, "chosen": "all lower", "rejected": "ALL UPPER"}]


@pytest.mark.parametrize("prompt, answer, faults", [
    # the answers the recorded demo runs gave (docs/results/demo_real.md), and their faults
    ("What is the capital of France?", "The capital of France is Paris.", []),
    ("What is the capital of France?", "La femme de France est le français.",
     ["French words (est, français, la, le)", "does not name Paris"]),
    ("What is the capital of France?", "L'Étoile (The City of Lights) is the capital of France.",
     ["French words (l')", "does not name Paris"]),
    ("What is the capital of France?", "L'Étoile (The City) est le monde des Français. Paris est le cité de la France.",
     ["French words (des, est, français, la, le, l')"]),
    ("Why is the sky blue?", "The sky blue.", ["echoes the question"]),
    ("Why is the sky blue?", "", ["empty"]),
    ("Why is the sky blue?", None, ["empty"]),
    ("Give me two tips for a good night's sleep.", "1. Stay hydrated. 2. Avoid alcohol.", []),
    ("How do I boil an egg?", "Boil an egg:\n\nBoil an egg:\n\nBoil an egg:", ["echoes the question"]),
    # English words that hold a French word's letters are not French
    ("What is a healthy breakfast?", "Oatmeal, eggs and fruit; less sugar, more leaves.", []),
])
def test_a_general_answer_s_faults_are_named(prompt, answer, faults):
    assert ifc.general_answer_faults(prompt, answer) == faults


def test_training_is_judged_on_the_faults_the_base_answer_does_not_have():
    egg = "How do I boil an egg?"
    base = "Boil an egg:\n\nBoil an egg:"  # the demo's base model already echoes this one
    assert ifc.new_general_faults(egg, base, "Boil an egg.") == []
    assert ifc.new_general_faults(egg, "Put it in boiling water.", "Boil an egg.") == ["echoes the question"]
    assert ifc.new_general_faults("What is the capital of France?", "The capital of France is Paris.",
                                  "Paris est la capitale.") == ["French words (est, la)"]
