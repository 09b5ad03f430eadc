"""Talk to a trained model: interactive multi-turn chat with streamed replies, or a JSONL of prompts.

    python examples/nlp/gpt/chat.py init_from=CHECKPOINT_OR_HF_DIR                  # interactive
    python examples/nlp/gpt/chat.py init_from=... prompts_file=in.jsonl output_file=out.jsonl
    torchrun --nproc_per_node 2 examples/nlp/gpt/chat.py init_from=... parallel.tensor_model_parallel_size=2

Interactive commands: /reset starts a new conversation, /exit (or Ctrl-D) quits. Options and
record formats: aligner/conf/chat.yaml and aligner/generation/chat.py.
"""
from aligner.config import CONF_DIR, load_config, parse_command_line, run_main
from aligner.generation.chat import ChatConfig, run_chat


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "chat.yaml", schema=ChatConfig)
    run_chat(load_config(ChatConfig, config_path, overrides))


if __name__ == "__main__":  # dist_checkpointing (used by the HF import) spawns processes
    run_main(main)
