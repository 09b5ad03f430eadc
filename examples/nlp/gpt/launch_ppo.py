"""Run PPO on one machine: reward-model server, critic server and actor, started and stopped together.

    python examples/nlp/gpt/launch_ppo.py --reward-checkpoint RM_CHECKPOINT --log-dir results/ppo \
        --actor-arg model.init_from=SFT_CHECKPOINT --actor-arg data.prompts=prompts.jsonl [--actor-nproc 2]

Reward modes (--reward):
  combined  (default) the critic server also serves the reward model, swapping the two sets of
            weights on one set of devices; its answers carry values and rewards together
  server    a separate reward-model server (serve_reward_model.py) on --reward-port
  function  no reward server: pass --actor-arg reward.function=package.module:function
The critic starts from --critic-checkpoint (default: the reward model). Extra settings go to each
process with --critic-arg / --reward-arg / --actor-arg KEY=VALUE (repeatable). Before anything
starts, the critic's and the actor's configs are loaded and checked against each other (the critic's
train.global_batch_size must divide the actor's rollouts per step, and its request caps must take
one step's rollouts). Logs: <log-dir>/*.log;
the actor's checkpoints and metrics: <log-dir>/actor, the critic's: <log-dir>/critic. Re-running
the same command resumes both from their newest checkpoints. SIGTERM or Ctrl-C stops the actor at its
next step boundary with a checkpoint (of the critic too), then the servers; a second one kills all.
On a Slurm cluster use
examples/nlp/gpt/slurm/ppo_heterogeneous.sbatch instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aligner.config import CONF_DIR, ConfigError, load_config, parse_command_line, run_main
from aligner.hf.sources import source_kind
from aligner.launcher import (
    ACTOR_EXIT_MARGIN_S,
    ManagedProcess,
    actor_command,
    check_critic_fits_actor,
    run_processes,
)
from aligner.training.trainer import CheckpointConfig

GPT_EXAMPLES = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reward", choices=["combined", "server", "function"], default="combined")
    parser.add_argument("--reward-checkpoint", help="reward-model checkpoint (modes combined and server)")
    parser.add_argument("--critic-checkpoint", help="checkpoint the critic starts from (default: the reward model)")
    parser.add_argument("--log-dir", default="results/ppo")
    parser.add_argument("--actor-nproc", type=int, default=1, help="actor processes (torchrun when > 1)")
    parser.add_argument("--critic-nproc", type=int, default=1)
    parser.add_argument("--critic-port", type=int, default=5560,
                        help="the critic server's HTTP port (gRPC: +1, metrics: +2); its server.port")
    parser.add_argument("--reward-port", type=int, default=5555,
                        help="--reward server: the reward-model server's HTTP port (gRPC: +1, metrics: +2)")
    parser.add_argument("--actor-master-port", type=int, default=0,
                        help="--actor-nproc > 1: the actor workers' torchrun rendezvous port; 0: a free one")
    parser.add_argument("--critic-master-port", type=int, default=0,
                        help="--critic-nproc > 1: the critic workers' torchrun rendezvous port; 0: a free one")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--stop-grace", type=float, default=CheckpointConfig.stop_grace_s,
                        help="on SIGTERM/SIGINT: seconds the actor has to save a checkpoint "
                             "(its checkpoint.stop_grace_s)")
    parser.add_argument("--actor-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--critic-arg", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--reward-arg", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.reward != "function" and not args.reward_checkpoint:
        parser.error(f"--reward {args.reward} needs --reward-checkpoint")
    critic_init = args.critic_checkpoint or args.reward_checkpoint
    if not critic_init:
        parser.error("give --critic-checkpoint (the critic's starting weights)")
    for flag, path in (("--reward-checkpoint", args.reward_checkpoint), ("--critic-checkpoint", critic_init)):
        if path:  # refused here, not after a server has started and failed
            source_kind(path, flag)
    log_dir = Path(args.log_dir)

    critic_args = [f"critic.init_from={critic_init}", f"server.port={args.critic_port}",
                   f"checkpoint.save_dir={log_dir / 'critic' / 'checkpoints'}"]
    actor_args = [f"critic.server.port={args.critic_port}", f"checkpoint.save_dir={log_dir / 'actor' / 'checkpoints'}",
                  f"logging.log_dir={log_dir / 'actor'}", f"checkpoint.stop_grace_s={args.stop_grace}"]
    servers = []
    if args.reward == "combined":
        critic_args += [f"combined.reward_model_init_from={args.reward_checkpoint}"]
        actor_args += ["reward.source=combined"]
    elif args.reward == "server":
        servers.append(ManagedProcess("reward_server", [
            *actor_command(GPT_EXAMPLES / "serve_reward_model.py", 1, []), f"init_from={args.reward_checkpoint}",
            f"server.port={args.reward_port}", *args.reward_arg], log_dir / "reward_server.log"))
        actor_args += ["reward.source=server", f"reward.server.port={args.reward_port}"]
    else:
        actor_args += ["reward.source=function"]
    critic_args, actor_args = [*critic_args, *args.critic_arg], [*actor_args, *args.actor_arg]
    check_configs(critic_args, actor_args, args.critic_nproc)
    servers.append(ManagedProcess("critic_server", actor_command(
        GPT_EXAMPLES / "serve_ppo_critic.py", args.critic_nproc, critic_args, master_port=args.critic_master_port),
        log_dir / "critic_server.log"))
    actor = ManagedProcess("actor", actor_command(GPT_EXAMPLES / "train_gpt_ppo_actor.py", args.actor_nproc,
                                                  actor_args, stop_grace_s=args.stop_grace,
                                                  master_port=args.actor_master_port),
                           log_dir / "actor.log")
    sys.exit(run_processes(servers, actor, ready_timeout_s=args.ready_timeout,
                           actor_stop_grace_s=args.stop_grace + ACTOR_EXIT_MARGIN_S))


def check_configs(critic_args: list[str], actor_args: list[str], critic_nproc: int) -> None:
    """Load the critic's and the actor's configs as their entry points will, and refuse a critic that
    would reject the actor's first critic_train request (before any process starts)."""
    from aligner.algorithms.rl_config import RLActorConfig
    from servers.critic import CriticServerConfig

    configs = []
    for name, schema, yaml_name, command_line in (
            ("critic server", CriticServerConfig, "gpt_ppo_critic.yaml", critic_args),
            ("actor", RLActorConfig, "gpt_ppo_actor.yaml", actor_args)):
        try:
            configs.append(load_config(schema, *parse_command_line(CONF_DIR / yaml_name, command_line)))
        except ConfigError as error:
            raise ConfigError(f"the {name}'s config: {error}") from None
    critic_cfg, actor_cfg = configs
    critic_cfg.validate()
    model_parallel = critic_cfg.parallel.model_parallel_size
    critic_data_parallel = critic_nproc // model_parallel if critic_nproc % model_parallel == 0 else None
    check_critic_fits_actor(critic_cfg, actor_cfg, critic_data_parallel)


if __name__ == "__main__":
    run_main(main)
