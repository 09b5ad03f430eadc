"""Serve asynchronous RL's generation on a host of its own (the trainer: rollout.asynchronous.workers=[HOST:PORT]).

    export ALIGNER_WORKER_KEY=...   # the same secret in the trainer's environment
    python examples/nlp/gpt/serve_generation_worker.py --host NODE --port 5570 [--threads N] [--address-file F]

The server builds nothing until a trainer connects: the trainer sends what to build (the policy's architecture,
LoRA adapters, tokenizer directory, which must be readable here too), then its weights and the steps to generate,
exactly as it does to a worker process beside it (aligner/generation/worker.py). One trainer at a time; when it
disconnects (its run ended, or it was stopped to be resumed), the next may connect. Stop it with SIGTERM or Ctrl-C.
"""
import argparse
import os

import torch

from aligner.config import run_main
from aligner.generation.worker import serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (this node's name or address)")
    parser.add_argument("--port", type=int, default=5570)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: this host's cores)")
    parser.add_argument("--address-file", default=None, help="write HOST:PORT here once listening (a job script "
                        "collects its workers' addresses so)")
    args = parser.parse_args()
    serve(args.host, args.port, args.threads or len(os.sched_getaffinity(0)) or torch.get_num_threads(),
          address_file=args.address_file)


if __name__ == "__main__":
    run_main(main)
