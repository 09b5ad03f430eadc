"""SteerLM end to end: annotation against a real reward server, resuming, conditioned SFT, steered evaluation.

The annotation script and the trainer run as the user runs them (subprocesses); the reward
server is the real entry point serving a random-weight two-attribute checkpoint.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aligner.data.jsonl import read_jsonl
from aligner.demo import arithmetic

from ..conftest import REPO_ROOT, metrics_rows, write_jsonl
from .test_reward_server import ENTRY_POINT, ServerProcess, free_port_block, make_reward_checkpoint

ANNOTATE = REPO_ROOT / "examples" / "nlp" / "data" / "steerlm" / "annotate.py"
SFT_SCRIPT = REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"
ATTRIBUTES = "helpfulness,correctness"  # make_reward_checkpoint's attributes, in its order
SCALES = ["--scale", "0:4", "--scale", "correctness=0:9"]
NUM_RECORDS = 40


def _run(command: list, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT),
           **{k: v for k, v in os.environ.items()
              if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH")}}
    return subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT, env=env)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint, port, in-process LoadedRewardModel) with the server running."""
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed

    root = tmp_path_factory.mktemp("steerlm_server")
    distributed.initialize(distributed.ParallelConfig())
    try:
        checkpoint = make_reward_checkpoint(root)
        loaded = load_reward_model(checkpoint, micro_batch_size=4)
        port = free_port_block()
        server = ServerProcess([sys.executable, str(ENTRY_POINT), f"init_from={checkpoint}", f"server.port={port}",
                                "inference.micro_batch_size=4", "server.max_batch_size=16"], root / "server.log")
        server.wait_ready()
        yield checkpoint, port, loaded
        server.stop()
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def sft_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("steerlm_data") / "sft.jsonl", arithmetic.sft_records(NUM_RECORDS, 5))


def _annotate(input_path: Path, output: Path, port: int, *extra: str) -> subprocess.CompletedProcess:
    return _run([ANNOTATE, "--input", input_path, "--output", output, "--attributes", ATTRIBUTES, *SCALES,
                 "--port", port, "--batch-size", "6", "--max-in-flight", "4", "--keep-scores", "--no-progress", *extra])


def _expected_scores(loaded, records: list[dict]) -> np.ndarray:
    """In-process rewards of each record laid out as reward training does (the demo template renders the
    plain layout): [bos] + input + output + [eos]."""
    import torch

    tokenizer = loaded.tokenizer
    sequences = [[tokenizer.bos_id] + tokenizer.encode(r["input"] + r["output"]) + [tokenizer.eos_id] for r in records]
    tokens = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.long)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return loaded.inference.infer(tokens, torch.tensor([len(ids) for ids in sequences])).numpy()


def test_annotation_equals_in_process_scores_rounded_onto_the_scales(served, sft_file, tmp_path):
    _, port, loaded = served
    output = tmp_path / "annotated.jsonl"
    result = _annotate(sft_file, output, port)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"annotated {NUM_RECORDS} records (0 already in" in result.stdout
    records = [record for _, record in read_jsonl(sft_file)]
    annotated = _read_jsonl(output)
    assert [{k: v for k, v in a.items() if k not in ("attributes", "attribute_scores")} for a in annotated] == records
    served_scores = np.array([[a["attribute_scores"][n] for n in ATTRIBUTES.split(",")] for a in annotated])
    expected = _expected_scores(loaded, records)
    assert np.abs(served_scores - expected).max() < 1e-5
    scales = {"helpfulness": (0, 4), "correctness": (0, 9)}
    for a in annotated:
        for name, (low, high) in scales.items():
            score = a["attribute_scores"][name]
            assert a["attributes"][name] == min(max(int(np.floor(score + 0.5)), low), high)
    print(f"\nscores {expected.min():.2f}..{expected.max():.2f}; "
          f"values {sorted({tuple(a['attributes'].values()) for a in annotated})}")


