"""Serve a PPO critic over HTTP/gRPC with PyTriton (client: aligner.clients.critic.CriticClient).

    python examples/nlp/gpt/serve_ppo_critic.py critic.init_from=RM_CHECKPOINT [key=value ...]
    python examples/nlp/gpt/serve_ppo_critic.py critic.init_from=RM_CHECKPOINT \
        combined.reward_model_init_from=RM_CHECKPOINT   # combined mode: one server for critic and reward model
    torchrun --nproc_per_node 2 examples/nlp/gpt/serve_ppo_critic.py critic.init_from=... \
        parallel.tensor_model_parallel_size=2

Prints "critic server ready on http://HOST:PORT ..." once it answers; stop it with Ctrl-C or
SIGTERM. A restart with the same checkpoint.save_dir resumes from the newest critic checkpoint.
Requests, responses and errors: see servers/critic.py; the critic itself: aligner/algorithms/critic.py.
"""
import logging

from aligner.config import CONF_DIR, load_config, parse_command_line, run_main
from servers.critic import CriticServerConfig, serve_critic


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "gpt_ppo_critic.yaml", schema=CriticServerConfig)
    cfg = load_config(CriticServerConfig, config_path, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("servers").setLevel(logging.INFO)
    serve_critic(cfg)


if __name__ == "__main__":
    run_main(main)
