"""The project's Slurm scripts on a real Slurm cluster of three nodes (tests/cluster/minicluster.py): network
namespaces on one machine, each with its own address, hostname and slurmd, driven by sbatch, scancel and scontrol."""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aligner.demo import arithmetic
from aligner.demo.tokenizer import train_char_tokenizer

from ..conftest import QUIET_RUN, REPO_ROOT, TINY_MODEL, metrics_rows, run_torchrun, write_jsonl, write_ppo_inputs
from .minicluster import ClusterUnavailable, MiniCluster, unavailable_reason

GPT = REPO_ROOT / "examples" / "nlp" / "gpt"
SFT_SBATCH = GPT / "slurm" / "sft.sbatch"
PPO_SBATCH = GPT / "slurm" / "ppo_heterogeneous.sbatch"
ASYNC_SBATCH = GPT / "slurm" / "grpo_async.sbatch"
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# The scripts' sizes for one CPU rank per node: sbatch's own options override their #SBATCH lines.
ONE_RANK_PER_NODE = ("--ntasks-per-node=1", "--gpus-per-node=0")
SFT_STEPS = 30
# The PPO jobs' steps take about 0.1 s each here: enough of them that a signal or a node loss sent after the first
# ones lands before the run ends.
PPO_STEPS = 24
# The mini cluster's shared file system is one machine's: another node's lock heartbeat shows at once, so a
# requeued server takes over its lost run's save_dir lock after 20 s of silence instead of the default 120 s.
LOCK_STALE_S = "20"


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no mini Slurm cluster on this machine: {reason}")
    mini = MiniCluster()
    try:
        mini.up()
    except ClusterUnavailable as error:
        pytest.skip(f"no mini Slurm cluster on this machine: {error}")
    try:
        yield mini
    finally:
        mini.down()
    assert not mini.leftovers(), mini.leftovers()


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm_sft")
    records = arithmetic.sft_records(256, seed=3)
    write_jsonl(root / "train.jsonl", records)
    train_char_tokenizer([r["input"] + r["output"] for r in records], root / "tokenizer")
    settings = [f"tokenizer.path={root / 'tokenizer'}", *TINY_MODEL, *QUIET_RUN, "trainer.global_batch_size=8",
                "trainer.micro_batch_size=2", "optim.lr=1e-3", "optim.warmup_steps=1", "optim.decay_style=constant",
                f"trainer.max_steps={SFT_STEPS}", "checkpoint.save_interval=0", "checkpoint.keep_last=0"]
    return root, settings


def _rows(log_dir: Path) -> dict[int, dict]:
    """The train rows by step a run has logged so far ({} before its first)."""
    if not (log_dir / "metrics.jsonl").exists():
        return {}
    return {row["step"]: row for row in metrics_rows(log_dir, "train")}


def _losses(log_dir: Path) -> dict[int, float]:
    return {step: row["loss"] for step, row in _rows(log_dir).items()}


def _submit_sft(cluster: MiniCluster, root: Path, name: str, settings: list[str], *sbatch: str) -> tuple[int, Path]:
    results = root / name
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TRAIN=str(root / "train.jsonl"),
                      RESULTS=str(results), MASTER_PORT="29510")
    job = cluster.sbatch("--nodes=2", *ONE_RANK_PER_NODE, f"--output={root / name}.log", *sbatch, str(SFT_SBATCH),
                         *settings, env=env, cwd=REPO_ROOT)
    return job, results


def _log(path: Path) -> str:
    return path.read_text() if path.exists() else f"({path} not written)"


def _wait_for(condition, timeout_s: float, what: str, alive=lambda: True, report=lambda: "") -> float:
    """Poll `condition` until it holds; fail naming `what` after `timeout_s`, or as soon as `alive()` is false
    (the job ended first). Returns the seconds it took."""
    started = time.monotonic()
    while not condition():
        assert alive(), f"the job ended before {what}: {report()[-4000:]}"
        assert time.monotonic() - started < timeout_s, f"no {what} within {timeout_s:.0f} s: {report()[-4000:]}"
        time.sleep(0.1)
    return time.monotonic() - started