def test_annotating_conversations_scores_the_tokens_reward_training_uses(served, tmp_path):
    """A conversation is scored at its last assistant turn, as the same {"prompt", "response"} regression record."""
    import torch

    from aligner.data.reward import RegressionDataset

    _, port, loaded = served
    user, reply = {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}
    records = [{"messages": [{"role": "system", "content": "abc"}, user, reply]},
               {"system": "a", "conversations": [
                   {"from": "User", "value": "12+7="}, {"from": "Assistant", "value": "19"},
                   {"from": "User", "value": "9+9="}, {"from": "Assistant", "value": "18"}]}]
    training = [{"prompt": [{"role": "system", "content": "abc"}, user], "response": "2"},
                {"prompt": [{"role": "system", "content": "a"}, {"role": "user", "content": "12+7="},
                            {"role": "assistant", "content": "19"}, {"role": "user", "content": "9+9="}],
                 "response": "18"}]
    output = tmp_path / "annotated.jsonl"
    result = _annotate(write_jsonl(tmp_path / "chats.jsonl", records), output, port)
    assert result.returncode == 0, result.stderr[-4000:]
    served_scores = np.array([[a["attribute_scores"][n] for n in ATTRIBUTES.split(",")] for a in _read_jsonl(output)])
    labels = write_jsonl(tmp_path / "labels.jsonl", [{**record, "label": "helpfulness:1"} for record in training])
    sequences = [item["tokens"] for item in RegressionDataset(labels, loaded.tokenizer, 64, ATTRIBUTES.split(","))]
    tokens = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    expected = loaded.inference.infer(tokens, torch.tensor([len(ids) for ids in sequences])).numpy()
    assert np.abs(served_scores - expected).max() < 1e-5


def test_annotation_resumes_where_it_stopped(served, sft_file, tmp_path):
    _, port, _ = served
    complete = tmp_path / "complete.jsonl"
    assert _annotate(sft_file, complete, port).returncode == 0
    output = tmp_path / "resumed.jsonl"
    first = _annotate(sft_file, output, port, "--limit", "15")
    assert first.returncode == 0 and "annotated 15 records (0 already in" in first.stdout
    with open(output, "a") as handle:  # an interrupted write: half a line
        handle.write('{"input": "1+2=", "out')
    second = _annotate(sft_file, output, port)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"annotated {NUM_RECORDS - 15} records (15 already in" in second.stdout
    resumed, reference = _read_jsonl(output), _read_jsonl(complete)
    assert [r["attributes"] for r in resumed] == [r["attributes"] for r in reference]
    assert [r["input"] for r in resumed] == [r["input"] for r in reference]
    third = _annotate(sft_file, output, port)
    assert "annotated 0 records" in third.stdout and len(_read_jsonl(output)) == NUM_RECORDS
    # An output of another input is refused, not appended to.
    other = write_jsonl(tmp_path / "other.jsonl", arithmetic.sft_records(NUM_RECORDS, 99))
    refused = _annotate(other, output, port)
    assert refused.returncode == 2 and "is not the annotation of input line 1" in refused.stderr


def test_attribute_count_must_match_the_served_model(served, sft_file, tmp_path):
    _, port, _ = served
    result = _run([ANNOTATE, "--input", sft_file, "--output", tmp_path / "x.jsonl", "--attributes", "correctness",
                   "--port", port, "--no-progress"])
    assert result.returncode == 2
    assert "returns 2 attribute scores per text but --attributes names 1" in result.stderr


