"""The megatron-core CPU bridge (aligner/runtime/cpu_bridge.py): each patch does its job.

Every test checks a behaviour megatron-core 0.16.1 needs on a machine without CUDA and, where it
can be checked in-process, that megatron's own code really fails there without the patch; so a
megatron-core upgrade shows here exactly which patch broke or became unnecessary.
One process, world size 1 on gloo.
"""
from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from aligner.runtime import cpu_bridge

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the bridge only applies without CUDA"),
    pytest.mark.usefixtures("single_process"),
]

# torch raises AssertionError("Torch not compiled with CUDA enabled") on a CPU-only build and
# RuntimeError on a CUDA build without a device.
NO_CUDA_ERRORS = (AssertionError, RuntimeError)

VOCAB = 64
SEQ = 12




def _bridge_modes() -> list:
    return [mode for mode in _get_current_function_mode_stack() if isinstance(mode, cpu_bridge.CudaToCpuMode)]


def _tiny_gpt(seed: int = 0):
    """A 2-layer, 32-wide GPTModel (local spec, fp32) with a 64-token vocabulary."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from aligner.models.gpt import GPTConfig, build_gpt_model, transformer_config

    model_parallel_cuda_manual_seed(seed)  # attention forks the tracker's stream even in eval
    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
        make_vocab_size_divisible_by=8, max_position_embeddings=32,
    )
    return build_gpt_model(cfg, transformer_config(cfg))


def _wrap_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(model.config, ddp_config, model)


def _microbatches(valid_tokens: tuple[int, ...], batch: int = 2, seed: int = 1) -> list[dict]:
    """Random micro batches whose loss masks keep `valid_tokens[i]` tokens of micro batch i."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for count in valid_tokens:
        mask = torch.zeros(batch * SEQ)
        mask[:count] = 1.0
        batches.append({
            "tokens": torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (batch, SEQ), generator=generator),
            "loss_mask": mask.view(batch, SEQ),
            "position_ids": torch.arange(SEQ).expand(batch, -1),
        })
    return batches


def _masked_token_loss_sum(batch: dict, logits: torch.Tensor) -> torch.Tensor:
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1),
                                reduction="none")
    return (per_token * batch["loss_mask"].reshape(-1)).sum()


def _schedule_forward_backward(ddp_model, microbatches: list[dict]) -> list[dict]:
    """Forward+backward through megatron's schedule with the per-token loss convention."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = ddp_model.config
    config.finalize_model_grads_func = finalize_model_grads  # divides grads by the total token count
    config.no_sync_func = ddp_model.no_sync

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        logits = model(batch["tokens"], batch["position_ids"], None)  # [batch, seq, vocab]

        def loss_func(output):
            loss_sum = _masked_token_loss_sum(batch, output)
            return loss_sum, batch["loss_mask"].sum().to(torch.int), {"loss_sum": loss_sum.detach()}

        return logits, loss_func

    ddp_model.train()
    ddp_model.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=[ddp_model],
        num_microbatches=len(microbatches),
        seq_length=SEQ,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=False,
    )


# --- apply() and the version check -------------------------------------------------------------

def test_apply_is_idempotent_and_active_without_cuda():
    assert cpu_bridge.needed()
    assert cpu_bridge.apply() is True
    assert cpu_bridge.apply() is True
    assert cpu_bridge.is_applied()


def test_apply_wraps_each_entry_point_once():
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed import finalize_model_grads as exported_finalize
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import layers

    entry_points = [
        schedules.forward_backward_no_pipelining,
        schedules.forward_backward_pipelining_without_interleaving,
        schedules.forward_backward_pipelining_with_interleaving,
        LanguageModule.setup_embeddings_and_output_layer,  # tied embeddings' `.cuda()` at PP > 1
        DistributedDataParallel.__init__,
        exported_finalize,
        FP32Optimizer.__init__, FP32Optimizer.step,
        ChainedOptimizer.__init__, ChainedOptimizer.step,
        dist_checkpointing.save, dist_checkpointing.load,
        layers.linear_with_grad_accumulation_and_async_allreduce, layers.linear_with_frozen_weight,
    ]
    cpu_bridge.apply()
    for entry_point in entry_points:
        assert getattr(entry_point, "_aligner_bridged", False), entry_point
        # A second apply() must not stack a second mode around the same function.
        assert not getattr(entry_point.__wrapped__, "_aligner_bridged", False), entry_point


def test_gloo_transformer_config_overrides():
    """gloo matches batched p2p messages by posting order, so the bridge turns batching off."""
    from aligner.models.gpt import GPTConfig, transformer_config

    assert cpu_bridge.transformer_config_overrides() == {"batch_p2p_comm": False}
    assert transformer_config(GPTConfig(vocab_size=VOCAB)).batch_p2p_comm is False


def test_alltoall_moe_dispatcher_is_refused_without_cuda_and_allgather_is_used():
    """megatron's alltoall token dispatcher builds CUDA streams; allgather is plain collectives (gloo has them)."""
    from aligner.models.gpt import GPTConfig, transformer_config

    moe = GPTConfig(vocab_size=VOCAB, num_moe_experts=4)
    assert transformer_config(moe).moe_token_dispatcher_type == "allgather"  # the default
    with pytest.raises(ValueError,
                       match="moe_token_dispatcher_type=alltoall needs CUDA.*use moe_token_dispatcher_type=allgather"):
        transformer_config(GPTConfig(vocab_size=VOCAB, num_moe_experts=4, moe_token_dispatcher_type="alltoall"))


