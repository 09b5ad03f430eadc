"""The reward-model server end to end: the real entry point in a subprocess, the real client.

Served rewards must equal in-process `RewardInference.infer` rewards whatever the batching; bad
requests get an error answer and the server keeps serving; an unreachable server fails fast with a
message that says what to start. One server (random-weight checkpoint) serves the whole module.
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aligner.clients.reward import RewardClient, RewardServerError, ServerUnavailableError
from aligner.config import CONF_DIR, ConfigError, load_config

from ..conftest import REPO_ROOT, dotted_keys, free_port_block  # noqa: F401 - re-exported to the server tests

ENTRY_POINT = REPO_ROOT / "examples" / "nlp" / "gpt" / "serve_reward_model.py"
RM_YAML = CONF_DIR / "inference_rm.yaml"
ATTRIBUTES = ["helpfulness", "correctness"]
MAX_LENGTH = 64  # the test model's max_position_embeddings
MICRO_BATCH_SIZE = 3  # not a divisor of most merged batches: RewardInference pads rows
READY_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 20.0  # Triton's exit timeout is 3 s; model unload and clean-up take a few more


# ------------------------------------------------------------------------------------------
# helpers (also used by tests/distributed/test_reward_server_tp.py)


def make_reward_checkpoint(directory: Path) -> Path:
    """A random-weight 2-attribute reward model with a character tokenizer (needs a process group)."""
    from aligner import checkpointing
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import build_reward_model
    from aligner.runtime import seeds
    from aligner.tokenizer import Tokenizer

    tokenizer_dir = directory / "tokenizer_src"
    train_char_tokenizer(["0123456789+= abcdefghij"], tokenizer_dir)
    vocab_size = Tokenizer(tokenizer_dir).vocab_size
    seeds.set_seed(1234)
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=vocab_size, max_position_embeddings=MAX_LENGTH)
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=len(ATTRIBUTES), head_seed=7)
    # Normalisation keeps the served rewards O(1), where fp32 spacing is ~1e-7.
    reward_meta = {"type": "regression", "attributes": ATTRIBUTES,
                   "normalization": {"mean": [0.3, -0.2], "std": [3.0, 2.5]}}
    return checkpointing.save(directory / "rm", [model], model_config=cfg.to_dict(),
                              extra_meta={"reward": reward_meta}, tokenizer_dir=tokenizer_dir)


def random_sequences(count: int, vocab_size: int, seed: int, max_length: int = MAX_LENGTH - 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(rng.randint(1, max_length))] for _ in range(count)]


def in_process_rewards(inference, sequences: list[list[int]]) -> np.ndarray:
    """RewardInference.infer on one right-padded batch: [len(sequences), A]."""
    tokens = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.int64)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(ids) for ids in sequences])
    return inference.infer(tokens, lengths).numpy()


class ServerProcess:
    """A server started from the command line, its output in a log file."""

    def __init__(self, command: list[str], log_path: Path, *, new_session: bool = False):
        # Not this process's rendezvous (set when the test initialised its own process group).
        env = {name: value for name, value in os.environ.items()
               if name not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONWARNINGS", "ignore")
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                        start_new_session=new_session)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log().splitlines():
                if "server ready on" in line:
                    return line
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode} before it was ready:\n{self.log()[-6000:]}")
            time.sleep(0.25)
        self.kill()
        pytest.fail(f"server not ready after {timeout_s} s:\n{self.log()[-6000:]}")

    def stop(self, sig: int = signal.SIGTERM, *, group: bool = False,
             timeout_s: float = STOP_TIMEOUT_S) -> tuple[int, float]:
        """Send `sig`; (exit code, seconds until exit). Kills and fails if it does not exit in time."""
        start = time.monotonic()
        if self.process.poll() is None:
            if group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"server did not exit within {timeout_s} s of signal {sig}:\n{self.log()[-6000:]}")
        self._log.close()
        return code, time.monotonic() - start

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.process.kill()
            self.process.wait(timeout=30)


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """(checkpoint dir, in-process LoadedRewardModel at TP=1) for the reference rewards."""
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed

    distributed.initialize(distributed.ParallelConfig())
    try:
        checkpoint = make_reward_checkpoint(tmp_path_factory.mktemp("reward_server"))
        yield checkpoint, load_reward_model(checkpoint, micro_batch_size=MICRO_BATCH_SIZE)
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def server(reward_model, tmp_path_factory):
    checkpoint, _ = reward_model
    port = free_port_block()
    log = tmp_path_factory.mktemp("reward_server_log") / "server.log"
    process = ServerProcess([sys.executable, str(ENTRY_POINT), f"init_from={checkpoint}", f"server.port={port}",
                             f"inference.micro_batch_size={MICRO_BATCH_SIZE}", "server.max_batch_size=16",
                             "server.max_queue_delay_microseconds=5000"], log)
    ready_line = process.wait_ready()
    process.port, process.ready_line = port, ready_line
    yield process
    if process.process.poll() is None:
        process.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    with RewardClient("127.0.0.1", server.port, timeout_s=60, ready_timeout_s=30, max_workers=8) as reward_client:
        reward_client.wait_until_ready(timeout_s=30)
        yield reward_client


@pytest.fixture(scope="module")
def pool(reward_model):
    """60 sequences of mixed lengths with their in-process rewards (one batch, max padding)."""
    _, loaded = reward_model
    sequences = random_sequences(60, loaded.model_cfg.vocab_size, seed=0)
    sequences[0] = sequences[0][:1]  # a one-token sequence
    sequences[2] = (sequences[2] * 5)[:5]  # short: 8 columns on the wire, like a short bad request
    sequences[1] = [int(x) for x in np.arange(MAX_LENGTH) % loaded.model_cfg.vocab_size]  # exactly max length
    return sequences, in_process_rewards(loaded.inference, sequences)


# ------------------------------------------------------------------------------------------
# config


def test_shipped_yaml_has_every_schema_key_and_loads():
    from omegaconf import OmegaConf

    from servers.reward_model import RewardServerConfig


    schema = dotted_keys(OmegaConf.structured(RewardServerConfig))
    assert schema - dotted_keys(OmegaConf.load(RM_YAML)) == set(), "keys missing from the yaml"
    cfg = load_config(RewardServerConfig, RM_YAML, ["init_from=/ckpt", "server.port=7000"])
    assert cfg.init_from == "/ckpt"
    assert cfg.server.model_name == "reward_model" and cfg.server.host == "127.0.0.1"
    assert (cfg.server.port, cfg.server.grpc_port, cfg.server.metrics_port) == (7000, 7001, 7002)
    assert (cfg.server.preferred_batch_sizes is None and cfg.normalize_rewards
            and cfg.pad_sequence_length_to_multiple == 8)
    with pytest.raises(ConfigError, match="server.prot"):
        load_config(RewardServerConfig, RM_YAML, ["init_from=/ckpt", "server.prot=7000"])
    with pytest.raises(ConfigError, match="init_from"):
        load_config(RewardServerConfig, RM_YAML, [])
    with pytest.raises(ConfigError, match=r"pad_sequence_length_to_multiple=0 is out of range"):
        load_config(RewardServerConfig, RM_YAML, ["init_from=/ckpt", "pad_sequence_length_to_multiple=0"])


def test_old_checkpoint_key_still_loads_with_a_deprecation_line(capsys):
    from servers.reward_model import RewardServerConfig

    cfg = load_config(RewardServerConfig, RM_YAML, ["rm_model_file=/old"])
    assert cfg.init_from == "/old"
    assert "deprecated: the command line sets rm_model_file; it is now init_from" in capsys.readouterr().err


def test_entry_point_rejects_unknown_key_with_its_name():
    start = time.monotonic()
    result = subprocess.run([sys.executable, str(ENTRY_POINT), "init_from=/nowhere", "server.prot=7000"],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "server.prot" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - start < 60


def test_environment_checks(monkeypatch):
    import sysconfig

    import numpy

    from servers import triton

    libdir = sysconfig.get_config_var("LIBDIR")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/other:/usr/lib")
    triton.prefix_python_libdir()
    triton.prefix_python_libdir()  # already first: unchanged
    assert os.environ["LD_LIBRARY_PATH"] == f"{libdir}:/opt/other:/usr/lib"
    monkeypatch.setattr(numpy, "__version__", "2.1.0")
    with pytest.raises(triton.TritonSetupError, match="numpy<2"):
        triton.check_numpy()


# ------------------------------------------------------------------------------------------
# served rewards


def test_ready_line_names_url_model_and_attributes(server):
    assert server.ready_line.strip() == (f"reward model server ready on http://127.0.0.1:{server.port} "
                                         f"(model 'reward_model', attributes {ATTRIBUTES})")


def test_start_prints_only_where_tritons_log_is_and_the_ready_line(server):
    """Triton's option tables and, without a GPU, its CUDA driver and NVML errors go to its own file."""
    before_ready = server.log().split(server.ready_line)[0].splitlines()
    assert len(before_ready) == 1 and "INFO servers.triton: Triton's log: " in before_ready[0], before_ready
    triton_log = Path(before_ready[0].split("Triton's log: ")[1])
    assert "Started HTTPService at 127.0.0.1:" in triton_log.read_text()  # removed when the server stops cleanly
    assert "NVML" not in server.log() and "NVML" not in triton_log.read_text()


