"""`make demo-real`'s pipeline (examples/demo/run_demo_real.py) end to end on a tiny random chat model: every
stage runs the commands a user would, in order, and writes what the next one reads."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from aligner.demo.intervals import format_interval

from ..chat_tokenizers import build_chat_tokenizer
from ..conftest import REPO_ROOT


def _replaced(overrides: list[str], **values) -> list[str]:
    """`overrides` with each dotted key in `values` (written with __ for dots) set to its new value."""
    changes = {key.replace("__", "."): value for key, value in values.items()}
    kept = [item for item in overrides if item.split("=", 1)[0] not in changes]
    return kept + [f"{key}={value}" for key, value in changes.items()]


@pytest.fixture
def demo_module(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "examples" / "demo"))
    sys.modules.pop("run_demo_real", None)
    import run_demo_real

    return run_demo_real


@pytest.mark.slow
@pytest.mark.usefixtures("single_process")
def test_every_stage_runs_on_a_tiny_chat_model_and_the_report_reads_what_they_wrote(tmp_path, monkeypatch,
                                                                                     demo_module, capfd):
    from aligner import checkpointing
    from aligner.demo.instructions import best_worst_pairs, general_answer_faults, satisfaction
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import seeds

    # The tiny byte-level tokenizer spends a token per 2-3 characters: prompts are ~3x longer than SmolLM2's.
    tokenizer = build_chat_tokenizer(tmp_path / "tokenizer", "smollm2")
    seeds.set_seed(3)
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                    vocab_size=tokenizer.vocab_size, max_position_embeddings=1024)
    work = tmp_path / "work"
    checkpointing.save(work / "base", [build_gpt_model(cfg, transformer_config(cfg))], model_config=cfg.to_dict(),
                       tokenizer_dir=tmp_path / "tokenizer")

    demo = demo_module
    monkeypatch.setattr(demo, "HELDOUT_PROMPTS", 12)
    monkeypatch.setattr(demo, "TRAIN_PROMPTS", 32)
    monkeypatch.setattr(demo, "MAX_NEW_TOKENS", 12)
    monkeypatch.setattr(demo, "RL_OVERRIDES", _replaced(
        demo.RL_OVERRIDES, data__max_prompt_length=400, rollout__prompts_per_step=2, trainer__global_batch_size=8,
        trainer__micro_batch_size=4, trainer__max_steps=2, generation__micro_batch_size=8,
        generation__max_new_tokens=6))
    monkeypatch.setattr(demo, "DPO_OVERRIDES", _replaced(
        demo.DPO_OVERRIDES, data__max_seq_length=512, trainer__max_epochs=1, trainer__global_batch_size=1,
        trainer__micro_batch_size=1))
    monkeypatch.setattr(demo, "DPO_ROUNDS", 2)
    monkeypatch.setattr(demo, "DPO_SAMPLE_PROMPTS", 8)
    monkeypatch.setattr(sys, "argv", ["run_demo_real.py", "--workdir", str(work), "--stages",
                                      "data,base,rloo,dpo,report"])
    demo.main()
    out = capfd.readouterr().out

    heldout = [json.loads(line) for line in (work / "data" / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 12 and len((work / "data" / "train.jsonl").read_text().splitlines()) == 32
    results = {name: json.loads((work / f"eval_{name}.json").read_text()) for name in ("base", "rloo", "dpo")}
    for name, result in results.items():
        assert result["prompts"] == 12, name
        assert result["kl_to_base"] is not None and len(result["general"]) == 5
    assert results["base"]["kl_to_base"] == pytest.approx(0.0, abs=1e-6)  # the base against itself
    for name, result in results.items():  # each general prompt's sampled answers, counted by the fault checker
        samples = [json.loads(line) for line in (work / f"eval_{name}" / "general_samples.jsonl").read_text()
                   .splitlines()]
        assert len(samples) == 5 * 64
        for count in result["general_fault_counts"]:
            mine = [row for row in samples if row["prompt"] == count["prompt"]]
            assert count["samples"] == len(mine) == 64
            assert count["faulty"] == sum(bool(general_answer_faults(row["prompt"], row["response"])) for row in mine)
    assert results["rloo"]["kl_to_base"] != 0.0  # the adapters moved the policy
    # The base's table row is the checker's verdict on its held-out answers, as the report prints it.
    answers = [json.loads(line) for line in (work / "eval_base" / "heldout_answers.jsonl").read_text().splitlines()]
    expected = satisfaction([row["prompt"] for row in answers], [row["response"] for row in answers])
    assert results["base"]["prompt_level"] == expected["prompt_level"]
    table = next(line for line in out.splitlines() if line.startswith("prompts satisfied"))
    assert table.split()[2:] == " ".join(format_interval(results[name]["prompt_level"], 12)
                                         for name in ("base", "rloo", "dpo")).split()
    france = results["base"]["general_fault_counts"][0]["prompt"]
    counts = [results[name]["general_fault_counts"][0]["faulty"] for name in ("base", "rloo", "dpo")]
    after = out[out.index(f"- {france}"):]
    assert f"sampled answers with a fault: base {counts[0]}/64, rloo {counts[1]}/64, dpo {counts[2]}/64" in after

    # Iterative DPO: each round sampled from the previous round's policy, and its pairs are the checker's.
    metrics = [json.loads(line) for line in (work / "rloo" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in metrics if row.get("split") == "train"] == [1, 2]
    for round_index in (1, 2):
        round_dir = work / "dpo" / f"round_{round_index}"
        samples = [json.loads(line) for line in (round_dir / "samples.jsonl").read_text().splitlines()]
        pairs = [json.loads(line) for line in (round_dir / "pairs.jsonl").read_text().splitlines()]
        assert len(samples) == 8 * demo.DPO_SAMPLES and pairs == best_worst_pairs(samples, demo.DPO_SAMPLES)
        assert checkpointing.latest_checkpoint(round_dir / "checkpoints") is not None
    assert f"init_from={work / 'dpo' / 'round_1' / 'checkpoints'}" in out  # round 2 starts from round 1
    if importlib.util.find_spec("matplotlib") is not None:
        assert (work / "demo_real.png").stat().st_size > 0
    else:
        assert "no PNG: matplotlib is not installed" in out


@pytest.mark.parametrize("name,message", [("model.txt", "give a Hugging Face model directory or a .gguf file"),
                                          ("absent.gguf", "no such file or directory")])
def test_a_model_that_is_neither_an_hf_directory_nor_a_gguf_file_is_one_clear_error(tmp_path, demo_module, name,
                                                                                    message):
    from aligner.runtime.errors import ConfigError

    (tmp_path / "model.txt").write_text("not a model")
    with pytest.raises(ConfigError, match=f"--model {tmp_path / name}: {message}"):
        demo_module.RealDemo(tmp_path / "work", tmp_path / name).model()


def test_rloo_settings_from_the_command_line_come_after_the_demos_own(tmp_path, monkeypatch, demo_module):
    """--rloo-set KEY=VALUE reaches the RLOO run after the demo's settings (the later override wins)."""
    commands = []
    monkeypatch.setattr(demo_module, "run", lambda stage, command: commands.append([str(part) for part in command]))
    monkeypatch.setattr(demo_module, "latest_checkpoint", lambda path: path / "step_00000024")
    monkeypatch.setattr(demo_module.RealDemo, "evaluate", lambda self, name, checkpoint: {})
    monkeypatch.setattr(sys, "argv", ["run_demo_real.py", "--workdir", str(tmp_path / "work"), "--stages", "rloo",
                                      "--rloo-set", "trainer.global_batch_size=8", "--rloo-set", "kl.init_coef=0.1"])
    (tmp_path / "work" / "data").mkdir(parents=True)
    (tmp_path / "work" / "data" / "train.jsonl").write_text("")
    demo_module.main()
    (command,) = commands
    assert command[-4:-2] == ["trainer.global_batch_size=8", "kl.init_coef=0.1"]
    assert command.index("kl.init_coef=0.1") > max(index for index, part in enumerate(command)
                                                    if part.startswith("trainer.max_steps="))
