"""Distributed start-up: process group from torchrun/Slurm variables, megatron-core parallel state.

`gloo` without CUDA and `nccl` with it; the CPU bridge is applied here (and only here) so every
entry point gets the same runtime by calling `initialize(parallel)`.
"""
from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import socket
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from aligner.runtime import cpu_bridge, processes
from aligner.runtime.errors import ConfigError, UserError


@dataclass
class ParallelConfig:
    """The `parallel:` section of every config. Data parallel size is derived from the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    # MoE experts split over this many ranks of the data-parallel dimension (megatron's EP); the
    # experts keep tensor_model_parallel_size as their TP.
    expert_model_parallel_size: int = 1
    # seconds a rank waits for its peers in the rendezvous and in any collective before the run stops with one line
    # naming the peer: a lost node or a cut link (a peer whose process died is noticed at once)
    timeout_s: float = 1800.0

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size}) = {self.model_parallel_size}; launch "
                f"a multiple of {self.model_parallel_size} processes or change the parallel sizes"
            )
        data_parallel = world_size // self.model_parallel_size
        expert = self.expert_model_parallel_size
        if expert < 1 or data_parallel % expert:
            raise ConfigError(
                f"expert_model_parallel_size={expert} must divide the data-parallel size {data_parallel} "
                f"(world size {world_size} / (TP x PP) = {self.model_parallel_size}); experts are split "
                "over data-parallel ranks"
            )
        return data_parallel


def _env_int(*names: str, default: Optional[int] = None) -> Optional[int]:
    for name in names:
        if os.environ.get(name) not in (None, ""):
            return int(os.environ[name])
    return default


def rank_and_world_from_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun variables, else Slurm's, else a single process."""
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    return rank, local_rank, world


def backend() -> str:
    """gloo on CPU. On GPUs, NCCL for CUDA tensors and gloo for CPU ones (counts and metrics built on the host,
    stop flags): every group megatron creates from the default one then carries both, so a collective on a
    host tensor needs no copy to the GPU (NCCL alone refuses it: "No backend type associated with device
    type cpu", seen on an H100)."""
    return "gloo" if cpu_bridge.needed() else "cpu:gloo,cuda:nccl"


def device() -> torch.device:
    if cpu_bridge.needed():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# Deprecation notices raised inside megatron-core/torch internals on every run; nothing a user of
# this toolkit can act on (they concern megatron's own defaults and its checkpoint backend).
_THIRD_PARTY_NOTICES = (
    r"full scope is deprecated",
    r"`load_state_dict` is deprecated",
    r"Please use DTensor instead and we are deprecating ShardedTensor",
)
# Log lines of megatron's rerun state machine (a fault-injection tool aligner never enables)
# announcing itself at the first training step.
_RERUN_STATE_MACHINE_NOTICES = (
    "Implicit initialization of Rerun State Machine",
    "RerunStateMachine initialized in mode",
)


def _not_a_rerun_state_machine_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_RERUN_STATE_MACHINE_NOTICES)


def silence_third_party_notices() -> None:
    """Filter the start-up notices of megatron-core and torch that no user can act on (idempotent).

    Called when the aligner package is imported, before megatron-core is, which raises some of
    them at import.
    Each filter matches one known message, so anything else (a real error) still shows.
    """
    for notice in _THIRD_PARTY_NOTICES:
        warnings.filterwarnings("ignore", message=notice)
    rerun_logger = logging.getLogger("megatron.core.rerun_state_machine")
    if _not_a_rerun_state_machine_notice not in rerun_logger.filters:
        rerun_logger.addFilter(_not_a_rerun_state_machine_notice)
    cpu_bridge.silence_cpu_notices()


