"""examples/nlp/gpt/chat.py end to end: batch answers, interactive multi-turn chat, HF model directories.

The entry point runs in a subprocess on tiny random-weight models made here. Greedy answers must
equal reference decoding: `generate_full_forward` (full forward passes, no KV cache) for aligner
checkpoints, and transformers' own `generate` for an HF directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from aligner.config import CONF_DIR, load_config

from ..conftest import REPO_ROOT, dotted_keys

ENTRY_POINT = REPO_ROOT / "examples" / "nlp" / "gpt" / "chat.py"
CHAT_YAML = CONF_DIR / "chat.yaml"
MAX_NEW_TOKENS = 8
MAX_POSITIONS = 64
CHARACTERS = "0123456789+=abcdefghij"


def run_chat(*overrides: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items()
           if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    result = subprocess.run([sys.executable, str(ENTRY_POINT), *overrides], input=stdin, capture_output=True,
                            text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    if result.returncode != 0:
        pytest.fail(f"chat.py exited {result.returncode}\n--- stdout ---\n{result.stdout[-4000:]}\n"
                    f"--- stderr ---\n{result.stderr[-6000:]}")
    return result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(aligner checkpoint of a random Llama-style model, reference greedy decoder on the same weights)."""
    from aligner import checkpointing
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.generation.reference import generate_full_forward
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer

    work = tmp_path_factory.mktemp("chat")
    train_char_tokenizer([CHARACTERS], work / "tokenizer")
    tokenizer = Tokenizer(work / "tokenizer")
    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(7)
        # A larger init spread than usual: random logits far apart, so greedy choices have no near-ties.
        cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                        vocab_size=tokenizer.vocab_size, max_position_embeddings=MAX_POSITIONS, init_method_std=0.1)
        model = build_gpt_model(cfg, transformer_config(cfg))
        path = checkpointing.save(work / "ckpt", [model], model_config=cfg.to_dict(), tokenizer_dir=work / "tokenizer")

        def reference(prompts: list[list[int]]) -> list[str]:
            outputs = generate_full_forward([model], prompts, vocab_size=cfg.vocab_size, eos_id=tokenizer.eos_id,
                                            pad_id=tokenizer.pad_id, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
            return [tokenizer.decode([t for t in output if t != tokenizer.eos_id]) for output in outputs]

        yield path, tokenizer, reference
    finally:
        distributed.shutdown()


def test_batch_mode_answers_every_prompt_like_greedy_reference(checkpoint, tmp_path):
    path, tokenizer, reference = checkpoint
    records = [
        {"prompt": "12+7="},
        {"messages": [{"role": "user", "content": "3+4="}]},
        {"prompt": "45+45=", "id": "kept"},
        {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="},
                      {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}]},
        {"prompt": "9" * 60},  # 61 tokens + 8 new > 64 positions: answered with an error, not fatal
    ]
    prompts_file, output_file = tmp_path / "prompts.jsonl", tmp_path / "out" / "answers.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_chat(f"init_from={path}", f"prompts_file={prompts_file}", f"output_file={output_file}",
                      f"sampling.max_new_tokens={MAX_NEW_TOKENS}", "batch_size=2")
    assert f"wrote 5 responses to {output_file}" in result.stdout
    answers = [json.loads(line) for line in output_file.read_text().splitlines()]
    assert len(answers) == len(records)

    bos = [tokenizer.bos_id]
    expected = reference([
        bos + tokenizer.encode("12+7="),
        tokenizer.encode_chat(records[1]["messages"], add_generation_prompt=True)[0],
        bos + tokenizer.encode("45+45="),
        tokenizer.encode_chat(records[3]["messages"], add_generation_prompt=True)[0],
    ])
    assert [a["response"] for a in answers[:4]] == expected
    assert any(expected), "the reference answers are not all empty"
    for answer, record in zip(answers, records):
        assert {k: answer[k] for k in record} == record  # the input record is kept as is
    assert answers[4]["response"] is None and "exceeds max_sequence_length=64" in answers[4]["error"]


