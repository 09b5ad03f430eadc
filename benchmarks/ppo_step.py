"""Tokens/s of one PPO actor step on the demo-sized model, and where its time goes, in one process.

The actor is built by `build_rl_actor` exactly as train_gpt_ppo_actor.py builds it, with two
in-process stand-ins for the servers: the demo's rule reward (`aligner.demo.arithmetic:score_response`)
and `ZeroCritic` (values 0, no critic training), so the numbers are the actor's own work:
generation, actor + reference logprobs, advantages, and the PPO minibatch updates. Server time
(reward model, critic) is not included; it overlaps generation in a real run.

Baseline, timed alternately in the same process: plain supervised training steps (the SFT
objective) over the very same token batches, split into the same minibatches and micro batches.
`ratio` = PPO step / SFT steps on the same tokens: the cost of generating and scoring the batch
on top of training on it.

    python benchmarks/ppo_step.py [--repeats 5] [--prompts 128] [--max-new-tokens 6] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import torch


class ZeroCritic:
    """Stands in for the critic server: values 0 everywhere (GAE advantages are then discounted
    returns), no training, so the step's time is the actor's own."""

    @staticmethod
    def _done(value) -> Future:
        future: Future = Future()
        future.set_result(value)
        return future

    def infer_async(self, sequences) -> Future:
        return self._done(SimpleNamespace(values=[torch.zeros(len(s)) for s in sequences], rewards=None))

    def train_async(self, sequences, prompt_lengths, returns, old_values) -> Future:
        return self._done({"rows": float(len(sequences))})

    def save(self, step: int) -> str:
        return "(no critic)"


def _write_inputs(root: Path, num_prompts: int) -> tuple[Path, Path]:
    """A random-init demo-sized checkpoint with the demo's character tokenizer, and a prompt file."""
    from aligner import checkpointing
    from aligner.demo import arithmetic
    from aligner.demo.tokenizer import train_char_tokenizer
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds

    records = arithmetic.sft_records(512, seed=0)
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in arithmetic.rl_prompts(max(num_prompts, 512), seed=0)))
    distributed.initialize(distributed.ParallelConfig())
    seeds.set_seed(0)
    cfg = GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512,
                    vocab_size=256, max_position_embeddings=64)
    model = build_gpt_model(cfg, transformer_config(cfg))
    checkpointing.save(root / "policy", [model], model_config=cfg.to_dict(), tokenizer_dir=root / "tokenizer")
    return root / "policy", prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=128, help="rollouts per PPO step")
    parser.add_argument("--max-new-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's choice)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    from aligner.algorithms.rl_build import build_rl_actor
    from aligner.algorithms.rl_config import RLActorConfig
    from aligner.algorithms.sft import SFTObjective
    from aligner.config import CONF_DIR, load_config
    from aligner.generation.rewards import RuleRewardSource

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy, prompts = _write_inputs(root, args.prompts)
        cfg = load_config(RLActorConfig, CONF_DIR / "gpt_ppo_actor.yaml", [
            f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=8",
            f"generation.max_new_tokens={args.max_new_tokens}", "generation.micro_batch_size=64",
            f"rollout.prompts_per_step={args.prompts}", f"trainer.global_batch_size={args.prompts // 2}",
            "trainer.micro_batch_size=32", "loss.epochs=2", "optim.lr=1e-5", "generation.router=static",
            f"checkpoint.save_dir={root / 'ckpt'}", f"logging.log_dir={root / 'logs'}", "logging.progress_bar=false",
            "logging.tensorboard=false", "logging.samples_interval=0", "logging.peak_tflops=1.0",
        ])
        trainer = build_rl_actor(cfg, critic=ZeroCritic(),
                                    reward_source=RuleRewardSource("aligner.demo.arithmetic:score_response"))
        sft = SFTObjective(trainer.model_cfg.vocab_size)

        def sft_steps(batch) -> float:
            """The same minibatches/micro batches as PPO's update, trained with the SFT objective."""
            trainer.policy.objective = sft
            start = time.perf_counter()
            seq = batch.tokens.shape[1]
            labels = torch.nn.functional.pad(batch.tokens[:, 1:], (0, 1), value=trainer.tokenizer.pad_id)
            loss_mask = torch.zeros_like(batch.tokens, dtype=torch.float32)
            for row, (p, n) in enumerate(zip(batch.prompt_lengths.tolist(), batch.response_lengths.tolist())):
                loss_mask[row, p - 1:p - 1 + n] = 1.0
            positions = torch.arange(seq).unsqueeze(0).expand(cfg.trainer.micro_batch_size, -1)
            lengths = batch.prompt_lengths + batch.response_lengths  # real tokens per row (tokens/s, MFU)
            for _ in range(cfg.loss.epochs):
                for minibatch in torch.arange(len(batch.indices)).split(cfg.trainer.global_batch_size):
                    trainer.policy.train_step([{"tokens": batch.tokens[m], "labels": labels[m],
                                                "loss_mask": loss_mask[m], "position_ids": positions,
                                                "attention_mask": None, "lengths": lengths[m]}
                                               for m in minibatch.split(cfg.trainer.micro_batch_size)])
            trainer.policy.objective = trainer.objective
            return time.perf_counter() - start

        captured = {}
        original = trainer.rollouts.collect

        def keep_batch(*a, **kw):
            captured["batch"], rollout_metrics = original(*a, **kw)
            return captured["batch"], rollout_metrics

        trainer.rollouts.collect = keep_batch
        trainer.train_step()  # warm-up (allocations, first-call costs)
        rows = []
        for _ in range(args.repeats):
            metrics = trainer.train_step()
            baseline = sft_steps(captured["batch"])
            batch = captured["batch"]
            tokens = float((batch.prompt_lengths + batch.response_lengths).sum())
            rows.append((metrics, baseline, tokens))
        trainer.rollouts.router.close()

    def median(key):
        return statistics.median(m[key] for m, _, _ in rows)

    step = median("step_time")
    tokens = statistics.median(t for _, _, t in rows)
    ratio = statistics.median(m["step_time"] / b for m, b, _ in rows)
    print(f"PPO actor step, {args.prompts} rollouts x <= {args.max_new_tokens} new tokens, 4-layer 128-wide model, "
          f"2 epochs x 2 minibatches, {torch.get_num_threads()} thread(s), {args.repeats} repeats (medians)")
    print(f"  step            {step * 1e3:8.1f} ms   {tokens / step:8.0f} tokens/s "
          "(prompt + response tokens trained on)")
    print(f"  rollout         {median('rollout_tokens_per_second'):8.0f} generated tokens/s")
    for key in ("time_generation", "time_scoring_wait", "time_logprobs", "time_reference", "time_train",
                "time_critic_send"):
        print(f"  {key:<16}{median(key) * 1e3:8.1f} ms   {median(key) / step:6.1%} of the step")
    print(f"  SFT steps on the same tokens (baseline) {statistics.median(b for _, b, _ in rows) * 1e3:.1f} ms; "
          f"ratio PPO step / SFT steps = {ratio:.2f}")


if __name__ == "__main__":
    main()