def test_version_check_names_the_supported_megatron_core(monkeypatch):
    import megatron.core

    # Re-run apply() as on first use: it re-assigns the same patches (wrappers are not re-wrapped).
    monkeypatch.setattr(cpu_bridge, "_applied", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_bridge.apply() is True
    assert not [w for w in caught if "CPU bridge" in str(w.message)], "warned on the supported version"

    monkeypatch.setattr(cpu_bridge, "_applied", False)
    monkeypatch.setattr(megatron.core, "__version__", "0.99.0")
    with pytest.warns(UserWarning, match="CPU bridge") as record:
        assert cpu_bridge.apply() is True
    message = str(record[0].message)
    assert cpu_bridge.SUPPORTED_MEGATRON_CORE == "0.16.1"
    assert "megatron-core 0.16.1" in message and "0.99.0" in message
    assert "tests/unit/test_cpu_bridge.py" in message


# --- the cuda_to_cpu() scope ---------------------------------------------------------------------

def test_cuda_to_cpu_rewrites_cuda_devices_inside_the_scope():
    host = torch.arange(3.0)
    with cpu_bridge.cuda_to_cpu():
        assert len(_bridge_modes()) == 1
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.empty(3, device=0).device.type == "cpu"  # a bare int is a CUDA ordinal
        assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert torch.tensor([1.0], device="cuda:0").device.type == "cpu"
        assert host.new_zeros(4, device="cuda").device.type == "cpu"
        assert host.cuda() is host
        assert host.to("cuda").device.type == "cpu"
        assert host.to(device="cuda").device.type == "cpu"
        as_double = host.to("cuda", torch.float64)
        assert as_double.device.type == "cpu" and as_double.dtype == torch.float64
        assert torch.equal(as_double, host.double())
        assert host.to(torch.float16).dtype == torch.float16  # non-device arguments pass through
        assert torch.zeros(2, device="meta").device.type == "meta"  # other devices are left alone


def test_cuda_to_cpu_leaves_nothing_active_outside_the_scope():
    host = torch.ones(2)
    assert _bridge_modes() == []
    with pytest.raises(ValueError):
        with cpu_bridge.cuda_to_cpu():
            raise ValueError("leaving the scope by an exception must also pop the mode")
    assert _bridge_modes() == []
    with pytest.raises(NO_CUDA_ERRORS):
        torch.zeros(1, device="cuda")
    with pytest.raises(NO_CUDA_ERRORS):
        host.cuda()
    with pytest.raises(NO_CUDA_ERRORS):
        host.to("cuda")


def test_cuda_and_rng_globals_are_mapped_to_cpu():
    assert torch.cuda.current_device() == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    torch.cuda.synchronize()  # a no-op, not an error
    torch.cuda.manual_seed(5)
    from_cuda_seed = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(from_cuda_seed, torch.rand(3))
    state = torch.cuda.get_rng_state()
    first = torch.rand(3)
    torch.cuda.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    # What megatron's own `_get_cuda_rng_state` calls, unpatched: it fails on this machine.
    with pytest.raises(NO_CUDA_ERRORS):
        torch.cuda.random.get_rng_state()


# --- attention scratch buffers and the default causal mask ---------------------------------------

def test_global_memory_buffer_is_on_cpu_and_reused_per_name():
    from megatron.core.utils import GlobalMemoryBuffer

    buffer = GlobalMemoryBuffer()
    first = buffer.get_tensor((4, 6), torch.float32, "scores")
    assert first.device.type == "cpu" and first.shape == (4, 6)
    smaller = buffer.get_tensor((2, 3), torch.float32, "scores")
    assert smaller.data_ptr() == first.data_ptr()  # same storage, no new allocation
    other_name = buffer.get_tensor((4, 6), torch.float32, "values")
    assert other_name.data_ptr() != first.data_ptr()
    other_dtype = buffer.get_tensor((4, 6), torch.float64, "scores")
    assert other_dtype.dtype == torch.float64 and other_dtype.data_ptr() != first.data_ptr()
    larger = buffer.get_tensor((8, 8), torch.float32, "scores")
    assert larger.shape == (8, 8) and larger.numel() == 64  # grown, not a view past the end


def test_gpt_forward_is_causal_outside_any_scope():
    """Local attention builds its default causal mask with device="cuda" when given no mask."""
    from megatron.core.transformer.utils import get_default_causal_mask

    assert torch.equal(get_default_causal_mask(3), torch.tensor([[0, 1, 1], [0, 0, 1], [0, 0, 0]], dtype=torch.bool))
    model = _tiny_gpt().eval()
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6).expand(2, -1)
    changed = tokens.clone()
    changed[:, 4] = (changed[:, 4] + 1) % VOCAB
    with torch.no_grad():
        assert _bridge_modes() == []
        logits = model(tokens, positions, None)  # [batch, seq, vocab]
        logits_changed = model(changed, positions, None)
        with cpu_bridge.cuda_to_cpu():
            logits_in_scope = model(tokens, positions, None)
    assert logits.shape == (2, 6, VOCAB)
    torch.testing.assert_close(logits_changed[:, :4], logits[:, :4], rtol=0, atol=0)
    assert not torch.allclose(logits_changed[:, 4:], logits[:, 4:])
    torch.testing.assert_close(logits_in_scope, logits, rtol=0, atol=0)


