"""The PPO critic server end to end: the real entry point in a subprocess, the real client.

One combined-mode server (critic + reward model on the same weights' slot) serves most of the
module; a second server restarted from the first one's checkpoint checks resuming. References are
computed in this process from the same checkpoints: per-token values with RewardInference, the
first train call's loss and gradient norm with a float64 copy of the model and shaping.value_loss.
"""
from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aligner.clients.critic import CriticClient, CriticServerError, ServerUnavailableError
from aligner.clients.reward import RewardClient
from aligner.config import CONF_DIR, ConfigError, load_config

from ..conftest import REPO_ROOT, dotted_keys
from .test_reward_server import ServerProcess, free_port_block, random_sequences

ENTRY_POINT = REPO_ROOT / "examples" / "nlp" / "gpt" / "serve_ppo_critic.py"
CRITIC_YAML = CONF_DIR / "gpt_ppo_critic.yaml"
MAX_LENGTH = 64
INFER_MICRO_BATCH = 3  # not a divisor of most merged batches
TRAIN_ROWS, GLOBAL_BATCH, TRAIN_MICRO_BATCH = 8, 8, 2  # one optimizer step of 4 micro batches per call
LR, CLIP_VAL = 1e-4, 0.2
TRAIN_CALLS = 8  # calls after the first in test_training_lowers_the_value_loss
NORMALIZATION = {"mean": [0.3], "std": [2.5]}


def make_one_attribute_checkpoint(directory: Path, tokenizer_dir: Path, seed: int, normalization=None) -> Path:
    """A random-weight one-attribute reward model (needs a process group)."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, transformer_config
    from aligner.models.reward import build_reward_model
    from aligner.runtime import seeds
    from aligner.tokenizer import Tokenizer

    seeds.set_seed(seed)
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                    vocab_size=Tokenizer(tokenizer_dir).vocab_size, max_position_embeddings=MAX_LENGTH)
    model = build_reward_model(cfg, transformer_config(cfg), num_attributes=1, head_seed=seed)
    reward_meta = {"type": "binary_ranking", "attributes": ["reward"], "normalization": normalization}
    return checkpointing.save(directory, [model], model_config=cfg.to_dict(), extra_meta={"reward": reward_meta},
                              tokenizer_dir=tokenizer_dir)


def right_padded(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(len(sequences), max(map(len, sequences)), dtype=torch.int64)
    for row, ids in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return tokens, torch.tensor([len(ids) for ids in sequences])


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Checkpoints (critic init, reward model) and in-process models to compute references with."""
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.reward import load_reward_model
    from aligner.runtime import distributed

    root = tmp_path_factory.mktemp("critic_server")
    distributed.initialize(distributed.ParallelConfig())
    try:
        train_char_tokenizer(["0123456789+= abcdefghij"], root / "tokenizer")
        critic_init = make_one_attribute_checkpoint(root / "critic_init", root / "tokenizer", seed=11)
        reward_file = make_one_attribute_checkpoint(root / "reward", root / "tokenizer", seed=22,
                                                    normalization=NORMALIZATION)
        critic = load_reward_model(critic_init, micro_batch_size=INFER_MICRO_BATCH)
        reward = load_reward_model(reward_file, micro_batch_size=INFER_MICRO_BATCH)
        yield {"root": root, "critic_init": critic_init, "reward_file": reward_file, "critic": critic, "reward": reward,
               "vocab_size": critic.model_cfg.vocab_size}
    finally:
        distributed.shutdown()


