"""A user's first hour, as README's walkthrough ("Your model, your data: the first hour") writes it.

The commands are read from README (between the `first-hour` markers) and run as written, one by one, in a
working directory that looks like the repository root to them (`examples` and `conf` linked in) and holds
what a user brings: the real model as an HF directory (SmolLM2-135M-Instruct, written by `transformers`
from the pinned GGUF), `questions.jsonl`, `sft.parquet` (TRL's `messages` column), `pairs` (a `datasets`
directory with TRL's prompt/chosen/rejected conversations), `prompts.jsonl` (a prompt and an `answer`
column) and `myreward.py` reading that column. Only the run sizes are cut for CI: CI_SIZE's overrides are
appended to each command. Then: each stage trained what it should, a re-run says there is nothing to
train, and the exports load the way users load them, the full export equal to the trained checkpoint.
"""
from __future__ import annotations

import json
import math
import re
import shlex

import pytest
import torch

from ..conftest import REPO_ROOT, metrics_rows, write_jsonl
from ..gguf_files import aligner_logits
from .conftest import run_python
from .test_recipes import PEFT_RELATIVE_TOLERANCE

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

README = REPO_ROOT / "README.md"
SMALL_RUN = ["trainer.global_batch_size=2", "trainer.micro_batch_size=2", "trainer.val_check_interval=0",
             "logging.progress_bar=false", "logging.peak_tflops=1.0"]
# What CI appends to each README command (by the script it runs): the sizes, nothing else.
CI_SIZE = {
    "chat.py": ["sampling.max_new_tokens=12"],
    "train_gpt_sft.py": [*SMALL_RUN, "trainer.max_steps=2", "data.max_seq_length=96", "data.split='100,0'"],
    "train_gpt_dpo.py": [*SMALL_RUN, "trainer.max_steps=2", "data.max_seq_length=64", "data.split='100,0'"],
    "train_gpt_reinforce_actor.py": ["trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                                     "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                                     "generation.max_new_tokens=16", "generation.micro_batch_size=4",
                                     "data.max_prompt_length=96", "logging.progress_bar=false",
                                     "logging.peak_tflops=1.0"],
}
SFT_MESSAGES = [
    [{"role": "user", "content": "What is the colour of a ripe banana?"},
     {"role": "assistant", "content": "A ripe banana is yellow."}],
    [{"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": "A spider has eight legs."}],
]
PAIRS = {  # TRL's conversational preference columns
    "prompt": [[{"role": "user", "content": "What colour is a clear sky?"}],
               [{"role": "user", "content": "Is fire hot or cold?"}]],
    "chosen": [[{"role": "assistant", "content": "The sky is blue."}],
               [{"role": "assistant", "content": "Fire is hot."}]],
    "rejected": [[{"role": "assistant", "content": "The sky is green."}],
                 [{"role": "assistant", "content": "Fire is cold."}]],
}
PROMPTS = [{"prompt": "What is 2+3? Answer with the number only.", "answer": "5"},
           {"prompt": "What is 4+4? Answer with the number only.", "answer": "8"}]
REWARD_FILE = '''
def correct(prompt, response, answer):
    return float(answer in response)
'''


def readme_commands() -> list[list[str]]:
    """The walkthrough's commands (continuation lines joined, comments dropped, $NAME set by its `NAME=...`)."""
    block = re.search(r"<!-- first-hour:begin.*?-->\s*```bash\n(.*?)```\s*<!-- first-hour:end -->", README.read_text(),
                      re.S)
    assert block, f"{README} has no first-hour block"
    variables, commands = {}, []
    for line in block.group(1).replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 1 and re.fullmatch(r"[A-Z_]+=\S+", words[0]):
            name, value = words[0].split("=", 1)
            variables[name] = value
        elif words:
            commands.append([re.sub(r"\$(\w+)", lambda match: variables[match.group(1)], word) for word in words])
    return commands


