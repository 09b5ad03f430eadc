"""The CPU bridge for megatron-core: lets the unchanged megatron-core code path run without CUDA.

megatron-core assumes CUDA in a handful of places (facts measured in shared/ENVIRONMENT.md for
megatron-core 0.16.1). On a machine without CUDA, `apply()` patches exactly those places and
nothing else, so the GPU path is untouched and the CPU path runs the same schedules, layers,
DDP buffers and checkpointing code:

1. `GlobalMemoryBuffer.get_tensor` (attention scratch space) allocates on `current_device()`;
   it is re-pointed to the CPU.
2. The model-parallel RNG tracker reads and writes the CUDA generator; the CUDA RNG entry points
   it uses are mapped onto the CPU default generator (forking semantics are preserved).
3. Pipeline schedules, p2p communication, DDP grad buffers and checkpoint loading create tensors
   with a literal `device="cuda"` or `torch.cuda.current_device()`. A `TorchFunctionMode` that
   rewrites such device arguments to CPU is entered *only* around those entry points, because a
   global mode costs ~20-40 % on every torch call (see benchmarks/bridge_overhead.py); a model
   forward called directly (generation, single-stage evaluation) never pays for it.

4. megatron's linear layers (ColumnParallelLinear, RowParallelLinear, the output layer, tied or
   not) multiply with `torch.matmul`, which for fp32 on CPU is MKL; on CPUs where MKL is the slower
   (`cpu_products.preferred_library()`: 1.5-5x per product on SmolLM2's shapes on an AMD EPYC) their
   forward and backward products go through oneDNN instead, with megatron's tensor-parallel
   semantics (the input-gradient all-reduce of a column-parallel layer). Sequence parallelism,
   gradient-accumulation fusion (CUDA only) and deferred embedding wgrad keep megatron's own path,
   as do other dtypes.

5. glibc's malloc returns every freed block above its mmap threshold (at most 32 MB) to the kernel
   and maps it afresh at the next allocation, so each step's large tensors (logits, their gradients,
   activations) fault in page by page, hundreds of thousands of faults per step at SmolLM2's size.
   On CPU the allocator keeps freed memory for reuse instead (`reuse_freed_memory`).

6. Checkpoint loading and saving (`dist_checkpointing`) run torch ops on helper threads (its file
   reader threads, gloo's workers for the plan all-gathers). A helper thread that runs a parallel
   loop (a copy of more than 32768 elements) starts an OpenMP team of its own; libgomp then manages
   more threads than the machine has CPUs and from then on lets every idle worker spin ~100 times
   instead of ~300000 before it sleeps, so each later parallel region of the main thread wakes its
   worker through the kernel. On 2 cores every torch op that went parallel, however small, then took
   ~90 us longer for the rest of the process (a SmolLM2 decode step has ~270 of them). A thread's
   team size is fixed at its first parallel loop from the intra-op thread count of that moment, so
   load and save run with one intra-op thread (`one_intra_op_thread`): their helper threads never
   start a team. On SmolLM2 a load took 0.90 s instead of 0.82 s, a save 0.9 s as before.

Besides the patches it says what else differs without CUDA: the start-up notices to silence
(`silence_cpu_notices`) and the TransformerConfig and Triton settings a CPU machine needs.
This module is the only place in the project that knows about these differences.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

from aligner.runtime import cpu_products
from aligner.runtime.errors import ConfigError

SUPPORTED_MEGATRON_CORE = "0.16.1"

_applied = False
_lock = threading.Lock()


def needed() -> bool:
    """True when there is no CUDA device, i.e. when the bridge must be applied."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _applied


def silence_cpu_notices() -> None:
    """Without CUDA, hide megatron-core's import-time notices that apex/transformer-engine are missing.

    Their fused kernels cannot exist on such a machine, so the notices (four on every start) say
    nothing a user can act on; with CUDA they stay, since there installing them is a real option.
    Called (through `distributed.silence_third_party_notices`) before megatron-core is imported.
    """
    if needed():
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")


def triton_config_overrides() -> dict:
    """PyTriton `TritonConfig` settings this machine needs (empty with CUDA).

    Triton's GPU metrics start NVML and DCGM, which without a GPU print "Error: Failed to
    initialize NVML" and a DCGM warning on every server start; CPU metrics stay on.
    """
    return {"allow_gpu_metrics": False} if needed() else {}


