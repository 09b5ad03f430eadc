"""examples/demo/demo_seeds.py: the margins it asserts over the seeds' tables (the demos themselves are
replaced by writers of their evaluation files; the demos' own runs are tested in test_demo_real.py and by
`make demo`)."""
from __future__ import annotations

import json
import sys

import pytest

from ..conftest import REPO_ROOT


@pytest.fixture
def seeds_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "demo"))
    sys.modules.pop("demo_seeds", None)
    import demo_seeds

    return demo_seeds


def _arithmetic(accuracy: float) -> dict:
    return {"all": accuracy, "carry": accuracy, "no_carry": accuracy, "num_carry": 200, "num_no_carry": 300}


def _instructions(satisfied: float, kl: float, france: str = "The capital of France is Paris.",
                  sky: str = "Sunlight scatters off the air.", faulty: tuple = (42, 0)) -> dict:
    """An evaluation file: greedy general answers, and `faulty` of 64 sampled answers per general prompt."""
    prompts = ["What is the capital of France?", "Why is the sky blue?"]
    general = [{"prompt": [{"role": "user", "content": prompt}], "response": answer}
               for prompt, answer in zip(prompts, (france, sky))]
    counts = [{"prompt": prompt, "faulty": count, "samples": 64} for prompt, count in zip(prompts, faulty)]
    return {"prompt_level": satisfied, "prompts": 200, "kl_to_base": kl, "mean_words": 12.0, "general": general,
            "general_fault_counts": counts}


def _fake_demo(monkeypatch, module, evaluations):
    """Each demo command writes `evaluations(seed)` as its eval_*.json files and records the command."""
    commands = []

    def run(command):
        commands.append([str(part) for part in command])
        work = command[command.index("--workdir") + 1]
        seed = int(command[command.index("--seed") + 1]) if "--seed" in command else None
        work.mkdir(parents=True, exist_ok=True)
        for stage in ("base", "data"):
            (work / stage).mkdir(exist_ok=True)
        for name, result in evaluations(seed).items():
            (work / f"eval_{name}.json").write_text(json.dumps(result))

    monkeypatch.setattr(module, "_run", run)
    return commands


def test_toy_rows_under_the_margin_over_their_seeds_sft_fail_by_name(tmp_path, monkeypatch, seeds_module, capsys):
    labels = [name for name, _, _ in seeds_module.GROUP_RL_RUNS]

    def evaluations(seed):
        rows = {"sft": _arithmetic(0.60 if seed == 1 else 0.64)}
        rows.update({name: _arithmetic(0.80) for name in labels})
        return rows

    commands = _fake_demo(monkeypatch, seeds_module, evaluations)
    failures = seeds_module.toy(tmp_path, [1, 2], "sft,group_rl")
    # seed 1: 80 - 60 = 20 points, kept; seed 2: 80 - 64 = 16, kept: nothing fails
    assert failures == [] and [command[command.index("--seed") + 1] for command in commands] == ["1", "2"]

    def evaluations_short(seed):
        rows = evaluations(seed)
        rows["grpo"] = _arithmetic(0.78 if seed == 2 else 0.80)  # 14 points over seed 2's SFT
        return rows

    _fake_demo(monkeypatch, seeds_module, evaluations_short)
    failures = seeds_module.toy(tmp_path, [1, 2], "group_rl")
    assert failures == ["seed 2: GRPO 78.0 % is +14.0 points over SFT (64.0 %), under the 15 required"]
    out = capsys.readouterr().out
    assert "80.0 % [76.3, 83.3]" in out  # each row with its 95 % interval over the 500 problems
    spread = out[out.index("over seeds 1, 2: min / mean / max"):]
    assert ["GRPO", "78.0", "79.0", "80.0"] in [line.split() for line in spread.splitlines()]


def test_real_methods_need_the_margin_and_the_general_answers(tmp_path, monkeypatch, seeds_module, capsys):
    def evaluations(seed):
        return {"base": _instructions(0.13, 0.0),
                "rloo": _instructions(0.36 if seed == 1 else 0.30, 4.2,
                                      sky="The sky blue." if seed == 1 else "Sunlight scatters.",
                                      faulty=(40, 7 if seed == 1 else 1)),
                "dpo": _instructions(0.40, 8.5 if seed == 2 else 6.5,
                                     "Paris" if seed == 1 else "L'Étoile, la Marseillaise",
                                     faulty=(48 if seed == 2 else 30, 0))}

    commands = _fake_demo(monkeypatch, seeds_module, evaluations)
    failures = seeds_module.real(tmp_path, [1, 2], "model,data,base,rloo,dpo,report")
    # a fault rate risen over the base's fails the row (seed 1's sky answers: 7/64 against 0/64); a greedy answer
    # that flipped on a prompt whose sampled answers fail as often as the base's does not (seed 2's French France
    # answer: 48/64 against 42/64), nor does a KL of 6.5 with every rate kept
    assert failures == [
        "seed 1: rloo's sampled answers to 'Why is the sky blue?' have a fault 7/64 times, the base's 0/64",
        "seed 2: rloo 30.0 % is +17.0 points over the base (13.0 %), under the 20 required",
        "seed 2: dpo's KL to the base on the general prompts, 8.50 nats, is over the 8 allowed",
    ]
    out = capsys.readouterr().out
    assert "greedy: answer to 'What is the capital of France?' French words (la, l'); does not name Paris" in out
    # the base is imported and evaluated once, in the first seed's directory; each seed trains with its seed
    assert [command[command.index("--stages") + 1] for command in commands] == [
        "model,data,base", "rloo,dpo,report", "rloo,dpo,report"]
    assert [command[command.index("--seed") + 1] for command in commands if "--seed" in command] == ["1", "2"]
    assert (tmp_path / "seed_2" / "eval_base.json").exists()


def test_real_rloo_settings_reach_every_seeds_rloo_run_and_not_the_shared_base(tmp_path, monkeypatch, seeds_module):
    def evaluations(seed):
        return {"base": _instructions(0.13, 0.0), "rloo": _instructions(0.40, 4.0), "dpo": _instructions(0.40, 4.0)}

    commands = _fake_demo(monkeypatch, seeds_module, evaluations)
    settings = ("trainer.global_batch_size=8", "kl.init_coef=0.1")
    assert seeds_module.real(tmp_path, [1, 2], "model,data,base,rloo,dpo,report", settings) == []
    base, *per_seed = commands
    assert "--rloo-set" not in base
    for command in per_seed:
        given = [command[index + 1] for index, part in enumerate(command) if part == "--rloo-set"]
        assert given == list(settings)


def test_real_evaluations_made_before_the_fault_rates_ask_to_be_rerun(tmp_path, monkeypatch, seeds_module):
    def evaluations(seed):
        old = _instructions(0.40, 4.0)
        del old["general_fault_counts"]
        return {"base": _instructions(0.13, 0.0), "rloo": old, "dpo": _instructions(0.40, 4.0)}

    _fake_demo(monkeypatch, seeds_module, evaluations)
    with pytest.raises(SystemExit, match="no general_fault_counts .* re-run its evaluation"):
        seeds_module.real(tmp_path, [1], "model,data,base,rloo,dpo,report")