def start_server(references, log_name: str, *extra: str, launcher: tuple = (sys.executable,)) -> ServerProcess:
    """The critic server with this module's settings (launcher: e.g. a torchrun command line)."""
    port = free_port_block()
    process = ServerProcess(
        [*launcher, str(ENTRY_POINT), f"critic.init_from={references['critic_init']}", f"server.port={port}",
         f"checkpoint.save_dir={references['root'] / 'critic_checkpoints'}", "checkpoint.keep_last=2",
         f"inference.micro_batch_size={INFER_MICRO_BATCH}", f"train.global_batch_size={GLOBAL_BATCH}",
         f"train.micro_batch_size={TRAIN_MICRO_BATCH}", f"train.clip_val={CLIP_VAL}", f"optim.lr={LR}",
         "optim.clip_grad=1000.0", "optim.weight_decay=0.0", "server.max_batch_size=16",
         "server.max_queue_delay_microseconds=5000", *extra],
        references["root"] / log_name, new_session=len(launcher) > 1)
    process.ready_line = process.wait_ready()
    process.port = port
    return process


@pytest.fixture(scope="module")
def server(references):
    process = start_server(references, "combined.log", f"combined.reward_model_init_from={references['reward_file']}",
                           "offload_optimizer_to_cpu=true")
    yield process
    if process.process.poll() is None:
        process.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    with CriticClient("127.0.0.1", server.port, timeout_s=60, train_timeout_s=120, ready_timeout_s=30) as critic:
        critic.wait_until_ready(timeout_s=30)
        yield critic


@pytest.fixture(scope="module")
def pool(references):
    """40 sequences of mixed lengths with their in-process per-token values and rewards."""
    sequences = random_sequences(40, references["vocab_size"], seed=3)
    sequences[0] = sequences[0][:1]
    sequences[1] = [int(x) for x in np.arange(MAX_LENGTH) % references["vocab_size"]]  # exactly max length
    tokens, lengths = right_padded(sequences)
    values = references["critic"].inference.token_scores(tokens, lengths)[..., 0].numpy()
    rewards = references["reward"].inference.infer(tokens, lengths)[:, 0].numpy()
    return sequences, values, rewards


@pytest.fixture(scope="module")
def rollout(references, pool):
    """A fixed train batch: prompts + responses, old_values = the critic's values at rollout, returns."""
    rng = np.random.default_rng(7)
    vocab = references["vocab_size"]
    prompt_lengths = [int(n) for n in rng.integers(1, 12, size=TRAIN_ROWS)]
    response_lengths = [int(n) for n in rng.integers(1, 16, size=TRAIN_ROWS)]
    sequences = [[int(t) for t in rng.integers(0, vocab, size=p + r)] for p, r in zip(prompt_lengths, response_lengths)]
    tokens, lengths = right_padded(sequences)
    token_values = references["critic"].inference.token_scores(tokens, lengths)[..., 0].numpy()
    width = max(response_lengths) + 3  # wider than needed: the server ignores entries past a response
    old_values = np.zeros((TRAIN_ROWS, width), dtype=np.float32)
    returns = rng.normal(0.0, 1.0, size=(TRAIN_ROWS, width)).astype(np.float32)
    for row, (prompt, response) in enumerate(zip(prompt_lengths, response_lengths)):
        old_values[row, :response] = token_values[row, prompt - 1:prompt - 1 + response]
        returns[row, :response] = old_values[row, :response] + rng.normal(0.0, 0.5, size=response)
    return {"sequences": sequences, "prompt_lengths": prompt_lengths, "response_lengths": response_lengths,
            "returns": returns, "old_values": old_values}


# ------------------------------------------------------------------------------------------
# config