def _running(cluster: MiniCluster, job: int):
    return lambda: cluster.job(job).get("JobState") in ("PENDING", "RUNNING")


def test_the_cluster_comes_up_with_a_node_per_namespace_and_goes_down_leaving_nothing():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no mini Slurm cluster on this machine: {reason}")
    mini = MiniCluster(nodes=2, root=Path("/tmp/aligner-minicluster-updown"), prefix="alnu")  # beside the module's
    try:
        try:
            mini.up()
        except ClusterUnavailable as error:
            pytest.skip(f"no mini Slurm cluster on this machine: {error}")
        assert mini.node_states() == {"n1": "idle", "n2": "idle"}
        # one task per node: each sees its own hostname and its own address on the bridge
        out = mini.run("srun", "--nodes=2", "--ntasks-per-node=1", "sh", "-c",
                       'echo "$(hostname) $SLURM_PROCID $(ip -4 -o addr show dev eth0 | awk \'{print $4}\')"',
                       timeout=60).stdout
        assert sorted(out.split("\n")[:2]) == ["n1 0 10.213.77.11/24", "n2 1 10.213.77.12/24"], out
        assert mini.pids(mini.namespace("n1")), "slurmd should be running on n1"
    finally:
        mini.down()
    assert mini.leftovers() == []


def test_sft_across_two_nodes_has_the_losses_of_dp2_on_one_machine(cluster, sft_data):
    """sft.sbatch on two nodes (one rank each, DP=2, srun's rendezvous at the first node's address) against
    torchrun's DP=2 on loopback: the same losses."""
    root, settings = sft_data
    job, results = _submit_sft(cluster, root, "two_nodes", settings)
    reference = root / "one_machine"
    run_torchrun(GPT / "train_gpt_sft.py", 2, f"data.train=[{{path: {root / 'train.jsonl'}}}]", *settings,
                 f"checkpoint.save_dir={reference / 'checkpoints'}", f"logging.log_dir={reference}")
    record = cluster.wait_job(job, 240)
    log = _log(root / "two_nodes.log")
    assert record["JobState"] == "COMPLETED", log[-4000:]
    assert record["NodeList"] == "n[1-2]"
    assert "2 ranks on n[1-2], rendezvous n1:29510" in log and "layout TP=1 PP=1 DP=2" in log, log[-4000:]
    expected, got = _losses(reference), _losses(results)
    assert sorted(got) == list(range(1, SFT_STEPS + 1)) and got[SFT_STEPS] < got[1], got
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=0), (step, got[step], expected[step])


def test_sigterm_from_slurm_saves_and_a_requeued_job_resumes_to_the_uninterrupted_losses(cluster, sft_data):
    """The --signal=B:TERM path (scancel --batch --signal=TERM: the script alone), then scontrol requeue."""
    root, settings = sft_data
    uninterrupted = _losses(root / "two_nodes")
    if not uninterrupted:
        pytest.skip("needs the two-node run of test_sft_across_two_nodes_has_the_losses_of_dp2_on_one_machine")
    job, results = _submit_sft(cluster, root, "stopped", settings, "--open-mode=append")
    _wait_for(lambda: _losses(results).get(3), 180, "a third step", _running(cluster, job),
              lambda: _log(root / "stopped.log"))
    cluster.run("scancel", "--batch", "--signal=TERM", str(job))
    record = cluster.wait_job(job, 120)
    log = _log(root / "stopped.log")
    stopped = max(_losses(results))
    assert stopped < SFT_STEPS, "the run ended before the signal"
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "143:0", (record["JobState"], log[-3000:])
    assert f"stopped at step {stopped} by SIGTERM; checkpoint {results / 'checkpoints'}" in log, log[-3000:]
    assert "Traceback" not in log, log[-4000:]

    cluster.run("scontrol", "requeue", str(job))
    record = cluster.wait_job(job, 300, states=("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"))
    log = _log(root / "stopped.log")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record["JobState"], log[-4000:])
    assert f"job {job} (restart 1)" in log and f"resumed from {results / 'checkpoints'}" in log, log[-4000:]
    resumed = _losses(results)
    assert sorted(resumed) == list(range(1, SFT_STEPS + 1)), resumed
    for step in range(1, SFT_STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), step