def initialize(parallel: ParallelConfig) -> int:
    """Start the process group and megatron-core parallel state; returns the data-parallel size."""
    from megatron.core import parallel_state

    if not parallel.timeout_s > 0:
        raise ConfigError(f"parallel.timeout_s must be > 0 seconds, got {parallel.timeout_s}")
    cpu_bridge.apply()
    processes.prepare()  # checkpoint writers and forked helpers never outlive this process
    rank, local_rank, world = rank_and_world_from_env()
    dp_size = parallel.data_parallel_size(world)
    if parallel.virtual_pipeline_model_parallel_size and parallel.pipeline_model_parallel_size < 2:
        raise ConfigError("virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size >= 2")
    if not dist.is_initialized():
        if world == 1 and "MASTER_PORT" not in os.environ:
            # A lone process picks its own free port, without writing it into os.environ, where
            # child processes would inherit it and collide with it.
            host, port = "127.0.0.1", 0
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if not cpu_bridge.needed():
            torch.cuda.set_device(local_rank)
        timeout = datetime.timedelta(seconds=parallel.timeout_s)
        keep_gloo_on_loopback(host)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            rendezvous = {"init_method": "env://"}  # torchrun's agent hosts the store; every rank is its client
        else:
            rendezvous = {"store": rendezvous_store(host, port, rank, world, timeout)}
        dist.init_process_group(backend=backend(), rank=rank, world_size=world, timeout=timeout, **rendezvous)
        _register_shutdown_at_exit()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        distributed_timeout_minutes=parallel.timeout_s / 60,  # every group megatron makes
    )
    return dp_size


# What gloo says when a peer is gone: its process died (the kernel closed its sockets: "Connection closed by peer
# [10.0.0.2]:port", "Read error [10.0.0.2]:port: Connection reset by peer"), or nothing came within the timeout (a
# lost node, a cut link: "Timed out ...", "Read timeout [10.0.0.2]:port"). The peer's address is in brackets.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|[Tt]imed out|[Tt]imeout")
_PEER_ADDRESS = re.compile(r"\[([0-9a-fA-F.:]+)\]:\d+")


def lost_peer(error: BaseException) -> Optional[str]:
    """One line for a collective that failed because a peer rank is gone, naming the peer's host and address;
    None for any other error."""
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    gone, address = _PEER_GONE.search(text), _PEER_ADDRESS.search(text)
    if gone is None:
        return None
    timed_out = "imeout" in gone.group(0) or "imed out" in gone.group(0)
    if address is None:
        if not timed_out:
            return None
        return ("lost a peer rank: a collective got no answer from a peer within parallel.timeout_s; its node or "
                "process failed, or the network between them; the run stops here (resume from the newest checkpoint)")
    import socket

    try:
        host = socket.gethostbyaddr(address.group(1))[0]
    except OSError:
        host = None
    peer = f"{host} ({address.group(1)})" if host else address.group(1)
    how = "gave no answer within parallel.timeout_s" if timed_out else f"went away ({gone.group(0).lower()})"
    return (f"lost a peer rank: the rank on {peer} {how}; its node or process failed, or the network between "
            "them; the run stops here (resume from the newest checkpoint)")


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


_exit_hook_registered = False
_exiting_on_error = False


def exiting_on_error() -> None:
    """Skip the teardown at exit: this process is ending on an error (see below)."""
    global _exiting_on_error
    _exiting_on_error = True


def _register_shutdown_at_exit() -> None:
    """Destroy the process groups before the interpreter is torn down.

    A process that exits with a live gloo group can die with SIGABRT ("terminate called without
    an active exception"): gloo's worker threads still hold tensors when finalisation frees them
    (pytorch/pytorch#190489). The hook runs only after a clean exit: a rank that failed (an
    uncaught exception, or `exiting_on_error`) must not wait on a teardown its peers may never reach.
    """
    global _exit_hook_registered
    if _exit_hook_registered:
        return
    _exit_hook_registered = True
    previous_hook = sys.excepthook

    def note_uncaught(exc_type, exc, tb):
        exiting_on_error()
        previous_hook(exc_type, exc, tb)

    sys.excepthook = note_uncaught
    atexit.register(lambda: None if _exiting_on_error else shutdown())


def is_rank_zero() -> bool:
    """Rank 0 of the job; before the process group starts, by the launcher's variables (torchrun's, Slurm's)."""
    return dist.get_rank() == 0 if dist.is_initialized() else rank_and_world_from_env()[0] == 0