# --- the model-parallel RNG tracker on the CPU generator ----------------------------------------

def test_rng_tracker_fork_is_reproducible_separate_and_restores_the_default_stream():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    tracker = get_cuda_rng_tracker()
    default_state = torch.get_rng_state()
    with tracker.fork():
        forked = torch.rand(8)
    assert torch.equal(torch.get_rng_state(), default_state)
    default = torch.rand(8)

    torch.manual_seed(1234)  # the default (data-parallel) stream is seeded with the seed itself
    assert torch.equal(default, torch.rand(8))
    assert not torch.allclose(forked, default)

    model_parallel_cuda_manual_seed(1234)
    with tracker.fork():
        first_half = torch.rand(4)
    torch.rand(100)  # draws on the default stream in between do not move the forked one
    with tracker.fork():
        second_half = torch.rand(4)
    assert torch.equal(torch.cat([first_half, second_half]), forked)


def test_rng_tracker_states_round_trip():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(7)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        torch.rand(5)  # advance past the seed so the round trip is not just a re-seed
    saved_states = tracker.get_states()
    with tracker.fork():
        forked = torch.rand(5)

    tracker.set_states(saved_states)
    torch.rand(3)  # the default stream moves on; the restored forked stream must not depend on it
    with tracker.fork():
        assert torch.equal(torch.rand(5), forked)


# --- schedules, DDP, per-token loss and the fp32 optimizer ---------------------------------------

def test_schedule_needs_the_scope():
    from megatron.core.pipeline_parallel import schedules

    model = _tiny_gpt()
    unbridged = schedules.forward_backward_no_pipelining.__wrapped__
    with pytest.raises(NO_CUDA_ERRORS):  # megatron allocates its token counter with device="cuda"
        unbridged(
            forward_step_func=None, data_iterator=iter([]), model=[model], num_microbatches=1,
            seq_length=SEQ, micro_batch_size=1, forward_only=True,
        )