@pytest.fixture(scope="module")
def ppo_models(tmp_path_factory):
    """A random-init policy (SFT at step 0) and a reward model from it (its value head at its initialisation)."""
    root = tmp_path_factory.mktemp("slurm_ppo")
    write_ppo_inputs(root, sft=64, pairs=32, prompts=64)
    run_torchrun(GPT / "train_gpt_sft.py", 1, f"tokenizer.path={root / 'tokenizer'}",
                 f"data.train=[{{path: {root / 'sft.jsonl'}}}]", *TINY_MODEL, *QUIET_RUN, "trainer.max_steps=0",
                 f"checkpoint.save_dir={root / 'sft'}", f"logging.log_dir={root / 'sft_logs'}")
    run_torchrun(GPT / "train_reward_model.py", 1, f"model.init_from={root / 'sft' / 'step_00000000'}",
                 f"data.train=[{{path: {root / 'pairs.jsonl'}}}]", *QUIET_RUN, "trainer.max_steps=0",
                 f"checkpoint.save_dir={root / 'rm'}", f"logging.log_dir={root / 'rm_logs'}")
    return root, root / "sft" / "step_00000000", root / "rm" / "step_00000000"


def _submit_ppo(cluster: MiniCluster, ppo_models, name: str, *actor_settings: str,
                workers: bool = False) -> tuple[int, Path]:
    """ppo_heterogeneous.sbatch, one rank per component (the actor's node first), PPO_STEPS steps of 8 prompts;
    workers: a third component, the actor's generation worker server."""
    root, sft, rm = ppo_models
    results = root / name
    actor = ["data.max_prompt_length=8", "generation.max_new_tokens=5", "generation.micro_batch_size=8",
             "rollout.prompts_per_step=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
             f"trainer.max_steps={PPO_STEPS}", "optim.lr=1e-3", "logging.progress_bar=false",
             "logging.tensorboard=false",
             "logging.peak_tflops=1.0", "logging.samples_interval=0", "critic.server.ready_timeout_s=240",
             "critic.server.timeout_s=30", "reward.server.timeout_s=30", *actor_settings]
    critic = ["train.global_batch_size=8", "train.micro_batch_size=8", "inference.micro_batch_size=8"]
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RM_CHECKPOINT=str(rm), SFT_CHECKPOINT=str(sft),
                      PROMPTS=str(root / "prompts.jsonl"), RESULTS=str(results), CRITIC_TP="1", ACTOR_TP="1",
                      ACTOR_ARGS=" ".join(actor), CRITIC_ARGS=" ".join(critic), ALIGNER_LOCK_STALE_S=LOCK_STALE_S)
    third = (":", "--nodes=1", *ONE_RANK_PER_NODE) if workers else ()
    job = cluster.sbatch("--nodes=1", *ONE_RANK_PER_NODE, f"--output={root / name}.log", "--open-mode=append", ":",
                         "--nodes=1", *ONE_RANK_PER_NODE, *third, str(PPO_SBATCH), env=env, cwd=REPO_ROOT)
    return job, results


