"""Serve a reward model over HTTP/gRPC with PyTriton (client: aligner.clients.reward.RewardClient).

    python examples/nlp/gpt/serve_reward_model.py init_from=CHECKPOINT [key=value ...]
    torchrun --nproc_per_node 2 examples/nlp/gpt/serve_reward_model.py init_from=CHECKPOINT \
        parallel.tensor_model_parallel_size=2

Prints "reward model server ready on http://HOST:PORT ..." once it answers; stop it with Ctrl-C or
SIGTERM. Requests, responses and errors: see servers/reward_model.py.
"""
import logging

from aligner.config import CONF_DIR, load_config, parse_command_line, run_main
from servers.reward_model import RewardServerConfig, serve_reward_model


def main() -> None:
    config_path, overrides = parse_command_line(CONF_DIR / "inference_rm.yaml", schema=RewardServerConfig)
    cfg = load_config(RewardServerConfig, config_path, overrides)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("servers").setLevel(logging.INFO)
    serve_reward_model(cfg)


if __name__ == "__main__":
    run_main(main)
