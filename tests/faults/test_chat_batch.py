"""chat.py batch mode: the output file is checked before the model loads, and a batch stopped by a
signal keeps the answers so far (whole lines, in input order) and says how many."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from aligner.config import CONF_DIR, OutputError, load_config
from aligner.generation import chat

from ..conftest import REPO_ROOT, write_jsonl

ENTRY_POINT = REPO_ROOT / "examples" / "nlp" / "gpt" / "chat.py"
NUM_PROMPTS = 400


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An aligner checkpoint of a tiny random Llama-style model over a character tokenizer."""
    from aligner import checkpointing
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer

    work = tmp_path_factory.mktemp("chat_batch")
    train_char_tokenizer(["0123456789+="], work / "tokenizer")
    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(3)
        cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                        vocab_size=Tokenizer(work / "tokenizer").vocab_size, max_position_embeddings=128)
        model = build_gpt_model(cfg, transformer_config(cfg))
        yield checkpointing.save(work / "ckpt", [model], model_config=cfg.to_dict(), tokenizer_dir=work / "tokenizer")
    finally:
        distributed.shutdown()


@pytest.mark.parametrize("kind", ["under_a_file", "a_directory", "the_prompts_file"])
def test_an_unwritable_output_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, kind):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1="}])
    (tmp_path / "a_file").write_text("kept")
    (tmp_path / "a_directory").mkdir()
    output, reason = {
        "under_a_file": (tmp_path / "a_file" / "out.jsonl",
                         f"is not writable ({tmp_path / 'a_file'} is a file, not a directory)"),
        "a_directory": (tmp_path / "a_directory", "is not writable (Is a directory)"),
        "the_prompts_file": (prompts, "is the prompts_file"),
    }[kind]

    def load_chat_model(*args, **kwargs):
        raise AssertionError("the model was loaded before output_file was checked")

    monkeypatch.setattr(chat, "load_chat_model", load_chat_model)
    cfg = load_config(chat.ChatConfig, CONF_DIR / "chat.yaml", [f"init_from={tmp_path}", f"prompts_file={prompts}",
                                                               f"output_file={output}"])
    with pytest.raises(OutputError, match="^" + re.escape(f"output_file={output} {reason}")):
        chat.run_chat(cfg)
    assert (tmp_path / "a_file").read_text() == "kept" and prompts.read_text() == '{"prompt": "1+1="}\n'


def test_sigterm_mid_batch_keeps_the_answers_so_far_and_says_how_many(checkpoint, tmp_path):
    records = [{"prompt": f"{index}+{index}=", "id": index} for index in range(NUM_PROMPTS)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    output = tmp_path / "out" / "answers.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    process = subprocess.Popen([sys.executable, str(ENTRY_POINT), f"init_from={checkpoint}",
                                f"prompts_file={prompts}", f"output_file={output}", "batch_size=1",
                                "sampling.max_new_tokens=64"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and output.read_bytes().count(b"\n") >= 2) and process.poll() is None:
            assert time.monotonic() < deadline, "no answer was written within 120 s"
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)  # (on a process that has already ended: no effect, the checks fail)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    lines = output.read_text().splitlines()
    assert 2 <= len(lines) < NUM_PROMPTS
    answers = [json.loads(line) for line in lines]  # whole lines only
    assert [answer["id"] for answer in answers] == list(range(len(lines)))  # input order, no gaps
    assert all(isinstance(answer["response"], str) for answer in answers)
    assert (f"{len(lines)} of {NUM_PROMPTS} answers written to {output} (in input order; the other "
            f"{NUM_PROMPTS - len(lines)} were not)") in stderr, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr and "Traceback" not in stderr