def test_shipped_yaml_has_every_schema_key_and_validates():
    from omegaconf import OmegaConf

    from servers.critic import CriticServerConfig

    schema = dotted_keys(OmegaConf.structured(CriticServerConfig))
    assert schema - dotted_keys(OmegaConf.load(CRITIC_YAML)) == set(), "keys missing from the yaml"
    cfg = load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/ckpt"])
    cfg.validate()
    assert cfg.model_names() == ["critic_infer", "critic_train", "critic_save", "critic_restore"]
    assert not cfg.combined.enabled
    with pytest.raises(ConfigError, match="critic.init_from"):
        load_config(CriticServerConfig, CRITIC_YAML, [])
    with pytest.raises(ConfigError, match="train.epochs"):
        load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/c", "train.epochs=2"])
    refused_at_load = {"train.clip_val=0": "train.clip_val=0.0: must be > 0",
                       "train.micro_batch_size=5":
                           "train.global_batch_size=64: must be a multiple of train.micro_batch_size=5",
                       "train.epochs_per_call=0": "train.epochs_per_call=0 is out of range: it must be >= 1",
                       "inference.micro_batch_size=0": "inference.micro_batch_size=0 is out of range",
                       "pad_sequence_length_to_multiple=0": "pad_sequence_length_to_multiple=0 is out of range",
                       "precision=fp16": "precision='fp16' is not one of auto, fp32",
                       "optim.decay_style=cos": "optim.decay_style='cos' is not one of"}
    for override, message in refused_at_load.items():
        with pytest.raises(ConfigError, match=message):
            load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/c", override])
    refused_by_validate = {"server.train_model_name=critic_infer": "model names must differ",
                           "server.max_train_rows=8":
                               "server.max_train_rows \\(8\\) must be at least train.global_batch_size",
                           "parallel.sequence_parallel=true": "sequence parallelism"}
    for override, message in refused_by_validate.items():
        with pytest.raises(ConfigError, match=message):
            load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/c", override]).validate()
    with pytest.raises(ConfigError, match="data-parallel size = 4 x 4"):
        load_config(CriticServerConfig, CRITIC_YAML,
                    ["critic.init_from=/c", "train.global_batch_size=8"]).validate_layout(4)


def test_combined_mode_is_one_setting_and_the_old_spelling_still_loads(tmp_path, capsys):
    """Setting the reward model's checkpoint is combined mode; the old keys load under the new names
    (from a yaml and from the command line) with a deprecation line each."""
    from servers.critic import CriticServerConfig

    cfg = load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/c", "combined.reward_model_init_from=/rm"])
    cfg.validate()
    assert cfg.combined.enabled and cfg.combined.reward_model_init_from == "/rm" and cfg.combined.normalize_rewards
    assert "deprecated" not in capsys.readouterr().err
    old_command_line = ["critic.init_from=/c", "combine_rm_and_critic=true", "reward_model_file=/rm",
                        "normalize_rewards=false"]
    cfg = load_config(CriticServerConfig, CRITIC_YAML, old_command_line)
    assert cfg.combined.reward_model_init_from == "/rm" and cfg.combined.enabled and not cfg.combined.normalize_rewards
    err = capsys.readouterr().err
    assert "sets reward_model_file; it is now combined.reward_model_init_from" in err
    assert "sets normalize_rewards; it is now combined.normalize_rewards" in err
    assert "sets combine_rm_and_critic, which is no longer a setting (combined mode is on exactly when " \
           "combined.reward_model_init_from is set)" in err
    old_yaml = tmp_path / "old_critic.yaml"  # the shipped yaml's combined-mode lines before the rename
    old_yaml.write_text("combine_rm_and_critic: false\nreward_model_file: null\nnormalize_rewards: true\n")
    cfg = load_config(CriticServerConfig, old_yaml, ["critic.init_from=/c"])
    assert not cfg.combined.enabled and cfg.combined.normalize_rewards
    assert f"deprecated: {old_yaml} sets combine_rm_and_critic" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="reward_model_file is the old name of combined.reward_model_init_from"):
        load_config(CriticServerConfig, CRITIC_YAML, ["critic.init_from=/c", "reward_model_file=/a",
                                                      "combined.reward_model_init_from=/b"])


# ------------------------------------------------------------------------------------------
# critic_infer and the combined reward model


def test_ready_line_names_every_model(server):
    assert "critic server ready on http://127.0.0.1:" in server.ready_line
    assert "['critic_infer', 'critic_train', 'critic_save', 'critic_restore', 'reward_model']" in server.ready_line
    assert "critic step 0" in server.ready_line