def _lose_node_and_requeue(cluster: MiniCluster, job: int, node: str, report, timeout_s: float) -> tuple[float, dict]:
    """Kill `node` under a running job; wait for the job's error line, and requeue the job once it failed and
    Slurm marked the node down (or let Slurm requeue it); (seconds to the error line, the job's final record)."""
    cluster.kill_node(node)
    try:
        noticed_s = _wait_for(lambda: "error:" in report(), 90, "an error line from the job", report=report)
        first = cluster.wait_job(job, 120, states=("FAILED", "PENDING", "REQUEUED", "NODE_FAIL", "COMPLETED"))
        if first["JobState"] == "FAILED":  # the job's exit ended it before Slurm marked the node down
            _wait_for(lambda: cluster.node_states().get(node) == "down", 90, "the lost node marked down",
                      report=lambda: str(cluster.node_states()))
            cluster.run("scontrol", "requeue", str(job))
        return noticed_s, cluster.wait_job(job, timeout_s, states=("COMPLETED", "FAILED", "CANCELLED"))
    finally:
        cluster.start_slurmd(node)


def _ppo_rows(results: Path) -> dict[int, dict]:
    return _rows(results / "actor")


def test_ppo_heterogeneous_job_on_two_nodes_survives_the_loss_of_the_critics_node(cluster, ppo_models):
    """ppo_heterogeneous.sbatch: the actor on one node; the critic server (combined with the reward model) on
    another, listening on that node's address only, reached by the node's name. After the step-2 checkpoints the
    critic's node fails: the actor stops with one line naming the server, Slurm requeues the job onto the two other
    nodes, and both sides resume from the newest step they both saved to the end (the critic once its lost run's
    lock has been silent for LOCK_STALE_S)."""
    root, _, _ = ppo_models
    job, results = _submit_ppo(cluster, ppo_models, "ppo", "checkpoint.save_interval=2")
    # while the actor trains: the server listens on its node's address, on no other interface
    report = lambda: _log(root / "ppo.log")  # noqa: E731
    _wait_for(lambda: "critic server ready" in _log(results / "critic_server.log"), 240, "a ready critic server",
              _running(cluster, job), report)
    actor_node, critic_node = cluster.job(job)["NodeList"], cluster.job(job + 1)["NodeList"]
    assert critic_node != actor_node, critic_node
    listening = cluster.run("ss", "--listening", "--tcp", "--numeric", "--no-header", node=critic_node).stdout
    ports = {line.split()[3].replace("[::ffff:", "").replace("]", "") for line in listening.splitlines()}  # gRPC: v6
    assert {f"{cluster.address(critic_node)}:{port}" for port in (5560, 5561, 5562)} <= ports, listening
    assert not any(port.endswith((":5560", ":5561", ":5562")) and not port.startswith(cluster.address(critic_node))
                   for port in ports), listening
    assert f"critic server ready on http://{critic_node}:5560" in _log(results / "critic_server.log")

    _wait_for(lambda: all((results / side / "checkpoints" / "step_00000002" / "aligner_meta.json").is_file()
                          for side in ("actor", "critic")), 240, "step-2 checkpoints", _running(cluster, job), report)
    noticed_s, record = _lose_node_and_requeue(cluster, job, critic_node, report, 420)
    log = _log(root / "ppo.log")
    first_run = log[:log.index("(restart 1)")] if "(restart 1)" in log else log
    errors = [line for line in first_run.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: lost the critic server at {critic_node}:5560 ("), \
        first_run[-3000:]
    assert "Timeout occurred" not in first_run, first_run[-3000:]  # PyTriton's own log line of the same failure
    assert "Traceback" not in log, log[-4000:]
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record["JobState"], log[-4000:])
    again = {cluster.job(job)["NodeList"], cluster.job(job + 1)["NodeList"]}
    assert again == set(cluster.names) - {critic_node}, again
    assert sorted(_ppo_rows(results)) == list(range(1, PPO_STEPS + 1)), log[-3000:]
    resumed = re.search(rf"resumed from {re.escape(str(results / 'actor' / 'checkpoints'))}/step_(\d+) at step (\d+)",
                        log)
    assert resumed and resumed[1].lstrip("0") == resumed[2] and 2 <= int(resumed[2]) < PPO_STEPS, log[-4000:]
    assert f"restored the critic server to its checkpoint of step {resumed[2]}" in log, log[-4000:]
    for side in ("actor", "critic"):
        assert (results / side / "checkpoints" / f"step_{PPO_STEPS:08d}" / "aligner_meta.json").is_file(), side
    second_server = _log(results / "critic_server.log").rsplit("critic server ready", 1)[-1]
    assert "Killed" not in second_server, "the critic server was SIGKILLed, not stopped"
    cluster.wait_idle(60)
    print(f"the critic's node lost: the actor noticed in {noticed_s:.1f} s")


def test_sigterm_to_the_ppo_job_saves_actor_and_critic_at_one_step_and_requeue_resumes_identically(cluster,
                                                                                                     ppo_models):
    """The B:TERM path of ppo_heterogeneous.sbatch (scancel --batch --signal=TERM): the actor stops at a step
    boundary with its checkpoint and the critic's at the same step, the job ends 143 with the server stopped by
    SIGTERM; `scontrol requeue` resumes both, and every step's metrics equal those of the run above, which
    was itself resumed once, after its lost node."""
    root, _, _ = ppo_models
    reference = _ppo_rows(root / "ppo")
    if sorted(reference) != list(range(1, PPO_STEPS + 1)):
        pytest.skip("needs the PPO run of test_ppo_heterogeneous_job_on_two_nodes_survives_..._critics_node")
    job, results = _submit_ppo(cluster, ppo_models, "ppo_term")
    report = lambda: _log(root / "ppo_term.log")  # noqa: E731
    _wait_for(lambda: _ppo_rows(results).get(1), 240, "a first PPO step", _running(cluster, job), report)
    cluster.run("scancel", "--batch", "--signal=TERM", str(job))
    record = cluster.wait_job(job, 120)
    log = report()
    stopped = max(_ppo_rows(results))
    assert stopped < PPO_STEPS, "the run ended before the signal"
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "143:0", (record["JobState"], log[-3000:])
    checkpoint = results / "actor" / "checkpoints" / f"step_{stopped:08d}"
    assert f"stopped at step {stopped} by SIGTERM; checkpoint {checkpoint}" in log, log[-3000:]
    assert (results / "critic" / "checkpoints" / f"step_{stopped:08d}" / "aligner_meta.json").is_file()
    assert "Killed" not in _log(results / "critic_server.log"), "the critic server was SIGKILLed, not stopped"

    cluster.run("scontrol", "requeue", str(job))
    record = cluster.wait_job(job, 300, states=("COMPLETED", "FAILED", "CANCELLED"))
    log = report()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record["JobState"], log[-4000:])
    assert f"resumed from {checkpoint} at step {stopped}" in log, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    rows = _ppo_rows(results)
    assert sorted(rows) == list(range(1, PPO_STEPS + 1)), rows
    for step, row in rows.items():
        for key in ("reward_mean", "kl", "loss"):
            assert row[key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_a_node_lost_mid_run_ends_the_step_with_one_line_and_the_requeued_job_resumes_elsewhere(cluster, sft_data):
    """Rank 1's node fails (its slurmd and every process on it SIGKILLed) during SFT: rank 0 stops with one line
    naming that node, Slurm marks it down and requeues the job (--requeue), which resumes on the two other nodes
    from the newest intact checkpoint to the uninterrupted run's losses; nothing of the first run is left."""
    root, settings = sft_data
    uninterrupted = _losses(root / "two_nodes")
    if not uninterrupted:
        pytest.skip("needs the two-node run of test_sft_across_two_nodes_has_the_losses_of_dp2_on_one_machine")
    job, results = _submit_sft(cluster, root, "node_lost", [*settings, "checkpoint.save_interval=4"],
                               "--open-mode=append")
    report = lambda: _log(root / "node_lost.log")  # noqa: E731
    _wait_for((results / "checkpoints" / "step_00000008").exists, 180, "a step-8 checkpoint", _running(cluster, job),
              report)
    first, lost = cluster.hostnames(cluster.job(job)["NodeList"])  # rank 0's node, rank 1's
    cluster.kill_node(lost)
    try:
        noticed_s = _wait_for(lambda: "lost a peer rank" in _log(root / "node_lost.log"), 60,
                              "the surviving rank's line", report=report)
        first_run = _log(root / "node_lost.log")
        assert f"error: lost a peer rank: the rank on {lost} ({cluster.address(lost)}) went away" in first_run, \
            first_run[-3000:]
        assert "Traceback" not in first_run, first_run[-4000:]
        record = cluster.wait_job(job, 300, states=("COMPLETED", "FAILED", "CANCELLED"))
    finally:
        cluster.start_slurmd(lost)
    log = _log(root / "node_lost.log")
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record["JobState"], log[-4000:])
    survivors = sorted(set(cluster.names) - {lost})
    assert cluster.hostnames(record["NodeList"]) == survivors, record["NodeList"]
    assert f"job {job} (restart 1): 2 ranks on {record['NodeList']}" in log, log[-4000:]
    assert f"resumed from {results / 'checkpoints'}" in log, log[-4000:]
    resumed = _losses(results)
    assert sorted(resumed) == list(range(1, SFT_STEPS + 1)), resumed
    for step in range(1, SFT_STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-6, abs=0), step
    for node in {first, *survivors}:  # only slurmd is left on the nodes that ran the job
        left = [_command(pid) for pid in cluster.pids(cluster.namespace(node))]
        assert all(command.startswith("slurmd") for command in left), (node, left)
    cluster.wait_idle(60)
    print(f"node loss noticed by the surviving rank in {noticed_s:.1f} s")


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _torchrun_on_two_nodes(cluster: MiniCluster, root: Path, name: str, script: Path, *args: str) -> dict[str, str]:
    """`torchrun --nnodes 2` on n1 and n2 (c10d rendezvous at n1:29400), one rank per node; the nodes' output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", "--rdzv-endpoint=n1:29400", f"--rdzv-id={name}", str(script), *args]
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    logs = {node: open(root / f"{name}_{node}.log", "w") for node in ("n1", "n2")}  # noqa: SIM115
    launched = {node: cluster.popen(node, *command, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
                for node, log in logs.items()}
    try:
        codes = {node: process.wait(timeout=240) for node, process in launched.items()}
    finally:
        for process in launched.values():
            if process.poll() is None:
                process.kill()
        for log in logs.values():
            log.close()
    output = {node: _log(root / f"{name}_{node}.log") for node in logs}
    assert codes == {"n1": 0, "n2": 0}, {node: text[-3000:] for node, text in output.items()}
    return output


def test_torchrun_across_two_nodes_without_slurm_has_the_losses_of_dp2_on_one_machine(cluster, sft_data):
    """SFT under torchrun --nnodes 2 on n1 and n2: the same losses as DP=2 on one machine (the reference of the Slurm
    parity test)."""
    root, settings = sft_data
    reference = _losses(root / "one_machine")
    if not reference:
        pytest.skip("needs the one-machine run of test_sft_across_two_nodes_has_the_losses_of_dp2_on_one_machine")
    results = root / "torchrun"
    output = _torchrun_on_two_nodes(cluster, root, "torchrun_sft", GPT / "train_gpt_sft.py",
                                    f"data.train=[{{path: {root / 'train.jsonl'}}}]", *settings,
                                    f"checkpoint.save_dir={results / 'checkpoints'}", f"logging.log_dir={results}")
    assert "layout TP=1 PP=1 DP=2" in output["n1"], output["n1"][-3000:]
    got = _losses(results)
    assert sorted(got) == sorted(reference), got
    for step in reference:
        assert got[step] == pytest.approx(reference[step], rel=1e-6, abs=0), (step, got[step], reference[step])


def test_the_rl_actor_across_two_nodes_without_slurm_has_the_metrics_of_dp2_on_one_machine(cluster, ppo_models):
    """GRPO (a reward function, no servers) under torchrun --nnodes 2: each node generates and trains its share of
    the groups; every step's reward, KL and loss equal DP=2 on one machine."""
    root, sft, _ = ppo_models
    settings = [f"model.init_from={sft}", f"data.prompts={root / 'prompts.jsonl'}", "algorithm=grpo",
                "reward.source=function", "reward.function=aligner.demo.arithmetic:score_response",
                "data.max_prompt_length=8", "generation.max_new_tokens=5", "generation.micro_batch_size=8",
                "rollout.prompts_per_step=4",
                "rollout.samples_per_prompt=4", "trainer.global_batch_size=16", "trainer.micro_batch_size=4",
                "trainer.max_steps=3", "optim.lr=1e-3", "logging.progress_bar=false", "logging.tensorboard=false",
                "logging.peak_tflops=1.0", "logging.samples_interval=0", "checkpoint.save_at_end=false"]
    script = GPT / "train_gpt_reinforce_actor.py"
    run_torchrun(script, 2, *settings, f"checkpoint.save_dir={root / 'grpo_one' / 'checkpoints'}",
                 f"logging.log_dir={root / 'grpo_one'}")
    output = _torchrun_on_two_nodes(cluster, root, "torchrun_grpo", script, *settings,
                                    f"checkpoint.save_dir={root / 'grpo_two' / 'checkpoints'}",
                                    f"logging.log_dir={root / 'grpo_two'}")
    reference, got = (_rows(root / name) for name in ("grpo_one", "grpo_two"))
    assert sorted(got) == sorted(reference) == [1, 2, 3], output["n1"][-3000:]
    for step, row in got.items():
        for key in ("reward_mean", "kl", "loss"):
            assert row[key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-9), (step, key)