@pytest.fixture(scope="module")
def smollm2_hf_dir(smollm2_reference, tmp_path_factory):
    """The real model as users download it: an HF directory written by transformers."""
    _, tokenizer, model, _ = smollm2_reference
    directory = tmp_path_factory.mktemp("hub") / "SmolLM2-135M-Instruct"
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def workdir(smollm2_hf_dir, tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    work = tmp_path_factory.mktemp("first_hour")
    for name in ("examples", "conf", "aligner/conf"):  # the README's paths (aligner/conf/recipes/...)
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).symlink_to(REPO_ROOT / name)
    (work / "SmolLM2-135M-Instruct").symlink_to(smollm2_hf_dir)
    write_jsonl(work / "questions.jsonl", [{"prompt": "What is the capital of France?"}])
    pq.write_table(pa.table({"messages": SFT_MESSAGES}), work / "sft.parquet")
    datasets.Dataset.from_dict(PAIRS).save_to_disk(str(work / "pairs"))
    write_jsonl(work / "prompts.jsonl", PROMPTS)
    (work / "myreward.py").write_text(REWARD_FILE)
    return work


def run_command(command: list[str], work) -> str:
    """A README command in `work` with CI_SIZE's overrides appended; its output (stdout, then stderr)."""
    script = next((word.rsplit("/", 1)[-1] for word in command if word.endswith(".py")), None)
    assert command[0] == "python", command
    result = run_python(*command[1:], *CI_SIZE.get(script, []), cwd=work, timeout=900)
    print(f"\n[first hour] {' '.join(command)}\n{result.stdout[-1500:]}")
    return result.stdout + result.stderr


def test_the_first_hour_as_readme_writes_it(workdir, smollm2_hf_dir):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aligner.checkpointing import latest_checkpoint

    commands = readme_commands()
    scripts = [next((word for word in command if word.endswith(".py") or word == "aligner.hf"), "")
               for command in commands]
    assert [script.rsplit("/", 1)[-1] for script in scripts] == [
        "chat.py", "train_gpt_sft.py", "train_gpt_dpo.py", "train_gpt_reinforce_actor.py", "aligner.hf", "aligner.hf"]
    chat, sft, dpo, grpo, export, export_peft = commands

    # chat: the HF directory imported once into the cache, a greedy answer written for the question
    out = run_command(chat, workdir)
    assert "imported into the cache" in out
    answers = [json.loads(line) for line in (workdir / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 1 and answers[0]["response"].strip(), answers

    # SFT from the same HF directory (the cached import), Parquet data by the shorthand path
    out = run_command(sft, workdir)
    assert "its import cached at" in out
    rows = metrics_rows(workdir / "results" / "sft", "train")
    assert [row["step"] for row in rows] == [1, 2] and all(math.isfinite(row["loss"]) for row in rows)
    assert "checkpoint: " in out and "next: " in out  # the end-of-run summary
    # the same command again: a finished run trains nothing and says so
    again = run_command(sft, workdir)
    assert "nothing to train" in again
    assert len(metrics_rows(workdir / "results" / "sft", "train")) == 2

    # DPO with LoRA from the SFT run's directory, a datasets directory with TRL's conversational columns
    out = run_command(dpo, workdir)
    assert "results/sft: its latest intact checkpoint step_00000002" in out
    rows = metrics_rows(workdir / "results" / "dpo", "train")
    assert len(rows) == 2 and rows[0]["preference_loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference

    # GRPO from the DPO run (its adapters merged into their base), the reward file reading the answer column
    out = run_command(grpo, workdir)
    assert re.search(r"algorithm=grpo: advantage\.estimator=grpo", out), out[-3000:]
    rows = metrics_rows(workdir / "results" / "grpo", "train")
    assert len(rows) == 1 and 0.0 <= rows[0]["reward_mean"] <= 1.0, rows

    # exports, loaded the way users load them
    run_command(export, workdir)
    run_command(export_peft, workdir)
    tokenizer = AutoTokenizer.from_pretrained(workdir / "my-model")
    tokens = torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                                         add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(workdir / "my-model").eval()(tokens).logits
        adapted = AutoPeftModelForCausalLM.from_pretrained(workdir / "my-adapters").eval()(tokens).logits
    trained = aligner_logits(latest_checkpoint(workdir / "results" / "grpo"), tokens)
    scale = float(trained.abs().max())
    assert float((exported - trained).abs().max()) < 1e-5 * scale  # fp32 export: the checkpoint's weights as they are
    # the PEFT export (adapters unmerged over the HF export of their base) = the DPO run's adapters, live
    dpo_adapters = aligner_logits(latest_checkpoint(workdir / "results" / "dpo"), tokens)
    assert float((adapted - dpo_adapters).abs().max()) < PEFT_RELATIVE_TOLERANCE * float(dpo_adapters.abs().max())
    assert not torch.equal(adapted, exported)
