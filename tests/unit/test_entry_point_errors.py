"""User errors at every entry point end with exactly one `error: ...` line naming the file or key, exit 2.

Config value checks run in this process; the entry points run in subprocesses, so what prints
the line is run_main, reached through each script's `if __name__ == "__main__"`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from aligner.algorithms.rl_config import RLActorConfig
from aligner.algorithms.sft import SFTConfig
from aligner.algorithms.spin import SPINConfig
from aligner.config import CONF_DIR, ConfigError, load_config
from aligner.models.gpt import GPTConfig
from servers.critic import CriticServerConfig

from ..conftest import REPO_ROOT, free_port_block, write_jsonl, write_model_meta

SFT_REQUIRED = ["data.train=[{path: x.jsonl}]"]
GPT = REPO_ROOT / "examples" / "nlp" / "gpt"
DATA = REPO_ROOT / "examples" / "nlp" / "data"


@pytest.mark.parametrize("schema, yaml_name, required, override, message", [
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "trainer.max_steps=-5",
     r"trainer.max_steps=-5 is out of range: it must be >= 0"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "trainer.max_epochs=0", r"trainer.max_epochs=0 .* >= 1"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "trainer.global_batch_size=0", r"trainer.global_batch_size=0 .* >= 1"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "trainer.micro_batch_size=-4", r"trainer.micro_batch_size=-4 .* >= 1"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "checkpoint.keep_last=-1",
     r"checkpoint.keep_last=-1 .* >= 0 \(0: keep all\)"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "checkpoint.save_interval=-10",
     r"checkpoint.save_interval=-10 .* \(0: only at the end\)"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "optim.warmup_steps=-1", r"optim.warmup_steps=-1"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "optim.lr=-0.1", r"optim.lr=-0.1"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "optim.min_lr=0.5", r"optim.min_lr=0.5: the cosine decay ends at min_lr"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "optim.decay_style=cos", r"optim.decay_style='cos' is not one of cosine"),
    (SFTConfig, "gpt_sft.yaml", SFT_REQUIRED, "logging.log_interval=0", r"logging.log_interval=0"),
    (RLActorConfig, "gpt_ppo_actor.yaml", ["model.init_from=x", "data.prompts=p.jsonl"], "loss.epochs=0",
     r"loss.epochs=0"),
    (RLActorConfig, "gpt_ppo_actor.yaml", ["model.init_from=x", "data.prompts=p.jsonl"], "trainer.max_steps=-1",
     r"trainer.max_steps=-1"),
    (SPINConfig, "gpt_spin.yaml", ["data.train=[{path: x.jsonl}]", "model.init_from=x"], "spin.steps_per_iteration=0",
     r"spin.steps_per_iteration=0"),
    (CriticServerConfig, "gpt_ppo_critic.yaml", ["critic.init_from=x"], "checkpoint.keep_last=-2",
     r"checkpoint.keep_last=-2"),
])
def test_values_that_make_no_sense_are_refused_at_load_with_the_key(schema, yaml_name, required, override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(schema, CONF_DIR / yaml_name, [*required, override])


def test_edge_values_that_mean_something_load():
    """0 steps (save the initial weights), keep_last 0 (keep all), save_interval 0 (only at the end)."""
    cfg = load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*SFT_REQUIRED, "trainer.max_steps=0",
                                                           "checkpoint.keep_last=0", "checkpoint.save_interval=0",
                                                           "optim.decay_style=constant", "optim.min_lr=1.0"])
    assert cfg.trainer.max_steps == 0 and cfg.checkpoint.keep_last == 0


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrainer:\n  max_steps: [1,\n  micro_batch_size: 2\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:\d+: invalid YAML: .*flow sequence from line 3"):
        load_config(SFTConfig, bad)
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("trainer:\n\tmax_steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{tabs}:2: invalid YAML"):
        load_config(SFTConfig, tabs)
    with pytest.raises(ConfigError, match=r"override 'trainer.max_steps=\[1,': the value is not valid YAML"):
        load_config(SFTConfig, CONF_DIR / "gpt_sft.yaml", [*SFT_REQUIRED, "trainer.max_steps=[1,"])


# ----------------------------------------------------------------------------- entry points as subprocesses
def _damaged_tokenizer(source: Path, target: Path, name: str) -> Path:
    """A copy of a tokenizer directory with `name` cut in half (as a crash or full disk leaves it)."""
    shutil.copytree(source, target)
    text = (target / name).read_text()
    (target / name).write_text(text[: len(text) // 2])
    return target


def _sft_cases(root: Path, tokenizer_dir: Path) -> list[tuple[str, list, str]]:
    """(name, train_gpt_sft.py arguments, the one stderr line's expected start)."""
    a_file = root / "a_file"
    a_file.write_text("not a directory")
    bad_yaml = root / "bad.yaml"
    bad_yaml.write_text("trainer:\n  max_steps: [1,\n")
    dict_for_list = root / "dict_for_list.yaml"  # data.train is a list of entries
    dict_for_list.write_text("data:\n  train:\n    path: x.jsonl\n")
    unset_variable = root / "unset_variable.yaml"
    unset_variable.write_text("data:\n  train:\n    - path: ${oc.env:ALIGNER_TEST_UNSET_VARIABLE}\n")
    bad_tokenizer = _damaged_tokenizer(tokenizer_dir, root / "bad_tokenizer", "tokenizer.json")
    bad_tokenizer_config = _damaged_tokenizer(tokenizer_dir, root / "bad_tokenizer_config", "tokenizer_config.json")
    checkpoint = write_model_meta(root / "checkpoint", GPTConfig.gpt2(max_position_embeddings=128, vocab_size=32),
                                  _damaged_tokenizer(tokenizer_dir, root / "damaged", "tokenizer.json"))
    interrupted_run = root / "run"  # a run directory with only a partial save
    (interrupted_run / "step_00000002.incomplete").mkdir(parents=True)
    hf_model = root / "hf_model"  # an HF model directory of an architecture the import refuses
    shutil.copytree(tokenizer_dir, hf_model)
    (hf_model / "config.json").write_text('{"model_type": "bert"}')
    short = write_model_meta(root / "short", GPTConfig.gpt2(max_position_embeddings=128, vocab_size=32),
                             tokenizer_dir)  # GPT-2's 128 learned positions (tests/unit/test_sequence_lengths.py)
    data = write_jsonl(root / "x.jsonl", [{"input": "1+1=", "output": "2"}])  # checked before the rest
    sft = [f"data.train=[{{path: {data}}}]", f"logging.log_dir={root / 'logs'}"]
    return [
        ("max_steps", [*sft, "trainer.max_steps=-5"], "error: trainer.max_steps=-5 is out of range"),
        ("yaml", [*sft, "--config", bad_yaml], f"error: {bad_yaml}:3: invalid YAML"),
        ("config type", [sft[1], "--config", dict_for_list],
         f"error: {dict_for_list}:2: key 'data.train' is a mapping (key: value); expected a list"),
        ("config variable", [sft[1], "--config", unset_variable],
         f"error: {unset_variable}:3: key 'data.train[0].path': "),
        ("init_from", [*sft, "model.init_from=/nonexistent"], "error: model.init_from=/nonexistent does not exist"),
        ("tokenizer.json", [*sft, f"tokenizer.path={bad_tokenizer}"], f"error: {bad_tokenizer / 'tokenizer.json'}:"),
        ("tokenizer_config.json", [*sft, f"tokenizer.path={bad_tokenizer_config}"],
         f"error: {bad_tokenizer_config / 'tokenizer_config.json'}:"),
        ("checkpoint tokenizer", [*sft, f"model.init_from={checkpoint}"],  # an init_from whose tokenizer is damaged
         f"error: {checkpoint / 'tokenizer' / 'tokenizer.json'}:"),
        ("run dir without a checkpoint", [*sft, f"model.init_from={interrupted_run}"],
         f"error: model.init_from={interrupted_run} holds no complete checkpoint (only step_00000002.incomplete"),
        ("HF dir as init_from", [*sft, f"model.init_from={hf_model}"],
         f"error: model.init_from={hf_model}: {hf_model / 'config.json'}: model_type='bert' is not supported"),
        ("positions", [*sft, f"model.init_from={short}", "data.max_seq_length=512"],
         f"error: data.max_seq_length=512 (511 positions, the last token a label) is above "
         f"{short / 'aligner_meta.json'}'s model.max_position_embeddings=128"),
        ("log_dir", [sft[0], f"logging.log_dir={a_file / 'logs'}", "model.init_from=/nonexistent"],
         f"error: logging.log_dir={a_file / 'logs'} is not writable"),
        # A model that would build: the missing file is found first (test_data_formats.py: it is not built).
        ("missing data", [f"data.train=[{{path: {root / 'missing.jsonl'}}}]", sft[1],
                          f"tokenizer.path={tokenizer_dir}"],
         f"error: data.train[0].path: {root / 'missing.jsonl'}: cannot open data file (No such file or directory)"),
        ("missing validation data", [*sft, f"data.validation={root / 'missing.parquet'}",
                                     f"tokenizer.path={tokenizer_dir}"],
         f"error: data.validation[0].path: {root / 'missing.parquet'}: no such file"),
        ("data columns", [f"data.train={write_jsonl(root / 'pairs.jsonl', [{'prompt': 'a', 'chosen': 'b'}])}", sft[1],
                          f"tokenizer.path={tokenizer_dir}"],
         f"error: data.train[0].path: {root / 'pairs.jsonl'}: no 'input'/'output' or 'conversations' or 'messages' or "
         "'prompt'/'completion' columns for SFT data (columns: 'prompt', 'chosen')"),
    ]


# The SFT entry point's main through run_main once per case in one interpreter (a process per case
# costs seconds); the `if __name__` wiring of each script is the next test.
_RUN_SFT_CASES = """
import contextlib, io, json, sys
from aligner.algorithms.sft import SFTConfig, build_sft_trainer
from aligner.config import run_main
from aligner.training.run import run_training
results = []
for args in json.loads(sys.argv[1]):
    sys.argv = ["train_gpt_sft.py", *args]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            run_main(lambda: run_training(SFTConfig, "gpt_sft.yaml", build_sft_trainer))
            status = 0
        except SystemExit as exit:
            status = exit.code
    results.append([status, stderr.getvalue()])
print("RESULTS " + json.dumps(results))
"""


def _environment() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _check_one_error_line(name: str, status: int, stderr: str, expected: str) -> str:
    """'' if the outcome is exit 2 with exactly one `error:` line starting with `expected`, else what went wrong."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if status != 2 or len(errors) != 1 or not errors[0].startswith(expected) or "Traceback" in stderr:
        return f"{name}: exit {status}, expected {expected!r}\n{stderr[-3000:]}"
    return ""


def test_training_entry_point_user_errors_are_one_line(tmp_path, arithmetic_tokenizer_dir):
    root = tmp_path / "cases"
    root.mkdir()
    cases = _sft_cases(root, arithmetic_tokenizer_dir)
    result = subprocess.run([sys.executable, "-c", _RUN_SFT_CASES, json.dumps([[str(a) for a in args]
                                                                            for _, args, _ in cases])],
                            capture_output=True, text=True, timeout=300, env=_environment(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    outcomes = json.loads(result.stdout.split("RESULTS ", 1)[1])
    failures = [_check_one_error_line(name, status, stderr, expected)
                for (name, _, expected), (status, stderr) in zip(cases, outcomes)]
    assert not any(failures), "\n\n".join(failures)
    # Refused before anything was built or written: no checkpoint directory, no metrics.
    assert not (tmp_path / "results").exists() and not list(root.glob("**/metrics.jsonl"))


def _script_cases(root: Path) -> list[tuple[str, list, str]]:
    """(name, command, the one stderr line's expected start): one case per entry-point script."""
    python = sys.executable
    a_file = root / "a_file"
    a_file.write_text("not a directory")
    malformed = root / "jsonl"
    malformed.mkdir()
    (malformed / "data.jsonl").write_text('{"input": "1+1=", "output": "2"}\n{"input": "2+2=" "output"}\n')
    free = str(free_port_block())
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": "1+1="}])  # data files are checked first
    sft_data = write_jsonl(root / "sft.jsonl", [{"input": "1+1=", "output": "2"}])
    return [
        ("sft", [python, GPT / "train_gpt_sft.py", "data.train=[{path: x.jsonl}]", "trainer.max_steps=-5"],
         "error: trainer.max_steps=-5 is out of range"),
        ("ppo", [python, GPT / "train_gpt_ppo_actor.py", "model.init_from=/nonexistent", f"data.prompts={prompts}",
                 f"logging.log_dir={root / 'ppo_logs'}"], "error: model.init_from=/nonexistent does not exist"),
        ("reinforce algorithm=ppo", [python, GPT / "train_gpt_reinforce_actor.py", "model.init_from=/nonexistent",
                                     "data.prompts=p.jsonl", "algorithm=ppo", f"logging.log_dir={root / 'rl_logs'}"],
         "error: algorithm='ppo': PPO trains a critic alongside the actor: use "
         "examples/nlp/gpt/train_gpt_ppo_actor.py"),
        ("reward server", [python, GPT / "serve_reward_model.py", "init_from=/nonexistent", f"server.port={free}"],
         "error: init_from=/nonexistent does not exist"),
        ("critic server", [python, GPT / "serve_ppo_critic.py", "critic.init_from=/nonexistent", f"server.port={free}"],
         "error: critic.init_from=/nonexistent does not exist"),
        ("launch_ppo", [python, GPT / "launch_ppo.py", "--reward-checkpoint", "/nonexistent",
                        "--log-dir", root / "launch"],
         "error: --reward-checkpoint=/nonexistent does not exist"),
        ("chat", [python, GPT / "chat.py", "init_from=/nonexistent"],
         "error: init_from=/nonexistent does not exist"),
        ("make_data", [python, DATA / "arithmetic" / "make_data.py", "--out-dir", a_file / "data", "--num-sft", "10"],
         f"error: {a_file / 'data' / 'sft_train.jsonl'}: cannot write it"),
        ("train_tokenizer", [python, DATA / "arithmetic" / "train_tokenizer.py", "--data-dir", malformed, "--out-dir",
                             root / "tok"], f"error: {malformed / 'data.jsonl'}:2: invalid JSON"),
        ("annotate", [python, DATA / "steerlm" / "annotate.py", "--input", root / "missing.jsonl", "--output",
                      root / "out.jsonl", "--attributes", "correctness"],
         f"error: {root / 'missing.jsonl'}: cannot open"),
        ("evaluate", [python, "-m", "aligner.demo.evaluate", "--checkpoint", root / "nope", "--prompts",
                      prompts],
         f"error: {root / 'nope'} is not an aligner"),
        ("run_demo", [python, REPO_ROOT / "examples" / "demo" / "run_demo.py", "--workdir", root / "demo",
                      "--stages", "dpo"],
         f"error: no checkpoint under {root / 'demo' / 'sft' / 'checkpoints'}: run the 'sft' stage first"),
        ("rejection sampling", [python, GPT / "train_gpt_rs.py", "model.init_from=/x", f"data.prompts={prompts}",
                                "reward.function=m:f", "rs.keep=threshold", f"logging.log_dir={root / 'rs_logs'}"],
         "error: rs.keep=threshold keeps every answer scoring at least rs.min_score: set rs.min_score"),
        ("teacher top-k", [python, DATA / "compute_teacher_topk.py", "teacher=/nonexistent", "data.path=x.jsonl",
                           f"output={root / 'x.topk'}"], "error: teacher=/nonexistent does not exist"),
        ("distillation", [python, GPT / "train_gpt_knowledge_distillation.py", "kd.kd_loss_weight=0",
                          f"data.train=[{{path: {sft_data}, teacher_topk: x.topk}}]",
                          f"logging.log_dir={root / 'kd_logs'}"],
         "error: kd.kd_loss_weight=0.0 and kd.sft_loss_weight=0.0: both must be >= 0 and one > 0"),
        ("hf", [python, "-m", "aligner.hf", "import", "--hf-dir", root / "nope", "--output", root / "imported"],
         f"error: HF model directory {root / 'nope'} does not exist"),
    ]


@pytest.mark.slow
def test_every_entry_point_script_ends_a_user_error_with_one_line(tmp_path):
    root = tmp_path / "cases"
    root.mkdir()
    running = [(name, subprocess.Popen([str(part) for part in command], cwd=tmp_path, env=_environment(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE), expected)
               for name, command, expected in _script_cases(root)]
    failures = []
    for name, process, expected in running:  # all run at once: the wall time of the slowest
        try:
            _, stderr = process.communicate(timeout=240)
        finally:
            process.kill()
        failures.append(_check_one_error_line(name, process.returncode, stderr, expected))
    assert not any(failures), "\n\n".join(failures)
    assert not (tmp_path / "results").exists()


def test_read_json_names_file_and_line(tmp_path):
    from aligner.runtime.errors import DataError
    from aligner.runtime.files import read_json

    path = tmp_path / "meta.json"
    path.write_text('{\n  "format": "x",\n  "model": nope\n}\n')
    with pytest.raises(DataError, match=rf"^{path}:3: not valid JSON \(Expecting value at column 12\)$"):
        read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(DataError, match=rf"^{path}: not valid JSON \(not UTF-8"):
        read_json(path)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'missing.json'}: cannot read it"):
        read_json(tmp_path / "missing.json")
    path.write_text(json.dumps({"a": [1, 2]}))
    assert read_json(path) == {"a": [1, 2]}


# ----------------------------------------------------------------------------- user errors vs bugs in run_main
_RAISE_IN_RUN_MAIN = """
import contextlib, io, json, sys
from aligner.checkpointing import CheckpointError
from aligner.clients import ClientError, ServerUnavailableError
from aligner.config import ConfigError, MissingExtraError, OutputError, run_main
from aligner.data.jsonl import DataError
from aligner.launcher import LaunchError
from aligner.runtime.errors import UserError
types = {kind.__name__: kind for kind in (ConfigError, DataError, CheckpointError, OutputError, MissingExtraError,
                                          LaunchError, ClientError, ServerUnavailableError, UserError)}
results = {}
for name, kind in types.items():
    def main():
        raise kind(f"what the user must fix ({name})")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            run_main(main)
            status = 0
        except SystemExit as exit:
            status = exit.code
    results[name] = [status, stderr.getvalue()]
print("RESULTS " + json.dumps(results))
"""


def test_each_user_error_type_ends_with_one_line_and_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-c", _RAISE_IN_RUN_MAIN], capture_output=True, text=True, timeout=120,
                            env=_environment(), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    outcomes = json.loads(result.stdout.split("RESULTS ", 1)[1])
    assert len(outcomes) == 9
    failures = [_check_one_error_line(name, status, stderr, f"error: what the user must fix ({name})")
                for name, (status, stderr) in outcomes.items()]
    assert not any(failures), "\n\n".join(failures)
    assert all(stderr.strip().count("\n") == 0 for _, stderr in outcomes.values())


@pytest.mark.parametrize("internal", ["ValueError", "RuntimeError", "KeyError", "FileNotFoundError", "AssertionError"])
def test_an_internal_error_inside_run_main_keeps_its_traceback(tmp_path, internal):
    """A bug (an invariant that failed) is not a user error: Python's traceback, exit 1, no 'error:' line."""
    script = ("from aligner.config import run_main\n"
              "def check_shapes():\n"
              f"    raise {internal}('rows 3 != columns 4')\n"
              "run_main(check_shapes)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=_environment(), cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-4000:]
    assert "Traceback (most recent call last)" in result.stderr and "in check_shapes" in result.stderr
    assert f"{internal}: " in result.stderr.splitlines()[-1] and "rows 3 != columns 4" in result.stderr
    assert not any(line.startswith("error:") for line in result.stderr.splitlines())