def test_served_values_equal_in_process_per_token(client, pool):
    sequences, reference, _ = pool
    whole = client.infer(sequences).values  # split by the client at the server's max_batch_size of 16
    assert whole.shape == reference.shape and whole.dtype == np.float32
    differences = [np.abs(whole - reference).max()]
    singles = [client.infer_async([ids]) for ids in sequences]  # merged by Triton as they come
    for row, future in enumerate(singles):
        values = future.result(timeout=120).values
        assert values.shape == (1, len(sequences[row]))
        differences.append(np.abs(values[0] - reference[row, :len(sequences[row])]).max())
    rng = random.Random(1)
    start = 0
    while start < len(sequences):
        end = min(start + rng.randint(1, 7), len(sequences))
        values = client.infer(sequences[start:end]).values
        differences.append(np.abs(values - reference[start:end, :values.shape[1]]).max())
        start = end
    print(f"\nserved vs in-process values: max abs diff {max(differences):.2e}")
    assert max(differences) < 1e-5
    # Zero past each row's end.
    lengths = np.array([len(ids) for ids in sequences])
    assert (whole[np.arange(whole.shape[1])[None, :] >= lengths[:, None]] == 0).all()


def test_combined_rewards_equal_the_reward_model_and_values_survive_the_swap(client, server, pool):
    sequences, reference_values, reference_rewards = pool
    before = client.infer(sequences[:12])
    assert before.rewards is not None and before.rewards.shape == (12,)
    assert np.abs(before.rewards - reference_rewards[:12]).max() < 1e-5
    with RewardClient("127.0.0.1", server.port) as rewards_client:  # the reward-model server's model, unchanged client
        served = rewards_client.infer(sequences[:12])
        assert served.shape == (12, 1)
        assert np.abs(served[:, 0] - reference_rewards[:12]).max() < 1e-5
    after = client.infer(sequences[:12])
    assert np.array_equal(after.values, before.values)  # the critic's weights came back bit for bit
    assert np.abs(after.values - reference_values[:12, :after.values.shape[1]]).max() < 1e-5