def test_served_rewards_equal_in_process_whatever_the_batching(client, pool):
    sequences, reference = pool
    # One request with every sequence (split by the client at the server's max_batch_size of 16).
    whole = client.infer(sequences)
    assert whole.shape == (len(sequences), len(ATTRIBUTES)) and whole.dtype == np.float32
    differences = [np.abs(whole - reference).max()]
    # One sequence per request, all in flight together: the server merges them as they come.
    singles = [client.infer_async([ids]) for ids in sequences]
    differences.append(np.abs(np.concatenate([f.result(timeout=120) for f in singles]) - reference).max())
    # Random groups of 1..8, in flight together.
    rng = random.Random(1)
    groups, start = [], 0
    while start < len(sequences):
        size = rng.randint(1, 8)
        groups.append((start, min(start + size, len(sequences))))
        start += size
    futures = [client.infer_async(sequences[a:b]) for a, b in groups]
    differences += [np.abs(future.result(timeout=120) - reference[a:b]).max()
                    for (a, b), future in zip(groups, futures)]
    print(f"\nserved vs in-process: max abs diff {max(differences):.2e} (rewards up to {np.abs(reference).max():.2f})")
    assert max(differences) < 1e-6


def test_text_input_equals_token_input(client, reward_model):
    _, loaded = reward_model
    tokenizer = loaded.tokenizer
    texts = ["12+7=19", "a", "hello", "0+0=0 abc", "99+1=100"]
    token_lists = [[tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id] for text in texts]
    from_text = client.infer_text(texts)
    assert np.abs(from_text - client.infer(token_lists)).max() < 1e-6
    assert np.abs(from_text - in_process_rewards(loaded.inference, token_lists)).max() < 1e-6