ASYNC_STEPS = 24  # (steps take about 0.1 s: enough that the node loss lands before the run ends)


def _async_settings(ppo_models) -> list[str]:
    """Asynchronous GRPO (one step stale, the decoupled correction) on the tiny policy, a reward function."""
    root, sft, _ = ppo_models
    return [f"model.init_from={sft}", f"data.prompts={root / 'prompts.jsonl'}", "algorithm=grpo",
            "reward.source=function", "reward.function=aligner.demo.arithmetic:score_response",
            "data.max_prompt_length=8", "generation.max_new_tokens=5", "generation.micro_batch_size=8",
            "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "trainer.global_batch_size=16",
            "trainer.micro_batch_size=4", f"trainer.max_steps={ASYNC_STEPS}", "optim.lr=1e-3",
            "loss.importance_sampling=token", "logging.progress_bar=false", "logging.tensorboard=false",
            "logging.peak_tflops=1.0", "logging.samples_interval=0", "checkpoint.save_interval=2",
            "rollout.asynchronous.silence_timeout_s=60"]


def _submit_async(cluster: MiniCluster, ppo_models, name: str) -> tuple[int, Path]:
    """grpo_async.sbatch: the trainer (one rank) on one node, its generation worker server on another."""
    root = ppo_models[0]
    results = root / name
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RESULTS=str(results), MAX_STALENESS="1",
                      ALIGNER_LOCK_STALE_S=LOCK_STALE_S)
    job = cluster.sbatch("--nodes=1", *ONE_RANK_PER_NODE, f"--output={root / name}.log", "--open-mode=append", ":",
                         "--nodes=1", *ONE_RANK_PER_NODE, str(ASYNC_SBATCH), *_async_settings(ppo_models), env=env,
                         cwd=REPO_ROOT)
    return job, results