def test_per_token_loss_gradients_match_a_single_batch_reference():
    """Two micro batches with different token counts: grads equal sum(loss) / total tokens."""
    microbatches = _microbatches(valid_tokens=(5, 19))
    reference = _tiny_gpt(seed=0).train()
    model = _tiny_gpt(seed=0)
    model.load_state_dict(reference.state_dict())
    ddp_model = _wrap_ddp(model)

    reports = _schedule_forward_backward(ddp_model, microbatches)
    assert _bridge_modes() == []

    total_loss = sum(_masked_token_loss_sum(batch, reference(batch["tokens"], batch["position_ids"], None))
                     for batch in microbatches)
    total_tokens = sum(batch["loss_mask"].sum() for batch in microbatches)
    (total_loss / total_tokens).backward()

    torch.testing.assert_close(sum(report["loss_sum"] for report in reports), total_loss.detach(), rtol=1e-5, atol=0)
    reference_grads = dict(reference.named_parameters())
    for name, param in ddp_model.module.named_parameters():
        expected = reference_grads[name].grad
        assert param.main_grad.device.type == "cpu"
        # fp32 summation order differs (grad buffer across micro batches, 1/tokens applied last):
        # round-off is relative to the tensor's scale, not to each (possibly tiny) element.
        scale = float(expected.abs().max())
        torch.testing.assert_close(param.main_grad, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_fp32_optimizer_steps_on_cpu_and_clips_to_the_global_norm():
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32 as megatron_clip

    lr, eps, clip_grad = 1e-3, 1e-8, 0.05
    ddp_model = _wrap_ddp(_tiny_gpt(seed=2))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, adam_eps=eps, clip_grad=clip_grad,
                        params_dtype=torch.float32, use_distributed_optimizer=False),
        [ddp_model],
    )
    ddp_model.config.grad_scale_func = optimizer.scale_loss
    _schedule_forward_backward(ddp_model, _microbatches(valid_tokens=(24, 24), seed=4))

    params = list(ddp_model.module.parameters())
    before = [param.detach().clone() for param in params]
    copies = [torch.nn.Parameter(param.detach().clone()) for param in params]
    for copy, param in zip(copies, params):
        copy.grad = param.main_grad.clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(copies, clip_grad))
    assert expected_norm > 2 * clip_grad, "the test needs gradients large enough to be clipped"

    success, grad_norm, _ = optimizer.step()

    assert success and _bridge_modes() == []
    assert grad_norm == pytest.approx(expected_norm, rel=1e-5)
    clipped_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    assert float(clipped_norm) == pytest.approx(clip_grad, rel=1e-5)
    for param, copy, old in zip(params, copies, before):
        torch.testing.assert_close(param.grad, copy.grad, rtol=1e-5, atol=1e-10)
        # Adam's first step, no weight decay: p - lr * g / (|g| + eps) on the clipped gradient.
        torch.testing.assert_close(param.detach(), old - lr * copy.grad / (copy.grad.abs() + eps), rtol=1e-5, atol=1e-7)

    # megatron's own clip asserts torch.cuda.FloatTensor gradients: it is what the bridge replaces.
    with pytest.raises(AssertionError):
        megatron_clip(copies, clip_grad, expected_norm)


# --- gaps found by these tests and closed in the bridge -----------------------------------------

def test_optimizer_grad_norm_outside_step():
    """get_grad_norm/clip_grad_norm/count_zeros work on their own, not only inside step()."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_model = _wrap_ddp(_tiny_gpt(seed=3))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, params_dtype=torch.float32, use_distributed_optimizer=False),
        [ddp_model],
    )
    assert optimizer.get_grad_norm() == 0.0


def test_forked_draws_log_no_warning(caplog):
    """On CPU the tracker's stream is the CPU generator: megatron's per-draw warning is filtered."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(11)
    with caplog.at_level(logging.WARNING, logger="megatron.core.tensor_parallel.random"):
        with get_cuda_rng_tracker().fork():
            torch.rand(2)
    assert not caplog.records


# --- linear layers on oneDNN ---------------------------------------------------------------------