def transformer_config_overrides() -> dict:
    """TransformerConfig settings the gloo backend needs (empty with CUDA/NCCL).

    batch_p2p_comm: megatron's batched p2p posts all sends/receives of a step as one batch. Under
    an interleaved (virtual) pipeline with two stages a rank receives two same-shaped messages
    from the same peer in one batch (next chunk's activations and previous chunk's gradients);
    NCCL groups match them, gloo matches by posting order and can swap them (silently wrong
    losses, caught by tests/distributed/test_sft_parity.py). The non-batched path orders sends
    and receives by even/odd rank and is exact on gloo.
    """
    return {"batch_p2p_comm": False} if needed() else {}


def check_moe_token_dispatcher(dispatcher: str) -> None:
    """Refuse an MoE token dispatcher that cannot run without CUDA.

    megatron-core's alltoall dispatcher creates and synchronises on CUDA streams
    (`torch.cuda.Stream()` in its constructor); the allgather dispatcher is plain collectives
    (all-gather, reduce-scatter), which gloo has, also across expert-parallel ranks.
    """
    if needed() and dispatcher == "alltoall":
        raise ConfigError(
            "model.moe_token_dispatcher_type=alltoall needs CUDA (megatron-core's alltoall dispatcher "
            "synchronises on CUDA streams); use moe_token_dispatcher_type=allgather on CPU"
        )


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with native bf16 matmuls