def test_no_server_is_a_clear_error_naming_it(sft_file, tmp_path):
    port = free_port_block(1)
    result = _run([ANNOTATE, "--input", sft_file, "--output", tmp_path / "x.jsonl", "--attributes", "correctness",
                   "--port", port, "--ready-timeout", "1"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "serve_reward_model.py init_from=" in result.stderr


# ----------------------------------------------------------------------------- conditioned SFT


@pytest.fixture(scope="module")
def steerlm_run(tmp_path_factory):
    """A tiny attribute-conditioned SFT run through the real entry point: (run dir, final checkpoint)."""
    from aligner import checkpointing
    from aligner.demo.tokenizer import train_char_tokenizer

    root = tmp_path_factory.mktemp("steerlm_sft")
    # Each problem twice: right (correctness 4) and off by ten (2), so only the attribute line
    # tells which answer is wanted.
    records = []
    for record in arithmetic.sft_records(128, seed=2, p_forget_carry=0.0):
        a, b = arithmetic.parse_prompt(record["input"])
        wrong = str(a + b - 10) if a + b >= 10 else str(a + b + 10)
        records += [{**record, "attributes": {"correctness": 4}},
                    {**record, "output": wrong, "attributes": {"correctness": 2}}]
    train = write_jsonl(root / "annotated.jsonl", records)
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    run_dir = root / "steerlm"
    result = _run([SFT_SCRIPT, f"tokenizer.path={root / 'tokenizer'}", f"data.train=[{{path: {train}}}]",
                   "data.steerlm.attributes=[correctness]", "data.steerlm.format=values", "data.split='100,0'",
                   "data.max_seq_length=16", "model.architecture.num_layers=2", "model.architecture.hidden_size=64",
                   "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
                   "model.architecture.ffn_hidden_size=128", "trainer.max_steps=40", "trainer.global_batch_size=32",
                   "trainer.micro_batch_size=32", "trainer.val_check_interval=0", "optim.lr=3e-3",
                   "optim.warmup_steps=2", "logging.progress_bar=false", "logging.tensorboard=false",
                   "logging.peak_tflops=1.0", f"checkpoint.save_dir={run_dir / 'checkpoints'}",
                   f"logging.log_dir={run_dir}"], timeout=600)
    assert result.returncode == 0, result.stderr[-6000:]
    return run_dir, checkpointing.latest_checkpoint(run_dir / "checkpoints")


def test_conditioned_sft_learns_and_records_its_conditioning(steerlm_run):
    from aligner import checkpointing

    run_dir, checkpoint = steerlm_run
    losses = [row["loss"] for row in metrics_rows(run_dir, "train")]
    assert len(losses) == 40
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    print(f"\nconditioned SFT loss {first:.3f} -> {last:.3f}")
    assert last < 0.75 * first
    assert checkpointing.read_meta(checkpoint)["steerlm"] == {"attributes": ["correctness"], "format": "values"}


def test_steered_evaluation_and_chat_render_the_request_alike(steerlm_run, tmp_path):
    _, checkpoint = steerlm_run
    prompts = write_jsonl(tmp_path / "prompts.jsonl", arithmetic.heldout_prompts(8))
    steered = _run(["-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, "--prompts", prompts,
                    "--steer", "correctness=4", "--output", tmp_path / "eval.json"])
    assert steered.returncode == 0, steered.stderr[-4000:]
    assert "greedy asking for correctness=4 accuracy" in steered.stdout
    evaluation = json.loads((tmp_path / "eval.json").read_text())
    assert evaluation["num_carry"] + evaluation["num_no_carry"] == 8
    # chat.py (KV-cached engine) answers the same steered prompts as evaluate's full-forward decoding.
    answers = tmp_path / "answers.jsonl"
    chat = _run([REPO_ROOT / "examples" / "nlp" / "gpt" / "chat.py", f"init_from={checkpoint}",
                 f"prompts_file={prompts}", f"output_file={answers}", "sampling.max_new_tokens=6",
                 "steer={correctness: 4}"])
    assert chat.returncode == 0, chat.stderr[-4000:]
    assert [r["prompt"] + r["response"] for r in _read_jsonl(answers)] == evaluation["examples"]

    wrong_name = _run(["-m", "aligner.demo.evaluate", "--checkpoint", checkpoint, "--prompts", prompts,
                       "--steer", "helpfulness=4"])
    assert wrong_name.returncode == 2 and "unknown 'helpfulness'; missing 'correctness'" in wrong_name.stderr
    plain = _run(["-m", "aligner.demo.evaluate", "--checkpoint", checkpoint.parent.parent.parent / "tokenizer",
                  "--prompts", prompts, "--steer", "correctness=4"])
    assert plain.returncode == 2 and "not an aligner checkpoint" in plain.stderr