def _gpt_losses_and_grads(cfg, frozen: tuple[str, ...]) -> tuple[torch.Tensor, dict]:
    """Masked token loss of two micro batches through a fresh GPT (seed 0) and every parameter's gradient
    (this rank's shards: the loss is megatron's vocab-parallel cross entropy, so any TP size works)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from aligner.models.gpt import build_gpt_model, transformer_config

    model_parallel_cuda_manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg)).train()
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    losses = []
    for batch in _microbatches(valid_tokens=(17, 24)):
        # megatron's loss inside the model: its cross entropy changes the logits in place
        loss = (model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
                * batch["loss_mask"]).sum()
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize("tie_embeddings, add_bias_linear, frozen, frozen_linears", [
    (False, False, (), 0),
    (True, True, ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.self_attention"), 3),  # fc1, qkv, proj
])
def test_linear_layers_run_on_onednn_with_megatron_losses_and_gradients(
        monkeypatch, tie_embeddings, add_bias_linear, frozen, frozen_linears):
    """The bridged layers (oneDNN) against megatron's own functions (torch.matmul, MKL), frozen weights included."""
    from megatron.core.tensor_parallel import layers

    from aligner.models.gpt import GPTConfig
    from aligner.runtime import cpu_products

    cpu_bridge.apply()
    monkeypatch.setenv(cpu_products.PREFERENCE_VARIABLE, "onednn")  # whatever this CPU would choose
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                    make_vocab_size_divisible_by=8, max_position_embeddings=32,
                    tie_embeddings=tie_embeddings, add_bias_linear=add_bias_linear)
    calls = {"linear": 0, "grad_input": 0, "grad_weight": 0}
    for name in calls:
        original = getattr(cpu_products, name)

        def counted(*args, _original=original, _name=name):
            calls[_name] += 1
            return _original(*args)

        monkeypatch.setattr(cpu_products, name, counted)
    losses, grads = _gpt_losses_and_grads(cfg, frozen)
    # per layer: qkv, proj, fc1, fc2; plus the output layer; per micro batch
    assert calls["linear"] == calls["grad_input"] == 2 * (2 * 4 + 1)
    assert calls["grad_weight"] == 2 * (2 * 4 + 1 - frozen_linears)

    with monkeypatch.context() as megatron_matmul:
        for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
            megatron_matmul.setattr(layers, name, getattr(layers, name).__wrapped__)
        calls.update(linear=0, grad_input=0, grad_weight=0)
        expected_losses, expected_grads = _gpt_losses_and_grads(cfg, frozen)
        assert calls == {"linear": 0, "grad_input": 0, "grad_weight": 0}

    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=0)
    assert grads.keys() == expected_grads.keys()
    for name, expected in expected_grads.items():
        if expected is None:
            assert grads[name] is None and name.startswith(frozen), name
            continue
        # fp32 round-off of a different summation order, relative to the tensor's scale
        scale = float(expected.abs().max())
        torch.testing.assert_close(grads[name], expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_linear_layers_keep_megatron_path_where_blas_is_preferred(monkeypatch):
    """ALIGNER_CPU_PRODUCTS=blas (auto on Intel's CPUs): megatron's own torch.matmul path, bit for bit."""
    from megatron.core.tensor_parallel import layers

    from aligner.models.gpt import GPTConfig
    from aligner.runtime import cpu_products

    cpu_bridge.apply()
    monkeypatch.setenv(cpu_products.PREFERENCE_VARIABLE, "blas")
    for name in ("linear", "grad_input", "grad_weight"):
        monkeypatch.setattr(cpu_products, name, lambda *args: pytest.fail("oneDNN path taken with the blas backend"))
    cfg = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                    make_vocab_size_divisible_by=8, max_position_embeddings=32)
    losses, grads = _gpt_losses_and_grads(cfg, ())
    with monkeypatch.context() as megatron_matmul:
        for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
            megatron_matmul.setattr(layers, name, getattr(layers, name).__wrapped__)
        expected_losses, expected_grads = _gpt_losses_and_grads(cfg, ())
    assert torch.equal(losses, expected_losses)
    for name, expected in expected_grads.items():
        assert torch.equal(grads[name], expected), name


@pytest.mark.parametrize("setting, vendor, library", [
    ("auto", "GenuineIntel", "blas"), ("auto", "AuthenticAMD", "onednn"), ("", "GenuineIntel", "blas"),
    ("auto", "", "onednn"), (" OneDNN ", "GenuineIntel", "onednn"), ("blas", "AuthenticAMD", "blas"),
])
def test_preferred_library_is_blas_on_intel_and_onednn_elsewhere_unless_set(setting, vendor, library):
    from aligner.runtime import cpu_products

    assert cpu_products.choose_library(setting, vendor) == library