CONVERSATIONS = [  # (prompt, response) in every layout; the characters are in the test tokenizer's vocabulary
    ("12+7=", "19"),
    ([{"role": "user", "content": "1+1="}], {"role": "assistant", "content": "2"}),
    ([{"role": "system", "content": "abc"}, {"from": "human", "value": "12+7="}, {"from": "gpt", "value": "19"},
      {"role": "user", "content": "9+9="}], [{"role": "assistant", "content": "18"}]),
]


def test_conversational_requests_score_the_tokens_reward_training_uses(client, reward_model, tmp_path):
    from aligner.data.reward import RegressionDataset

    _, loaded = reward_model
    records = [{"prompt": prompt, "response": response, "label": {ATTRIBUTES[0]: 1}}
               for prompt, response in CONVERSATIONS]
    path = tmp_path / "labels.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    training = [item["tokens"].tolist() for item in RegressionDataset(path, loaded.tokenizer, MAX_LENGTH, ATTRIBUTES)]
    plain = [item["tokens"].tolist() for item in RegressionDataset(path, loaded.tokenizer, MAX_LENGTH, ATTRIBUTES,
                                                                    use_template=False)]
    assert training[2] != plain[2]  # the server must render the multi-turn prompt with the template to pass
    served = client.infer_conversations([prompt for prompt, _ in CONVERSATIONS],
                                        [answer for _, answer in CONVERSATIONS])
    assert np.abs(served - in_process_rewards(loaded.inference, training)).max() < 1e-6


