"""Shared test helpers: launching multi-process (torchrun) scripts on gloo."""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def live_processes_in_group(pgid: int, timeout_s: float = 30.0) -> list[str]:
    """The processes of process group `pgid` still running after up to `timeout_s` ("pid command" each; [] once
    all are gone). Zombies do not count: an orphan (tritonserver outliving the rank that started it) is reaped
    by PID 1 when PID 1 gets to it, and until then it exists but runs nothing. The wait is there because a
    group's last members exit a moment after the process the test waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited while we looked
                continue
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses, so split after the last ")"
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                live.append(f"{entry.name} {stat[stat.index('(') + 1:stat.rindex(')')]}")
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


def free_port_block(count: int = 3) -> int:
    """A port p with p .. p+count-1 free on 127.0.0.1 (a server's HTTP, gRPC, metrics).

    Drawn below Linux's ephemeral range (32768+), so no outgoing connection of another test can take
    the port between this check and the bind.
    """
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        base = rng.randrange(20000, 32768 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no block of free ports found")


# What torchrun gives a worker; a single process started without torchrun must not inherit them from the test.
TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                      "TORCHELASTIC_RUN_ID")


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600) -> str:
    """Run `script` under torchrun with `nproc` CPU processes; returns stdout, fails with all output.

    nproc=1 runs `python script` instead (the runtime makes its own one-process group): the single-process
    reference of a parity test, without torchrun's ~3.5 s of start-up. Each process gets the test's
    OMP_NUM_THREADS (else the cores) divided by nproc: two 2-thread ranks on 2 cores spin against each other
    (a 2-rank DPO run: 21.9 s at 2 threads a rank, 16.9 s at 1; AMD EPYC, 2 cores)."""
    env = {name: value for name, value in os.environ.items() if name not in TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    threads = int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    env["OMP_NUM_THREADS"] = str(max(1, threads // nproc))
    env.setdefault("PYTHONWARNINGS", "ignore")
    if nproc == 1:
        command = [sys.executable, str(script), *map(str, args)]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}", f"--master_port={free_port_block(1)}", "--master_addr=127.0.0.1",
            str(script), *map(str, args),
        ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    if result.returncode != 0:
        pytest.fail(
            f"torchrun {script} (nproc={nproc}) exited {result.returncode}\n"
            f"--- stdout ---\n{result.stdout[-6000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result.stdout


@pytest.fixture(scope="session", autouse=True)
def import_cache(tmp_path_factory) -> Path:
    """The HF/GGUF import cache of every test (and the processes they start): a session directory, never
    the user's ~/.cache/aligner (`aligner.hf.sources`)."""
    from aligner.hf.sources import CACHE_ENV

    directory = tmp_path_factory.mktemp("aligner_cache")
    previous = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(directory)
    yield directory
    if previous is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = previous


@pytest.fixture(scope="module")
def single_process():
    """megatron's parallel state in this one process (TP=PP=DP=1; gloo on CPU, nccl on a GPU)."""
    from aligner.runtime import distributed, seeds

    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    yield
    distributed.shutdown()


@pytest.fixture
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def arithmetic_tokenizer_dir(tmp_path_factory) -> Path:
    """A character tokenizer over the demo task's alphabet (digits, '+', '='), trained once per session."""
    from aligner.demo.tokenizer import train_char_tokenizer

    directory = tmp_path_factory.mktemp("arithmetic_tokenizer")
    train_char_tokenizer(["0123456789+="], directory)
    return directory


def write_jsonl(path: Path, records: list[dict]) -> Path:
    """One JSON object per line; returns the path."""
    import json

    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


# The tiny model and quiet settings of the PPO pipeline tests (tests/functional/test_ppo_launch.py, tests/cluster).
TINY_MODEL = ["model.architecture.num_layers=2", "model.architecture.hidden_size=32",
              "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
              "model.architecture.ffn_hidden_size=64"]
QUIET_RUN = ["logging.progress_bar=false", "logging.tensorboard=false", "logging.peak_tflops=1.0",
             "trainer.val_check_interval=0", "data.split='100,0'", "data.max_seq_length=16"]


def write_ppo_inputs(root: Path, *, sft: int, pairs: int, prompts: int, seed: int = 7) -> None:
    """The demo task's SFT records, preference pairs and RL prompts (root/sft.jsonl, pairs.jsonl, prompts.jsonl)
    and a character tokenizer trained on the SFT records (root/tokenizer)."""
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer

    records = arithmetic.sft_records(sft, seed=seed)
    write_jsonl(root / "sft.jsonl", records)
    write_jsonl(root / "pairs.jsonl", arithmetic.preference_records(pairs, seed=seed))
    write_jsonl(root / "prompts.jsonl", arithmetic.rl_prompts(prompts, seed=seed))
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")


def metrics_rows(log_dir: Path, *splits: str) -> list[dict]:
    """The rows a run wrote to log_dir/metrics.jsonl, in order; only those of `splits` if given
    (`aligner.training.metrics.read_metrics`: without resume marker rows or a partial last row)."""
    from aligner.training.metrics import read_metrics

    return read_metrics(log_dir, *splits)


def processes_alive(processes, timeout_s: float) -> list[str]:
    """The psutil processes still running (zombies count as gone) after waiting up to timeout_s
    for them to end, each as 'name[pid]: command line'; [] once all have ended."""
    import time

    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for process in processes:
            try:
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{process.name()}[{process.pid}]: {' '.join(process.cmdline())[:120]}")
            except psutil.Error:  # ended while being looked at
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def dotted_keys(config) -> set[str]:
    """Every key of a (nested) config as dotted paths, e.g. {"trainer", "trainer.max_steps"}.

    Accepts an omegaconf config or plain dicts; used to check that a shipped yaml documents
    every key of its schema.
    """
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(config) if OmegaConf.is_config(config) else config
    found = set()
    for key, value in node.items():
        found.add(str(key))
        if isinstance(value, dict):
            found |= {f"{key}.{inner}" for inner in dotted_keys(value)}
    return found


def train_tiny_arithmetic_policy(root: Path, seed: int, num_prompts: int = 64, steps: int = 20) -> tuple[Path, Path]:
    """A tiny (2-layer, 32-wide) policy SFT-trained for a few steps on the demo task, so its responses are
    short digit strings that often stop, and a prompt file: (checkpoint, prompts.jsonl) under root."""
    import json

    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer

    records = arithmetic.sft_records(128, seed=seed)
    train = root / "sft.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.rl_prompts(num_prompts, seed=seed)))
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    result = subprocess.run([
        sys.executable, str(REPO_ROOT / "examples" / "nlp" / "gpt" / "train_gpt_sft.py"),
        f"tokenizer.path={root / 'tokenizer'}", f"data.train=[{{path: {train}}}]", "data.split='100,0'",
        "data.max_seq_length=16", "model.architecture.num_layers=2", "model.architecture.hidden_size=32",
        "model.architecture.num_attention_heads=4", "model.architecture.num_query_groups=2",
        "model.architecture.ffn_hidden_size=64", f"trainer.max_steps={steps}", "trainer.global_batch_size=32",
        "trainer.micro_batch_size=32", "trainer.val_check_interval=0", "optim.lr=3e-3", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / 'sft'}",
        f"logging.log_dir={root / 'sft_logs'}",
    ], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return root / "sft" / f"step_{steps:08d}", prompts


# ---------------------------------------------------------------------- conversational data
# The three tokenizers of tests/chat_tokenizers.py, and prompts/answers in every layout the readers
# accept: plain text, one user message, a system message, multi-turn with and without system.
CHAT_KINDS = ("smollm2", "llama3", "plain")
SAMPLE_PROMPTS = {
    "text": "What is the capital of France?",
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [{"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "List three prime numbers."}],
    "multi_turn": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello, how are you?"},
                   {"role": "user", "content": "Twelve plus seven?"}],
    "multi_turn_system": [{"from": "system", "value": "You are a helpful assistant."},
                          {"from": "human", "value": "hello world"}, {"from": "gpt", "value": "fine thanks"},
                          {"from": "human", "value": "12+7="}],
}
SAMPLE_ANSWERS = {
    "text": "The capital of France is Paris.",
    "message": {"role": "assistant", "content": "2, 3 and 5."},
    "message_list": [{"role": "assistant", "content": "nineteen: 12+7=19"}],
}


@pytest.fixture(scope="session")
def chat_tokenizers(tmp_path_factory) -> dict:
    """kind -> Tokenizer for each of CHAT_KINDS (built once per session)."""
    from .chat_tokenizers import build_chat_tokenizer

    return {kind: build_chat_tokenizer(tmp_path_factory.mktemp(f"chat_{kind}"), kind) for kind in CHAT_KINDS}


def answer_text(answer) -> str:
    """The text of a SAMPLE_ANSWERS value."""
    return answer if isinstance(answer, str) else (answer[0] if isinstance(answer, list) else answer)["content"]


def sft_reference(tokenizer, prompt, answer, use_template: bool = True) -> tuple[list[int], int]:
    """The SFT encoding of prompt + the assistant's answer, cut at the end of its last assistant span,
    and where that span starts: (tokens, start). A text prompt is an {"input", "output"} record."""
    from aligner.data.conversation import parse_messages
    from aligner.data.sft import encode_record

    if isinstance(prompt, str):
        record = {"input": prompt, "output": answer_text(answer)}
    else:
        record = {"messages": parse_messages(prompt, "prompt", "reference", 1)
                  + [{"role": "assistant", "content": answer_text(answer)}]}
    example = encode_record(record, tokenizer, "reference", 1, use_template)
    end = max(index for index, masked in enumerate(example.loss_mask) if masked) + 1
    start = end
    while start > 0 and example.loss_mask[start - 1]:
        start -= 1
    return example.tokens[:end], start


def write_model_meta(directory: Path, model_cfg, tokenizer_dir: Path) -> Path:
    """A checkpoint directory holding only what is read before a model is built: its aligner_meta.json
    (this model config) and its tokenizer; returns the directory."""
    import json
    import shutil

    from aligner import checkpointing

    directory.mkdir(parents=True, exist_ok=True)
    meta = {"format": checkpointing.FORMAT, "model": model_cfg.to_dict()}
    (directory / checkpointing.META_FILE).write_text(json.dumps(meta))
    shutil.copytree(tokenizer_dir, directory / checkpointing.TOKENIZER_DIR)
    return directory
