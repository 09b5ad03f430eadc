"""Rejection sampling: the selection rule, a tiny run (samples written and scored, the best kept and
trained on, the score rising), resuming at an iteration end, and errors that name the key."""
from __future__ import annotations

import json
import math

import pytest

from aligner.algorithms.rejection_sampling import RSConfig, build_rs_run, select
from aligner.config import CONF_DIR, ConfigError, load_config

from ..conftest import metrics_rows, train_tiny_arithmetic_policy

RS_YAML = CONF_DIR / "gpt_rs.yaml"


def starts_with_one(prompt, response_text: str) -> float:
    """A reward the tiny policy meets some of the time and can learn in a few steps."""
    return float(response_text.strip().startswith("1"))


def test_best_keeps_each_prompts_top_eligible_sample_and_threshold_keeps_all_above_the_bar():
    scores = [[0.2, 0.9, 0.9, 0.5], [0.1, 0.3, 0.2, 0.0], [1.0, 0.4, 0.8, 0.7]]
    stopped = [[True, True, True, True], [True, True, True, False], [False, True, True, True]]
    assert select(scores, stopped, "best", None, True) == [
        [False, True, False, False], [False, True, False, False], [False, False, True, False]]  # tie: the first
    assert select(scores, stopped, "best", None, False)[2] == [True, False, False, False]  # cut answers count
    assert select(scores, stopped, "best", 0.5, True)[1] == [False] * 4  # nobody reaches the bar
    assert select(scores, stopped, "threshold", 0.5, True) == [
        [False, True, True, True], [False] * 4, [False, False, True, True]]


def test_settings_that_cannot_work_are_refused_with_the_key_named():
    required = ["data.prompts=p.jsonl", "model.init_from=/x", "reward.function=m:f"]
    for settings, message in ((["rs.keep=threshold"], "rs.keep=threshold keeps every answer scoring at least "
                                                      "rs.min_score: set rs.min_score"),
                              (["reward.function=null"], "reward.source=function needs reward.function"),
                              (["rs.generation.temperature=0"], "rs.generation.temperature must be > 0"),
                              (["rs.keep=worst"], "rs.keep='worst' is not one of best, threshold")):
        with pytest.raises(ConfigError, match=message):
            build_rs_run(load_config(RSConfig, RS_YAML, [*required, *settings]))


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("rs_policy")
    return train_tiny_arithmetic_policy(root, seed=3, num_prompts=128, steps=20)


def _config(tiny_policy, root, *extra) -> RSConfig:
    policy, prompts = tiny_policy
    return load_config(RSConfig, RS_YAML, [
        f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
        "reward.function=tests.unit.test_rejection_sampling:starts_with_one", "rs.num_iterations=3", "rs.min_score=1.0",
        "rs.prompts_per_iteration=64", "rs.samples_per_prompt=4", "rs.epochs_per_iteration=4",
        "rs.generation.max_new_tokens=5", "rs.generation.batch_size=64", "trainer.global_batch_size=16",
        "trainer.micro_batch_size=16", "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay_style=constant",
        f"checkpoint.save_dir={root / 'ckpt'}", f"logging.log_dir={root}", "logging.progress_bar=false",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", "logging.log_interval=100", *extra])


def _samples(root, iteration: int) -> list[dict]:
    path = root / "rejection_sampling" / f"iteration_{iteration:03d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_tiny_run_keeps_the_best_of_n_trains_on_it_and_scores_rise(tiny_policy, tmp_path):
    run = build_rs_run(_config(tiny_policy, tmp_path))
    run.fit()
    run.metrics.close()
    rs_rows = metrics_rows(tmp_path, "rs")
    assert [row["iteration"] for row in rs_rows] == [1, 2, 3]
    for iteration in (1, 2, 3):
        samples = _samples(tmp_path, iteration)
        assert len(samples) == 64 * 4
        by_prompt = {}
        for sample in samples:
            by_prompt.setdefault(json.dumps(sample["prompt"]), []).append(sample)
        assert len(by_prompt) == 64 and all(len(group) == 4 for group in by_prompt.values())
        for group in by_prompt.values():
            kept = [sample for sample in group if sample["kept"]]
            assert len(kept) <= 1
            if kept:  # the best score of the group (a cut answer may score as high, but is not eligible)
                assert kept[0]["score"] == max(sample["score"] for sample in group) or any(
                    sample["score"] > kept[0]["score"] for sample in group)
        row = rs_rows[iteration - 1]
        assert row["kept"] == sum(sample["kept"] for sample in samples)
        assert row["best_of_n_mean"] >= row["score_mean"]
        assert row["score_mean"] == pytest.approx(sum(s["score"] for s in samples) / len(samples), rel=1e-6)
    train_rows = metrics_rows(tmp_path, "train")
    expected_steps = sum(4 * math.floor(row["kept"] / 16) for row in rs_rows)
    assert len(train_rows) == expected_steps and all(math.isfinite(row["loss"]) for row in train_rows)
    print("score per iteration", [round(row["score_mean"], 3) for row in rs_rows])
    assert rs_rows[-1]["score_mean"] > rs_rows[0]["score_mean"] + 0.1  # training on the best answers helps
    assert (tmp_path / "ckpt" / f"step_{len(train_rows):08d}").is_dir()


def test_a_stopped_run_resumes_at_the_next_iteration_and_repeats_the_uninterrupted_one(tiny_policy, tmp_path,
                                                                                        monkeypatch):
    """Also a DP=1 check that the second iteration samples the trained weights: the resumed run builds its
    engine afresh, the uninterrupted one reuses its engine over the updated weights."""
    import aligner.algorithms.rejection_sampling as rs_module

    # iteration 1 keeps fewer samples than a global batch (no step), iteration 2 enough for one per epoch
    settings = ("rs.num_iterations=2", "trainer.global_batch_size=20", "trainer.micro_batch_size=4")
    whole = build_rs_run(_config(tiny_policy, tmp_path / "whole", *settings))
    whole.fit()
    whole.metrics.close()

    real = rs_module.RejectionSamplingRun.sample_and_score

    def crash_at_second_iteration(self, iteration):
        if iteration == 1:
            raise RuntimeError("simulated crash")
        return real(self, iteration)

    monkeypatch.setattr(rs_module.RejectionSamplingRun, "sample_and_score", crash_at_second_iteration)
    first = build_rs_run(_config(tiny_policy, tmp_path / "stopped", *settings))
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit()
    first.metrics.close()
    monkeypatch.setattr(rs_module.RejectionSamplingRun, "sample_and_score", real)
    resumed = build_rs_run(_config(tiny_policy, tmp_path / "stopped", *settings))
    assert resumed.first_iteration == 1
    resumed.fit()
    resumed.metrics.close()
    assert _samples(tmp_path / "stopped", 2) == _samples(tmp_path / "whole", 2)
    # Iteration 1 kept fewer samples than a global batch: no step, so the resume went through a checkpoint
    # of an optimizer that had not stepped (saved without state; a fresh optimizer is the same).
    kept = [row["kept"] for row in metrics_rows(tmp_path / "whole", "rs")]
    assert kept[0] < 20 <= kept[1], kept
    whole_losses = [row["loss"] for row in metrics_rows(tmp_path / "whole", "train")]
    resumed_losses = [row["loss"] for row in metrics_rows(tmp_path / "stopped", "train")]
    assert resumed_losses == pytest.approx(whole_losses, rel=1e-6)
