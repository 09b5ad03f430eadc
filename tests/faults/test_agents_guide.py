"""The environment of docs/guides/agents.md, as printed there, runs in the sandbox through the episode runner."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from aligner.agents.environment import SandboxedEnvironment
from aligner.agents.renderer import ChatRenderer
from aligner.agents.rollout import EpisodeLimits, EpisodeRunner
from aligner.generation.engine import SamplingParams
from aligner.runtime.sandbox import SandboxLimits, SandboxPool
from tests.chat_tokenizers import build_chat_tokenizer
from tests.unit.test_agent_rollout import ScriptedModel

pytestmark = pytest.mark.faults
GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "agents.md"


def counting_model(mistake_at=None):
    def reply(text):
        start = int(re.search(r"Count down from (\d+)", text).group(1))
        said = len(re.findall(r"<\|im_start\|>assistant\n", text)) - 1  # replies so far
        number = start - said
        return "7" if number == mistake_at else str(number)
    return reply


def test_the_guides_environment_runs_as_printed(tmp_path, monkeypatch):
    code = re.search(r"```python\n(# countdown\.py.*?)```", GUIDE.read_text(), flags=re.DOTALL).group(1)
    assert len(code.strip().splitlines()) < 30
    (tmp_path / "countdown.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    tokenizer = build_chat_tokenizer(tmp_path / "tokenizer", "smollm2")
    with SandboxPool(workers=2, limits=SandboxLimits(timeout_s=10)) as pool:
        for model, reward, status in ((counting_model(), 1.0, "done"), (counting_model(mistake_at=2), -1.0, "done")):
            runner = EpisodeRunner(ScriptedModel(tokenizer, model), lambda tools: ChatRenderer(tokenizer, tools=tools),
                                   lambda: SandboxedEnvironment(pool, "countdown.py:Countdown", {"penalty": -1.0}),
                                   SamplingParams(max_new_tokens=4), EpisodeLimits(max_turns=8))
            batch = runner.run([{"start": 3}], ["prompts.jsonl:1"])
            episode = batch.episodes[0]
            assert (episode.status, episode.reward) == (status, reward)
            assert episode.model_turns == (3 if reward == 1.0 else 2)
            assert sum(episode.loss_mask) == episode.count("model") and batch.metrics()["episodes/done"] == 1.0