def stream_address(host: str, port: Optional[int], setting: str, hint: str = "",
                   error: type[UserError] = ConfigError) -> tuple:
    """(family, type, proto, socket address) of `host`'s first stream-socket address: the one place a host
    name is resolved (the rendezvous, gloo's interface, Triton's bind address). A name that does not resolve
    raises `error` in one line naming `setting`, followed by `hint`."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as failure:
        raise error(f"{setting}={host!r} does not resolve ({failure.strerror})" + (f"; {hint}" if hint else "")) \
            from None
    return family, kind, proto, address


def rendezvous_store(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The job's TCPStore at host:port, hosted by rank 0 on a socket bound to `host` only.

    torch's TCPStore server listens on every interface whatever host it is given; handed a socket
    (`master_listen_fd`), it listens where that socket is bound. port 0 (rank 0 of a lone process):
    a free port.
    """
    if rank != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    family, kind, proto, address = stream_address(
        host, port, "MASTER_ADDR", "set it to this machine's address (127.0.0.1 for a job on one machine)")
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: TIME_WAIT is fine
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise ConfigError(f"cannot listen on {host}:{port} for the job's rendezvous (MASTER_ADDR:MASTER_PORT): "
                          f"{error.strerror}; another job may use that port, choose another MASTER_PORT") from None
    bound_port = listener.getsockname()[1]
    # The store owns the descriptor from here on (detach: the socket object must not close it).
    return dist.TCPStore(host, bound_port, world, is_master=True, timeout=timeout, master_listen_fd=listener.detach())


def keep_gloo_on_loopback(master_addr: str) -> None:
    """gloo listens on the address this machine's hostname resolves to, which may face the network;
    a job whose rendezvous is on loopback runs on one machine, so its gloo sockets stay on loopback
    too (GLOO_SOCKET_IFNAME, unless the user set it)."""
    import ipaddress

    if "gloo" not in backend() or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        resolved = ipaddress.ip_address(stream_address(master_addr, None, "MASTER_ADDR")[3][0].split("%")[0])
    except (UserError, ValueError):
        return  # rendezvous_store reports an address that does not resolve
    if not resolved.is_loopback:
        return
    import psutil

    for interface, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            try:
                candidate = ipaddress.ip_address(address.address.split("%")[0])
            except ValueError:  # a link-layer address
                continue
            if candidate.is_loopback and candidate.version == resolved.version:
                os.environ["GLOO_SOCKET_IFNAME"] = interface
                return


_PRECISION_DTYPES = {"fp32": torch.float32, "32": torch.float32, "bf16": torch.bfloat16, "bf16-mixed": torch.bfloat16}
PRECISIONS = ("auto", *_PRECISION_DTYPES)  # the `precision` setting's values


def resolve_precision(name: str) -> "torch.dtype":
    """`auto` is fp32 on CPU (exact, and the only fast choice on CPUs without bf16 instructions) and bf16
    mixed precision on GPU; bf16 on a CPU is an opt-in (bf16 weights and compute, fp32 main copy in the optimizer)."""
    if name == "auto":
        return torch.float32 if cpu_bridge.needed() else torch.bfloat16
    if name not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
    dtype = _PRECISION_DTYPES[name]
    if dtype == torch.bfloat16 and cpu_bridge.needed() and not cpu_bridge.cpu_has_bf16_instructions():
        warnings.warn(f"precision={name} on a CPU without {' or '.join(cpu_bridge.BF16_CPU_FLAGS)}: torch emulates "
                      "bf16 there, slower than fp32", stacklevel=2)
    return dtype


def pad_multiple(setting: "int | None") -> int:
    """Rows of a batch are padded to a multiple of this many tokens. `setting` null: 8 on GPU (token
    counts aligned for tensor-core GEMMs); on CPU, where a padded slot is work and nothing else (the
    demo's SFT step: 0.143 -> 0.093 s, rows of ~10 tokens padded to 16 before), the tensor-parallel
    size once the process groups exist (sequence parallelism splits the sequence over those ranks), else 1.
    (Experts split over ranks need equal lengths on every rank: `longest_across_expert_ranks`.)"""
    if setting is not None:
        return setting
    if not cpu_bridge.needed():
        return 8
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def longest_across_expert_ranks(length: int) -> int:
    """A micro batch's row length, made the same on every data-parallel rank where experts are split
    over them (EP > 1): the largest rank's. megatron's allgather token dispatcher gathers equally many
    tokens from each rank (rows per micro batch are equal; their lengths follow each rank's data)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_expert_model_parallel_world_size() == 1:
        return length
    value = torch.tensor([length], device=device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return int(value.item())


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a tensor for offloading: pinned when the model is on a GPU (fast, async-capable
    copies back), plain memory on CPU (pinning needs CUDA)."""
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=not cpu_bridge.needed())
    copy.copy_(tensor.detach())
    return copy


def supports_distributed_optimizer() -> bool:
    """megatron's distributed optimizer needs CUDA tensors and reduce-scatter (not in gloo)."""
    return not cpu_bridge.needed()
