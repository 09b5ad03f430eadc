"""A random-init policy small enough to build an RL actor in a second, and a prompt file, for the tests of
what the actor does with reward functions (tests/unit/test_rewards.py, tests/faults/test_reward_faults.py)."""
from __future__ import annotations

import json
from pathlib import Path

# Line 2 is blank and line 4 a conversation: a record "prompts.jsonl:4" names a file line (not an index),
# and a reward function is handed a list it could change.
PROMPT_LINES = ['{"prompt": "1+2="}', "", '{"prompt": "3+4="}',
                json.dumps({"prompt": [{"role": "user", "content": "5+6="}]}), '{"prompt": "7+8="}']
MESSAGES_LINE = 4


def save_random_policy(path: Path, tokenizer_dir: Path, *, seed: int, num_layers: int, hidden_size: int,
                       num_attention_heads: int, num_query_groups: int, ffn_hidden_size: int) -> Path:
    """A random-init GPT policy (64 positions) on a tokenizer, saved as a checkpoint at `path`. Initialises and
    shuts down megatron's parallel state in this process."""
    from aligner import checkpointing
    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config
    from aligner.runtime import distributed, seeds
    from aligner.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    distributed.initialize(distributed.ParallelConfig())
    try:
        seeds.set_seed(seed)
        cfg = GPTConfig(num_layers=num_layers, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
                        num_query_groups=num_query_groups, ffn_hidden_size=ffn_hidden_size,
                        vocab_size=tokenizer.vocab_size, max_position_embeddings=64)
        return checkpointing.save(path, [build_gpt_model(cfg, transformer_config(cfg))],
                                  model_config=cfg.to_dict(), tokenizer_dir=tokenizer_dir)
    finally:
        distributed.shutdown()


def two_layer_policy_and_prompts(root: Path, tokenizer_dir: Path, num_prompts: int) -> tuple[Path, Path, Path]:
    """(root, a random-init 2-layer, 32-wide policy on the demo's character tokenizer, a file of `num_prompts`
    demo prompts): the RL actor tests' policy (each test file builds it once, in a module fixture)."""
    from aligner.demo import arithmetic

    policy = save_random_policy(root / "policy", tokenizer_dir, seed=11, num_layers=2, hidden_size=32,
                                num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(record) + "\n" for record in arithmetic.rl_prompts(num_prompts, seed=1)))
    return root, policy, prompts


def write_tiny_policy(root: Path, tokenizer_dir: Path) -> tuple[Path, Path]:
    """(a saved 1-layer, 16-wide random policy on the demo's character tokenizer, the prompt file) under root."""
    policy = save_random_policy(root / "policy", tokenizer_dir, seed=5, num_layers=1, hidden_size=16,
                                num_attention_heads=2, num_query_groups=1, ffn_hidden_size=32)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(PROMPT_LINES) + "\n")
    return policy, prompts


def actor_settings(policy: Path, prompts: Path, root: Path, reward_function: str) -> list[str]:
    """Overrides of aligner/conf/gpt_reinforce_actor.yaml: 2 prompts x 2 samples per step, micro-batches of 4."""
    return [f"model.init_from={policy}", f"data.prompts={prompts}", "data.max_prompt_length=32",
            "generation.max_new_tokens=4", "generation.micro_batch_size=4", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
            "reward.source=function", f"reward.function={reward_function}", "kl.init_coef=0.0",
            "trainer.val_check_interval=0", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.peak_tflops=1.0", f"checkpoint.save_dir={root / 'checkpoints'}",
            f"logging.log_dir={root / 'logs'}", "checkpoint.resume=false"]