BAD_ROWS = {
    "id >= vocab": ([[1, 5, 10_000]], "outside the vocabulary"),
    "negative id": ([[1, -3, 5]], "outside the vocabulary"),
    "empty sequence": ([[]], "empty sequence"),
    "longer than max length": ([[1] * (MAX_LENGTH + 1)], "longer than the model's max_position_embeddings"),
    "one bad row among good ones": ([[1, 2, 3], [4, 10_000], [5, 6]], "rejected 1 of 3 sequences: sequence 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_rows_get_errors_and_the_server_goes_on(client, pool, case):
    sequences, reference, _ = pool
    token_lists, message = BAD_ROWS[case]
    with pytest.raises(CriticServerError, match=message):
        client.infer(token_lists)
    values = client.infer(sequences[2:5]).values
    assert np.abs(values - reference[2:5, :values.shape[1]]).max() < 1e-5


# ------------------------------------------------------------------------------------------
# critic_train


def test_bad_train_requests_are_rejected_without_training(client, rollout):
    args = rollout["sequences"], rollout["prompt_lengths"], rollout["returns"], rollout["old_values"]
    with pytest.raises(CriticServerError, match="not a multiple of train.global_batch_size"):
        client.train(args[0][:6], args[1][:6], args[2][:6], args[3][:6])
    prompts = list(args[1])
    prompts[2] = len(args[0][2])  # no response token left
    with pytest.raises(CriticServerError, match="row 2: prompt_lengths"):
        client.train(args[0], prompts, args[2], args[3])
    returns = args[2].copy()
    returns[4, 0] = np.nan
    with pytest.raises(CriticServerError, match="row 4: returns has a non-finite value"):
        client.train(args[0], args[1], returns, args[3])
    with pytest.raises(CriticServerError, match="has only 1 columns"):
        client.train(args[0], args[1], args[2][:, :1], args[3][:, :1])
    sequences = [list(ids) for ids in args[0]]
    sequences[1][-1] = 10_000
    with pytest.raises(CriticServerError, match="row 1: token id 10000"):
        client.train(sequences, args[1], args[2], args[3])
    with pytest.raises(ValueError, match="loss_mask must be shaped as returns"):
        client.train(*args, loss_mask=np.ones((len(args[0]), 1), dtype=np.float32))


def float64_reference(references, rollout) -> tuple[float, float, float]:
    """(value loss, gradient norm, clip fraction) of the critic's initial weights on the rollout, in float64."""
    from aligner import checkpointing
    from aligner.models.gpt import transformer_config
    from aligner.models.logprobs import response_mask, response_values
    from aligner.models.reward import build_reward_model
    from aligner.rl.shaping import value_loss

    model_cfg = references["critic"].model_cfg
    model = build_reward_model(model_cfg, transformer_config(model_cfg), num_attributes=1)
    checkpointing.load(references["critic_init"], [model])
    model = model.double()
    tokens, lengths = right_padded(rollout["sequences"])
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    token_values = model(tokens, positions, None)[..., 0]  # [B, S] float64
    width = max(rollout["response_lengths"])
    values = response_values(token_values, torch.tensor(rollout["prompt_lengths"]), width)
    mask = response_mask(torch.tensor(rollout["response_lengths"]), width)
    old_values = torch.from_numpy(rollout["old_values"][:, :width]).double()
    returns = torch.from_numpy(rollout["returns"][:, :width]).double()
    loss, stats = value_loss(values, old_values, returns, mask, CLIP_VAL)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(grad_norm), float(stats["clip_fraction"])


def test_first_train_call_equals_the_float64_reference(client, references, rollout):
    from aligner.models.logprobs import response_mask
    from aligner.rl.masked import explained_variance

    loss, grad_norm, clip_fraction = float64_reference(references, rollout)
    metrics = client.train(rollout["sequences"], rollout["prompt_lengths"], rollout["returns"], rollout["old_values"])
    print(f"\nfirst call: served loss {metrics['value_loss']:.7f} vs float64 {loss:.7f}; "
          f"grad norm {metrics['grad_norm']:.6f} vs {grad_norm:.6f}")
    assert metrics["value_loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert metrics["clip_fraction"] == pytest.approx(clip_fraction, abs=1e-6)
    mask = response_mask(torch.tensor(rollout["response_lengths"]), rollout["returns"].shape[1])
    expected_ev = explained_variance(torch.from_numpy(rollout["old_values"]).double(),
                                     torch.from_numpy(rollout["returns"]).double(), mask)
    assert metrics["explained_variance"] == pytest.approx(float(expected_ev), abs=1e-6)
    assert metrics["lr"] == pytest.approx(LR) and metrics["critic_step"] == 1.0


def _served_mse(client, rollout) -> float:
    values = client.infer(rollout["sequences"]).values
    errors = [values[row, prompt - 1 + j] - rollout["returns"][row, j]
              for row, (prompt, response) in enumerate(zip(rollout["prompt_lengths"], rollout["response_lengths"]))
              for j in range(response)]
    return float(np.mean(np.square(errors)))


def test_training_lowers_the_value_loss(client, rollout):
    """Learning happens: over a few calls on the same batch both the reported loss and the served
    values' squared error to the returns fall (the first call happened in the test above)."""
    args = rollout["sequences"], rollout["prompt_lengths"], rollout["returns"], rollout["old_values"]
    mse_before = _served_mse(client, rollout)
    losses = [client.train(*args)["value_loss"] for _ in range(TRAIN_CALLS)]
    mse_after = _served_mse(client, rollout)
    print(f"\nvalue loss over calls 2..{TRAIN_CALLS + 1}: {[round(x, 4) for x in losses]}; "
          f"served MSE {mse_before:.4f} -> {mse_after:.4f}")
    assert losses[-1] < 0.8 * losses[0]
    assert mse_after < 0.8 * mse_before


def test_inference_during_training_sees_whole_updates(client, rollout):
    """An inference sent while a train call runs waits for it: it sees the weights before or after
    the update, never a mix, and the train call is not disturbed."""
    args = rollout["sequences"], rollout["prompt_lengths"], rollout["returns"], rollout["old_values"]
    before = client.infer(rollout["sequences"]).values
    training = client.train_async(*args)
    during = [client.infer_async(rollout["sequences"]) for _ in range(4)]
    metrics = training.result(timeout=120)
    after = client.infer(rollout["sequences"]).values
    assert not np.array_equal(before, after)
    for future in during:
        seen = future.result(timeout=120).values
        assert np.array_equal(seen, before) or np.array_equal(seen, after)
    assert metrics["critic_step"] == TRAIN_CALLS + 2


# ------------------------------------------------------------------------------------------
# critic_save and resuming


def test_save_keeps_the_newest_and_a_restart_resumes(client, server, references, rollout):
    save_dir = references["root"] / "critic_checkpoints"
    paths = [client.save(step) for step in (3, 10, 12)]
    assert paths[-1] == str(save_dir / "step_00000012")
    # keep_last=2, beside the server's lock of its save_dir (aligner/runtime/run_lock.py)
    assert sorted(path.name for path in save_dir.iterdir()) == [".aligner.lock", "step_00000010", "step_00000012"]
    meta = json.loads((save_dir / "step_00000012" / "aligner_meta.json").read_text())
    assert meta["trainer_state"]["critic_step"] == TRAIN_CALLS + 2 and meta["trainer_state"]["caller_step"] == 12
    saved_values = client.infer(rollout["sequences"]).values
    # critic_restore: a critic that trained past its checkpoint of step 12 is put back to it (what a resumed
    # actor asks for); a step with no checkpoint left is answered with one line, and the server keeps serving.
    trained = client.train(rollout["sequences"], rollout["prompt_lengths"], rollout["returns"], rollout["old_values"])
    assert trained["critic_step"] == TRAIN_CALLS + 3
    assert not np.array_equal(client.infer(rollout["sequences"]).values, saved_values)
    assert client.restore(12) == str(save_dir / "step_00000012")
    assert np.array_equal(client.infer(rollout["sequences"]).values, saved_values)
    with pytest.raises(CriticServerError) as raised:
        client.restore(3)
    assert str(raised.value) == (
        f"the critic server rejected the request: the critic's checkpoint.save_dir={save_dir} holds no checkpoint "
        "of step 3 (it holds steps 10, 12): the actor resumed from its step 3 and its critic must be the one saved "
        "with it; keep checkpoint.keep_last of the critic at 2 or more (its checkpoint of a step is written just "
        "before the actor's)")
    assert np.array_equal(client.infer(rollout["sequences"]).values, saved_values)
    code, _ = server.stop(signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, server.log()[-4000:]  # the shell convention for a stop by SIGTERM

    # Without combined mode this time: the resumed critic does not depend on it.
    restarted = start_server(references, "restarted.log")
    try:
        assert f"critic step {TRAIN_CALLS + 2}" in restarted.ready_line
        with CriticClient("127.0.0.1", restarted.port, train_timeout_s=120) as resumed:
            assert np.array_equal(resumed.infer(rollout["sequences"]).values, saved_values)
            assert resumed.infer(rollout["sequences"][:2]).rewards is None
            metrics = resumed.train(rollout["sequences"], rollout["prompt_lengths"], rollout["returns"],
                                    rollout["old_values"])
            assert metrics["critic_step"] == TRAIN_CALLS + 3
    finally:
        restarted.stop(signal.SIGTERM)


def test_unreachable_server_names_the_critic_and_how_to_start_it():
    port = free_port_block(1)
    with CriticClient("127.0.0.1", port, ready_timeout_s=1, timeout_s=2) as unreachable:
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError) as raised:
            unreachable.infer([[1, 2, 3]])
        assert time.monotonic() - start < 4.0
    message = str(raised.value)
    assert f"no critic server is ready at 127.0.0.1:{port}" in message
    assert "serve_ppo_critic.py critic.init_from=" in message and f"server.port={port}" in message