def test_async_grpo_with_its_generation_worker_on_another_node_matches_one_machine_and_survives_its_loss(
        cluster, ppo_models, monkeypatch):
    """grpo_async.sbatch: the trainer on one node, the generation worker server on another (bound to its node's
    name), weights and rollouts over TCP. The worker's node fails after the step-2 checkpoint: the trainer stops
    with one line naming the worker, and the requeued job resumes on the two other nodes (the rollouts generated
    ahead restored from the checkpoint); every step's reward, KL and loss, before the loss and after the resume,
    equal the same asynchronous run with a worker process beside the trainer on one machine."""
    root = ppo_models[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run_torchrun(GPT / "train_gpt_reinforce_actor.py", 1, *_async_settings(ppo_models),
                 "rollout.asynchronous.enabled=true", "rollout.asynchronous.max_staleness=1",
                 "rollout.asynchronous.worker_threads=1",
                 f"checkpoint.save_dir={root / 'async_one' / 'checkpoints'}", f"logging.log_dir={root / 'async_one'}")
    reference = _rows(root / "async_one")
    assert sorted(reference) == list(range(1, ASYNC_STEPS + 1))

    job, results = _submit_async(cluster, ppo_models, "async_lost")
    report = lambda: _log(root / "async_lost.log")  # noqa: E731
    _wait_for((results / "checkpoints" / "step_00000002" / "aligner_meta.json").is_file, 240, "a step-2 checkpoint",
              _running(cluster, job), report)
    trainer_node, worker_node = cluster.job(job)["NodeList"], cluster.job(job + 1)["NodeList"]
    assert trainer_node != worker_node and f"generation workers: {worker_node}:5570" in report(), report()[-3000:]
    assert f"ready on {worker_node}:5570 ({cluster.address(worker_node)};" in _log(results / "workers.log")
    noticed_s, record = _lose_node_and_requeue(cluster, job, worker_node, report, 300)
    log = report()
    first_run = log[:log.index("(restart 1)")] if "(restart 1)" in log else log
    errors = [line for line in first_run.splitlines() if line.startswith("error:")]
    lost_line = f"error: cannot reach the generation worker at {worker_node}:5570"
    assert len(errors) == 1 and errors[0].startswith(lost_line), first_run[-3000:]
    assert "Traceback" not in log, log[-4000:]
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record["JobState"], log[-4000:])
    assert re.search(rf"resumed from {re.escape(str(results / 'checkpoints'))}/step_\d+", log), log[-4000:]
    resumed = _rows(results)
    assert sorted(resumed) == list(range(1, ASYNC_STEPS + 1)), log[-3000:]
    for step, row in resumed.items():
        assert row["async/staleness_max"] == min(step - 1, 1), step
        for key in ("reward_mean", "kl", "loss"):
            assert row[key] == pytest.approx(reference[step][key], rel=1e-6, abs=1e-9), (step, key)
    cluster.wait_idle(90)
    print(f"the worker's node lost: the trainer stopped in {noticed_s:.1f} s")