def test_interactive_multi_turn_streams_and_exits(checkpoint):
    path, tokenizer, reference = checkpoint
    stdin = "12+7=\n3+4=\n/reset\n3+4=\n/exit\n"
    result = run_chat(f"init_from={path}", f"sampling.max_new_tokens={MAX_NEW_TOKENS}", "stream_chunk_tokens=3",
                      stdin=stdin)
    first = [{"role": "user", "content": "12+7="}]
    (reply1,) = reference([tokenizer.encode_chat(first, add_generation_prompt=True)[0]])
    second = first + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "3+4="}]
    (reply2,) = reference([tokenizer.encode_chat(second, add_generation_prompt=True)[0]])
    (fresh,) = reference([tokenizer.encode_chat([{"role": "user", "content": "3+4="}], add_generation_prompt=True)[0]])
    replies = [line.split("assistant> ", 1)[1] for line in result.stdout.splitlines() if "assistant> " in line]
    assert replies == [reply1, reply2, fresh]  # the second turn saw the first; /reset forgot it
    assert "(new conversation)" in result.stdout


def test_interactive_ends_cleanly_at_end_of_input(checkpoint):
    path, _, _ = checkpoint
    result = run_chat(f"init_from={path}", "sampling.max_new_tokens=2", stdin="12+7=\n")
    assert result.stdout.count("assistant> ") == 1


def test_hf_model_directory_is_imported_and_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.tokenizer import Tokenizer

    hf_dir = tmp_path / "hf"
    train_char_tokenizer([CHARACTERS], hf_dir)
    tokenizer = Tokenizer(hf_dir)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, initializer_range=0.1,
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
    )
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(hf_dir))

    prompts = ["12+7=", "3+4=", "45+45="]
    prompts_file, output_file = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    run_chat(f"init_from={hf_dir}", f"prompts_file={prompts_file}", f"output_file={output_file}",
             f"sampling.max_new_tokens={MAX_NEW_TOKENS}")
    answers = [json.loads(line)["response"] for line in output_file.read_text().splitlines()]

    expected = []
    for prompt in prompts:
        ids = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_id,
                                 pad_token_id=tokenizer.pad_id)
        expected.append(tokenizer.decode([t for t in out[0, ids.shape[1]:].tolist() if t != tokenizer.eos_id]))
    assert answers == expected


# ----------------------------------------------------------------------------- config
def test_shipped_yaml_has_every_schema_key_and_validates(tmp_path):
    from omegaconf import OmegaConf

    from aligner.generation.chat import ChatConfig


    assert dotted_keys(OmegaConf.structured(ChatConfig)) == dotted_keys(OmegaConf.load(CHAT_YAML))
    cfg = load_config(ChatConfig, CHAT_YAML, ["init_from=x", "sampling.temperature=0.7", "sampling.top_k=5"])
    params = cfg.sampling_params([2, 9])
    assert (params.temperature, params.top_k, params.greedy, params.stop_token_ids) == (0.7, 5, False, [2, 9])
    assert load_config(ChatConfig, CHAT_YAML, ["init_from=x"]).sampling_params([2]).is_greedy  # greedy default
    with pytest.raises(ValueError, match="both prompts_file and output_file"):
        load_config(ChatConfig, CHAT_YAML, ["init_from=x", "prompts_file=a.jsonl"]).validate()
    with pytest.raises(ValueError, match="stream_chunk_tokens"):
        load_config(ChatConfig, CHAT_YAML, ["init_from=x", "stream_chunk_tokens=0"]).validate()


def test_missing_checkpoint_is_one_clear_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, str(ENTRY_POINT), f"init_from={tmp_path / 'nope'}"], capture_output=True,
                            text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert f"error: init_from={tmp_path / 'nope'} does not exist;" in result.stderr