def test_product_library_setting_errors_name_the_variable_and_the_choices(monkeypatch):
    from aligner.runtime import cpu_products
    from aligner.runtime.errors import ConfigError

    monkeypatch.setenv(cpu_products.PREFERENCE_VARIABLE, "mkl")
    with pytest.raises(ConfigError, match=r"ALIGNER_CPU_PRODUCTS='mkl': choose one of auto, onednn, blas"):
        cpu_products.preferred_library()
    monkeypatch.setattr(cpu_bridge, "_applied", False)  # as in a fresh process (restored after the test)
    with pytest.raises(ConfigError, match="ALIGNER_CPU_PRODUCTS='mkl'"):
        cpu_bridge.apply()  # refused before any patch is made
    monkeypatch.setenv(cpu_products.PREFERENCE_VARIABLE, "onednn")
    assert cpu_products.preferred_library() == "onednn"
    assert cpu_products.onednn_preferred(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    assert not cpu_products.onednn_preferred(torch.device("cpu"), torch.bfloat16)


def test_cpu_info_reads_a_field_and_gives_empty_where_there_is_none(tmp_path):
    from aligner.runtime import cpu_products

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx512f\n\n"
                       "processor\t: 1\nvendor_id\t: GenuineIntel\n")
    assert cpu_products.cpu_info("vendor_id", str(cpuinfo)) == "AuthenticAMD"
    assert cpu_products.cpu_info("flags", str(cpuinfo)).split() == ["fpu", "avx512f"]
    assert cpu_products.cpu_info("model name", str(cpuinfo)) == ""
    assert cpu_products.cpu_info("vendor_id", str(tmp_path / "missing")) == ""


def test_linear_layers_keep_megatron_path_for_other_dtypes(monkeypatch):
    """bf16 (already on oneDNN inside torch.matmul) goes through megatron's own function."""
    from megatron.core.tensor_parallel import layers

    from aligner.runtime import cpu_products

    cpu_bridge.apply()
    monkeypatch.setattr(cpu_products, "linear", lambda *args: pytest.fail("oneDNN path taken for bf16"))
    x = torch.randn(3, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    out = layers.linear_with_grad_accumulation_and_async_allreduce(x, weight, None, False, False, False)
    torch.testing.assert_close(out, torch.matmul(x, weight.t()))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 8, 64, 200])
def test_packed_weights_give_the_float64_products(rows):
    """cpu_products.pack: the packed copy in place of the weight, for every row count (it is packed for one)."""
    from aligner.runtime import cpu_products

    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 40, generator=generator), torch.randn(96, generator=generator)
    x = torch.randn(rows, 40, generator=generator)
    packed = cpu_products.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    expected = x.double() @ weight.double().t()
    torch.testing.assert_close(cpu_products.linear(x.view(1, rows, 40), packed, bias).double(),
                               (expected + bias.double()).view(1, rows, 96), rtol=0, atol=1e-5)
    # feature-major columns [in, rows] (the transpose of token-major storage), as the decode step passes them
    torch.testing.assert_close(cpu_products.weight_times_columns(packed, x.t()).double(), expected.t(),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["loop", "fused"])