def test_ppo_with_a_third_component_generates_on_its_node_asynchronously(cluster, ppo_models):
    """ppo_heterogeneous.sbatch with a third component: the actor on one node, the critic server on another, the
    actor's generation worker server on the third; PPO runs asynchronously (one step stale, the decoupled
    correction) to its last step, and every process of the job ends with it."""
    root = ppo_models[0]
    job, results = _submit_ppo(cluster, ppo_models, "ppo_async", "loss.importance_sampling=token",
                               "trainer.max_steps=6", workers=True)
    record = cluster.wait_job(job, 300, states=("COMPLETED", "FAILED", "CANCELLED"))
    log = _log(root / "ppo_async.log")
    assert record["JobState"] == "COMPLETED", (record["JobState"], log[-4000:])
    nodes = [cluster.job(job + component)["NodeList"] for component in range(3)]
    assert len(set(nodes)) == 3, nodes
    assert f"asynchronous generation: the generation worker at {nodes[2]}:5570" in log, log[-3000:]
    assert "the trainer disconnected" in _log(results / "workers.log")
    rows = _ppo_rows(results)
    assert sorted(rows) == list(range(1, 7)), log[-3000:]
    assert [rows[step]["async/staleness_max"] for step in range(1, 7)] == [0.0] + [1.0] * 5
    assert "Traceback" not in log, log[-4000:]
    cluster.wait_idle(60)