def test_many_threads_get_their_own_answers(client, pool):
    sequences, reference = pool
    errors: list[str] = []
    checked = [0] * 8

    def worker(thread_index: int) -> None:
        rng = random.Random(100 + thread_index)
        for _ in range(50):
            rows = rng.sample(range(len(sequences)), rng.randint(1, 6))
            rewards = client.infer([sequences[row] for row in rows])
            difference = float(np.abs(rewards - reference[rows]).max())
            if difference >= 1e-6:
                errors.append(f"thread {thread_index} rows {rows}: max diff {difference}")
            checked[thread_index] += 1

    start = time.monotonic()
    threads = [threading.Thread(target=worker, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    elapsed = time.monotonic() - start
    assert not any(thread.is_alive() for thread in threads), "client threads did not finish within 300 s"
    assert errors == [] and checked == [50] * 8
    print(f"\n8 threads x 50 requests: {elapsed:.2f} s")


def test_small_batch_round_trip_latency(client, pool):
    sequences, _ = pool
    batch = sequences[2:6]
    client.infer(batch)  # warm
    times = []
    for _ in range(20):
        start = time.perf_counter()
        client.infer(batch)
        times.append(time.perf_counter() - start)
    median = sorted(times)[len(times) // 2]
    print(f"\nround trip, 4 sequences: median {median * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms")
    assert median < 5.0


# ------------------------------------------------------------------------------------------
# errors


BAD_TOKEN_REQUESTS = {
    "id >= vocab": ([[1, 5, 10_000]], "outside the vocabulary"),
    "negative id": ([[1, -3, 5]], "outside the vocabulary"),
    "empty sequence": ([[]], "empty sequence"),
    "longer than max length": ([[1] * (MAX_LENGTH + 1)], "longer than the model's max_position_embeddings"),
    "one bad row among good ones": ([[1, 2, 3], [4, 10_000], [5, 6]], "rejected 1 of 3 sequences: sequence 1"),
}


def _raw(tokens, lengths, tokens_dtype=np.int64):
    return {"tokens": np.asarray(tokens, dtype=tokens_dtype), "sequence_lengths": np.asarray(lengths, dtype=np.int64)}


def _conversations(*rows) -> dict:
    payloads = [row if isinstance(row, bytes) else json.dumps(row).encode() for row in rows]
    return {"conversations": np.array([[payload] for payload in payloads], dtype=object)}


BAD_RAW_REQUESTS = {
    "wrong dtype": (_raw([[1, 2, 3]], [[3]], np.int32), "INT32"),
    "float tokens": (_raw([[1.0, 2.0]], [[2]], np.float32), "FP32"),
    "length beyond tokens sent": (_raw([[1, 2, 3]], [[4]]), "only 3 token columns"),
    "missing tokens": ({"sequence_lengths": np.array([[3]], dtype=np.int64)}, "missing input tokens"),
    "missing lengths": ({"tokens": np.array([[1, 2]], dtype=np.int64)}, "missing input sequence_lengths"),
    "both inputs": ({**_raw([[1, 2]], [[2]]), "sentences": np.array([[b"12"]], dtype=object)}, "only one of"),
    "unknown input": ({"token_ids": np.array([[1, 2]], dtype=np.int64)}, "token_ids"),
    "not utf-8 text": ({"sentences": np.array([[b"\xff\xfe"]], dtype=object)}, "UTF-8"),
    "conversation not json": (_conversations(b'{"prompt": "1+1="'), "conversations: not UTF-8 JSON"),
    "prompt ends with the assistant": (_conversations({"prompt": [{"role": "user", "content": "1+1="},
                                                                  {"role": "assistant", "content": "2"}],
                                                       "response": "2"}), "'prompt' ends with an assistant turn"),
    "unknown role": (_conversations({"prompt": [{"role": "robot", "content": "1"}], "response": "2"}),
                     r"prompt\[0\] has unknown role 'robot'"),
    "response holds a user message": (_conversations({"prompt": "1+1=", "response": {"role": "user", "content": "2"}}),
                                      r"'response' holds 1 message\(s\) \(user\)"),
    "unknown key": (_conversations({"prompt": "1+1=", "response": "2", "label": 3}), "unknown key.*'label'"),
    "one bad conversation among good ones": (
        _conversations({"prompt": "1+1=", "response": "2"}, {"prompt": "1+1="}, {"prompt": "2+2=", "response": "4"}),
        "rejected 1 of 3 sequences: sequence 1: conversations: missing key 'response'"),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKEN_REQUESTS))
def test_bad_token_requests_get_an_error_and_the_server_goes_on(client, pool, case):
    sequences, reference = pool
    token_lists, message = BAD_TOKEN_REQUESTS[case]
    with pytest.raises(RewardServerError, match=message):
        client.infer(token_lists)
    assert np.abs(client.infer(sequences[:3]) - reference[:3]).max() < 1e-6


@pytest.mark.parametrize("case", sorted(BAD_RAW_REQUESTS))
def test_malformed_requests_get_an_error_and_the_server_goes_on(client, pool, case):
    sequences, reference = pool
    inputs, message = BAD_RAW_REQUESTS[case]
    with pytest.raises(RewardServerError, match=message):
        client.infer_tensors_async(inputs).result(timeout=60)
    assert np.abs(client.infer(sequences[3:5]) - reference[3:5]).max() < 1e-6


def test_bad_requests_do_not_spoil_good_ones_batched_with_them(client, pool):
    sequences, reference = pool
    # Both 8 columns wide, so Triton may merge good and bad requests into one batch.
    good, expected = [sequences[0], sequences[2]], reference[[0, 2]]
    futures = []
    for _ in range(10):
        futures.append(("bad", client.infer_async([[1, 2, 10_000]])))
        futures.append(("good", client.infer_async(good)))
    for kind, future in futures:
        if kind == "bad":
            with pytest.raises(RewardServerError, match="outside the vocabulary"):
                future.result(timeout=60)
        else:
            assert np.abs(future.result(timeout=60) - expected).max() < 1e-6


def test_unreachable_server_fails_fast_naming_host_and_port():
    port = free_port_block(1)  # nothing listens there
    with RewardClient("127.0.0.1", port, ready_timeout_s=2, timeout_s=5) as unreachable:
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{port}") as raised:
            unreachable.wait_until_ready(timeout_s=2)
        assert 1.9 <= time.monotonic() - start < 4.0
        assert "serve_reward_model.py init_from=" in str(raised.value)

        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{port}"):
            unreachable.infer([[1, 2, 3]])
        assert time.monotonic() - start < 4.0


def test_silent_server_fails_within_the_timeout():
    """Something listens on the port but never answers: still an error within the timeout, no hang."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        with RewardClient("127.0.0.1", port, ready_timeout_s=2, timeout_s=2) as silent:
            start = time.monotonic()
            with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{port}"):
                silent.infer([[1, 2, 3]])
            assert time.monotonic() - start < 4.5


# ------------------------------------------------------------------------------------------
# shutdown (last: it stops the module's server)


def test_server_exits_promptly_on_sigterm(server, client, pool):
    sequences, reference = pool
    assert np.abs(client.infer(sequences[:2]) - reference[:2]).max() < 1e-6
    code, elapsed = server.stop(signal.SIGTERM)
    print(f"\nexit after SIGTERM: {elapsed:.1f} s")
    assert code == 128 + signal.SIGTERM, server.log()[-4000:]  # the shell convention for a stop by SIGTERM
    assert "Traceback" not in server.log() and "interrupted by SIGTERM; exiting" in server.log()
    assert elapsed < 15.0
    with RewardClient("127.0.0.1", server.port) as gone, pytest.raises(ServerUnavailableError):
        gone.wait_until_ready(timeout_s=1)
    # A client that was talking to it finds out on its next request (and waits ready_timeout_s for a restart).
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=f"127.0.0.1:{server.port}"):
        client.infer(sequences[:2])
    assert time.monotonic() - start < client.ready_timeout_s + 5