def test_fp32_optimizer_step_bumps_every_parameters_version_counter(fused):
    """The native engine remakes its packed weight copies (pack_weights) for weights whose version
    counter moved: megatron's fp32 optimizer on CPU must update every parameter through it, also with
    torch's fused kernel (which does not count its writes: `use_fused_adam_on_cpu` marks them)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from aligner.training.setup import use_fused_adam_on_cpu

    ddp_model = _wrap_ddp(_tiny_gpt(seed=2))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, params_dtype=torch.float32,
                        use_distributed_optimizer=False),
        [ddp_model],
    )
    if fused:
        use_fused_adam_on_cpu(optimizer)
        assert all(group["fused"] for group in optimizer.optimizer.param_groups)
    ddp_model.config.grad_scale_func = optimizer.scale_loss
    _schedule_forward_backward(ddp_model, _microbatches(valid_tokens=(24, 24), seed=4))
    params = list(ddp_model.module.parameters())
    before = [(param._version, param.detach().clone()) for param in params]
    success, _, _ = optimizer.step()
    assert success
    for param, (version, old) in zip(params, before):
        assert not torch.equal(param.detach(), old)  # every parameter moved...
        assert param._version > version  # ...and its version counter says so


def test_weight_gradient_summed_over_pieces_of_rows_equals_the_float64_product(monkeypatch):
    """Large weight gradients are summed over pieces of rows (bounding oneDNN's copy of the transposed
    operand): the same numbers as one product, within fp32 round-off."""
    from aligner.runtime import cpu_products

    generator = torch.Generator().manual_seed(0)
    grad_output, inputs = torch.randn(37, 24, generator=generator), torch.randn(37, 16, generator=generator)
    expected = grad_output.double().t() @ inputs.double()
    whole = cpu_products.grad_weight(grad_output, inputs)
    monkeypatch.setattr(cpu_products, "WEIGHT_GRADIENT_PIECE_ELEMENTS", 24 * 5)  # pieces of 5 rows, the last of 2
    pieces = cpu_products.grad_weight(grad_output, inputs)
    for result in (whole, pieces):
        assert result.shape == (24, 16) and result.is_contiguous()
        torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch_major", [True, False])
def test_logits_and_their_gradient_are_never_copied_whole(batch_major):
    """Forward and backward of a model through its logits [b, s, vocab] make no full-size copy of them or
    of their gradient with the batch-major output layer (megatron's own output layer makes them: the
    check can fail)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from torch.profiler import ProfilerActivity, profile

    cpu_bridge.apply()
    model = _tiny_gpt(seed=3)
    if not batch_major:
        model.output_layer.__class__ = ColumnParallelLinear
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (3, 10), generator=generator)
    with cpu_bridge.cuda_to_cpu(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as trace:
        logits = model(tokens, torch.arange(10).expand(3, 10), None)
        (logits * torch.randn(logits.shape, generator=generator)).sum().backward()
    full_size, vocab = logits.numel(), logits.shape[-1]
    assert vocab != model.config.hidden_size  # the logits' shapes are told from the hidden states' by it
    copies = [event.name for event in trace.events()
              if event.name in ("aten::copy_", "aten::clone", "aten::contiguous")
              and any(shape and shape[-1] == vocab and math.prod(shape) == full_size for shape in event.input_shapes)]
    assert logits.is_contiguous() and logits.shape[:2] == (3, 10)
    if batch_major:
        assert copies == []
    else:
        assert len(copies) >= 2, copies


def test_freed_memory_is_reused_without_page_faults():
    """After apply(), a large tensor freed and allocated again comes back from the heap: its pages do not
    fault in again (glibc's default maps every block over 32 MB afresh: ~16k faults for this one)."""
    import platform
    import resource

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the allocator setting is glibc's")
    assert cpu_bridge.is_applied()
    elements = 64 * 2**20 // 4  # 64 MiB of fp32, above any mmap threshold glibc would pick itself

    def faults_of_a_filled_tensor() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensor = torch.empty(elements)
        tensor.fill_(1.0)
        del tensor
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults_of_a_filled_tensor()  # the heap grows (its pages fault in once)
    # glibc's default: 16384 faults each time. Reused: none, but for a repeat where a small block settled in
    # the freed space in between (the heap then grows once more; in the full suite, with other tests'
    # allocations about, that happened in 2 repeats of 4): some repeats, not all, must be free of faults.
    faults = [faults_of_a_filled_tensor() for _ in range(8)]
    assert faults.count(0) >= 3, faults


def test_a_helper_thread_started_under_one_intra_op_thread_stays_serial_after_it():
    """Patch 6: a thread whose first parallel loop ran under one_intra_op_thread keeps one intra-op thread
    (no OpenMP team of its own) after the main thread's count is restored; checkpoint load and save run so."""
    import threading

    from megatron.core import dist_checkpointing

    cpu_bridge.apply()
    assert dist_checkpointing.load.one_intra_op_thread and dist_checkpointing.save.one_intra_op_thread
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen, resume, started = {}, threading.Event(), threading.Event()

        def helper():
            torch.ones(65536).add_(1)  # a parallel loop: the thread's team size is fixed here
            seen["inside"] = torch.get_num_threads()
            started.set()
            resume.wait(timeout=30)
            torch.ones(65536).add_(1)
            seen["after"] = torch.get_num_threads()

        thread = threading.Thread(target=helper)

        @cpu_bridge.one_intra_op_thread
        def start_helper():
            seen["caller"] = torch.get_num_threads()
            thread.start()
            started.wait(timeout=30)

        start_helper()
        seen["restored"] = torch.get_num_threads()
        resume.set()
        thread.join(timeout=30)
        assert seen == {"caller": 1, "inside": 1, "restored": 2, "after": 1}
        # a thread started outside the scope takes the restored count (the test can tell the two apart)
        outside = threading.Thread(target=lambda: seen.update(outside=torch.get_num_threads()))
        outside.start()
        outside.join(timeout=30)
        assert seen["outside"] == 2
    finally:
        torch.set_num_threads(previous)