def cpu_has_bf16_instructions(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bf16 natively (without it torch emulates bf16 and it is slower than fp32)."""
    flags = cpu_products.cpu_info("flags", cpuinfo).split()
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):
        return True  # a bare int means a CUDA ordinal to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites `device=cuda`/`device=<int>` keyword arguments to CPU and makes `.cuda()` a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device="cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # megatron's mixed-precision optimizer sorts parameters by their CUDA type name
            # ("torch.cuda.BFloat16Tensor"); a CPU tensor answers that name inside this scope.
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu():
    """Scope in which megatron-core's literal CUDA allocations land on the CPU (no-op with CUDA)."""
    if not _applied:
        yield
        return
    with CudaToCpuMode():
        yield


def _scoped(fn: Callable) -> Callable:
    """Wrap a megatron-core entry point so its body runs inside `cuda_to_cpu()`."""
    if getattr(fn, "_aligner_bridged", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    wrapper._aligner_bridged = True
    return wrapper


def one_intra_op_thread(fn: Callable) -> Callable:
    """fn run with torch's intra-op thread count at 1, restored after: the helper threads fn starts
    (or wakes for the first time) run their parallel loops serially for good (patch 6)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    wrapper.one_intra_op_thread = True
    return wrapper


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required_len = 1
    for dim in tensor_shape:
        required_len *= dim
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required_len:
        buffer = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buffer
    return buffer[0:required_len].view(*tensor_shape)


def _cpu_get_rng_state(device="cuda", clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _cpu_clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron's clip asserts `torch.cuda.FloatTensor` grads; same scaling, any device."""
    attribute = "decoupled_grad" if use_decoupled_grad else "grad"
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [getattr(p, attribute) for p in parameters if getattr(p, attribute, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


@functools.lru_cache(maxsize=32)
def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


class _OneDnnLinear(torch.autograd.Function):
    """megatron's LinearWithGradAccumulationAndAsyncCommunication (no sequence parallelism,
    gradient-accumulation fusion or deferred wgrad) with oneDNN's products, on input rows [rows, in].

    Rows in, rows out: the caller reshapes outside the Function, so its output is no view made inside a
    custom Function, and views of it (the logits' [b, s] order) may be changed in place like any tensor."""

    @staticmethod
    def forward(ctx, input_2d, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(input_2d, weight)
        ctx.use_bias = bias is not None
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        return cpu_products.linear(input_2d, weight, bias)

    @staticmethod
    def backward(ctx, grad_output_2d):
        input_2d, weight = ctx.saved_tensors
        grad_input = cpu_products.grad_input(grad_output_2d, weight)
        handle = None
        if ctx.allreduce_dgrad:  # overlaps the weight-gradient product, as in megatron
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = cpu_products.grad_weight(grad_output_2d, input_2d)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None


class _OneDnnLinearFrozenWeight(torch.autograd.Function):
    """megatron's LinearWithFrozenWeight (no sequence parallelism) with oneDNN's products, rows in and out."""

    @staticmethod
    def forward(ctx, input_2d, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        return cpu_products.linear(input_2d, weight, bias)

    @staticmethod
    def backward(ctx, grad_output_2d):
        (weight,) = ctx.saved_tensors
        grad_input = cpu_products.grad_input(grad_output_2d, weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None


def _rows_to_shape(output_2d: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """[rows, out] -> [*input.shape[:-1], out] as a tensor of its own, not a view (as torch.matmul returns
    it): megatron's vocab-parallel cross entropy changes the output layer's logits in place."""
    return torch.ops.aten._unsafe_view(output_2d, (*input.shape[:-1], output_2d.shape[-1]))


def _onednn_applies(input, weight, gradient_accumulation_fusion, sequence_parallel, grad_output_buffer) -> bool:
    return (not gradient_accumulation_fusion and not sequence_parallel and grad_output_buffer is None
            and weight.dtype == input.dtype and cpu_products.onednn_preferred(input.device, input.dtype))


def _onednn_linear_layers(mcore_layers) -> tuple:
    """Replacements for megatron's two linear-layer entry points, falling back to them where oneDNN does not apply."""
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    trainable = mcore_layers.linear_with_grad_accumulation_and_async_allreduce
    frozen = mcore_layers.linear_with_frozen_weight
    if getattr(trainable, "_aligner_bridged", False):  # apply() re-run: already replaced
        return trainable, frozen

    @functools.wraps(trainable)
    def linear_with_grad_accumulation_and_async_allreduce(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer=None, wgrad_deferral_limit=0, async_grad_allreduce=None, tp_group=None,
    ):
        if async_grad_allreduce is not None or not _onednn_applies(
                input, weight, gradient_accumulation_fusion, sequence_parallel, grad_output_buffer):
            return trainable(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                             grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce, tp_group)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group) if allreduce_dgrad else None
        output = _OneDnnLinear.apply(input.reshape(-1, input.shape[-1]), weight, bias, allreduce_dgrad, tp_group)
        return _rows_to_shape(output, input)

    @functools.wraps(frozen)
    def linear_with_frozen_weight(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel, tp_group,
        grad_output_buffer=None, wgrad_deferral_limit=None, async_grad_allreduce=None,
    ):
        if (async_grad_allreduce is not None or wgrad_deferral_limit is not None or not _onednn_applies(
                input, weight, gradient_accumulation_fusion, sequence_parallel, grad_output_buffer)):
            return frozen(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                          tp_group, grad_output_buffer, wgrad_deferral_limit, async_grad_allreduce)
        tp_group = get_tensor_model_parallel_group_if_none(tp_group) if allreduce_dgrad else None
        output = _OneDnnLinearFrozenWeight.apply(input.reshape(-1, input.shape[-1]), weight, bias, allreduce_dgrad,
                                                 tp_group)
        return _rows_to_shape(output, input)

    linear_with_grad_accumulation_and_async_allreduce._aligner_bridged = True
    linear_with_frozen_weight._aligner_bridged = True
    return linear_with_grad_accumulation_and_async_allreduce, linear_with_frozen_weight


_GLIBC_M_TRIM_THRESHOLD, _GLIBC_M_MMAP_MAX = -1, -4  # mallopt parameters (malloc.h)
# What `reuse_freed_memory` sets: no mmap per large block, no trimming below 2 GiB free at the heap's top.
MALLOC_MMAP_MAX, MALLOC_TRIM_THRESHOLD = 0, 2**31 - 1


def glibc_tunables() -> str:
    """`reuse_freed_memory`'s settings as glibc reads them from the environment at a process's start
    (GLIBC_TUNABLES): how a process that does not call it (a peer's, in a benchmark) gets the same allocator."""
    return f"glibc.malloc.mmap_max={MALLOC_MMAP_MAX}:glibc.malloc.trim_threshold={MALLOC_TRIM_THRESHOLD}"


def mark_written(tensor: torch.Tensor) -> None:
    """Move the tensor's version counter on, as an in-place write does, without touching its values (an
    in-place write of an empty slice): for writes torch does not count, so caches keyed by the counter
    (the native engine's packed weights) see them."""
    with torch.no_grad():
        tensor.narrow(0, 0, 0).zero_()


def reuse_freed_memory() -> bool:
    """Make glibc's malloc serve every allocation from its heap and keep freed memory there (no mmap per
    large block, no trimming below 2 GiB of free space at the top of the heap). Returns whether it applied
    (glibc only). Freed memory stays in the process for the next allocations instead of going back to the
    kernel: the resident set no longer shrinks between phases, and a later block reuses it without faults."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL("libc.so.6")
    return (bool(libc.mallopt(_GLIBC_M_MMAP_MAX, MALLOC_MMAP_MAX))
            and bool(libc.mallopt(_GLIBC_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)))


def apply() -> bool:
    """Apply the bridge if there is no CUDA. Idempotent. Returns whether the bridge is active."""
    global _applied
    if not needed():
        return False
    with _lock:
        if _applied:
            return True
        cpu_products.preferred_library()  # a bad ALIGNER_CPU_PRODUCTS is reported here, before any patch
        import importlib

        import megatron.core
        import megatron.core.utils as mcore_utils
        from megatron.core.distributed import distributed_data_parallel as mcore_ddp
        from megatron.core.pipeline_parallel import schedules
        from megatron.core.tensor_parallel import random as mcore_random

        mcore_finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        from megatron.core import dist_checkpointing

        version = getattr(megatron.core, "__version__", "unknown")
        if version != SUPPORTED_MEGATRON_CORE:
            warnings.warn(
                f"aligner's CPU bridge was written for megatron-core {SUPPORTED_MEGATRON_CORE}, "
                f"found {version}; run tests/unit/test_cpu_bridge.py to see what changed.",
                stacklevel=2,
            )

        # 1. Attention scratch buffers.
        mcore_utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor

        # Causal mask that local attention builds when it is given none.
        import megatron.core.fusions.fused_softmax as mcore_fused_softmax
        import megatron.core.transformer.utils as mcore_transformer_utils

        mcore_transformer_utils.get_default_causal_mask = _cpu_default_causal_mask
        mcore_fused_softmax.get_default_causal_mask = _cpu_default_causal_mask

        # 2. RNG: the tracker calls these torch.cuda functions and megatron's private helpers.
        # The tracker's "CUDA" stream is the CPU generator here, so megatron's check that the CPU
        # stream did not move inside a fork fires on every dropout draw: expected, not news.
        import logging

        logging.getLogger(mcore_random.__name__).addFilter(
            lambda record: "CPU RNG state changed within GPU RNG context" not in record.getMessage()
        )
        mcore_random._get_cuda_rng_state = _cpu_get_rng_state
        mcore_random._set_cuda_rng_state = _cpu_set_rng_state
        torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
        torch.cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
        # (torch.manual_seed itself calls torch.cuda.manual_seed_all, so that one stays as it is.)
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))

        # 3. Literal CUDA allocations inside schedules, DDP buffers, grad finalisation, checkpoints.
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        for name in (
            "forward_backward_no_pipelining",
            "forward_backward_pipelining_without_interleaving",
            "forward_backward_pipelining_with_interleaving",
        ):
            setattr(schedules, name, _scoped(getattr(schedules, name)))
        # Tied embeddings across pipeline stages: the last stage's copy is made with `.cuda()`.
        from megatron.core.models.common.language_module.language_module import LanguageModule

        LanguageModule.setup_embeddings_and_output_layer = _scoped(LanguageModule.setup_embeddings_and_output_layer)
        mcore_ddp.DistributedDataParallel.__init__ = _scoped(
            mcore_ddp.DistributedDataParallel.__init__
        )
        mcore_finalize.finalize_model_grads = _scoped(mcore_finalize.finalize_model_grads)
        import megatron.core.distributed as mcore_distributed

        mcore_distributed.finalize_model_grads = mcore_finalize.finalize_model_grads
        from megatron.core.optimizer import optimizer as mcore_optimizer

        # The fp32 optimizer wrapper (torch AdamW inside) allocates its scale and the grad-norm
        # scratch tensors on CUDA; its arithmetic is device-agnostic.
        mcore_optimizer.clip_grad_by_total_norm_fp32 = _cpu_clip_grad_by_total_norm_fp32
        # Grad norm / zero counting, also callable outside step() (e.g. for logging).
        mcore_optimizer.get_grad_norm_fp32 = _scoped(mcore_optimizer.get_grad_norm_fp32)
        mcore_optimizer.count_zeros_fp32 = _scoped(mcore_optimizer.count_zeros_fp32)
        for cls in (mcore_optimizer.FP32Optimizer, mcore_optimizer.ChainedOptimizer,
                    mcore_optimizer.MixedPrecisionOptimizer, mcore_optimizer.Float16OptimizerWithFloat16Params):
            cls.__init__ = _scoped(cls.__init__)
            cls.step = _scoped(cls.step)
        # 6. (below) and 3.
        dist_checkpointing.load = _scoped(one_intra_op_thread(dist_checkpointing.load))
        dist_checkpointing.save = _scoped(one_intra_op_thread(dist_checkpointing.save))

        # 4. Linear-layer products on oneDNN (the layers call these module globals at every forward).
        from megatron.core.tensor_parallel import layers as mcore_layers


        (mcore_layers.linear_with_grad_accumulation_and_async_allreduce,
         mcore_layers.linear_with_frozen_weight) = _onednn_linear_layers(mcore_layers)
        # 5. Freed memory reused without page faults.
        reuse_freed_memory()
        _applied = True
        return True
