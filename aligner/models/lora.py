"""Low-rank adapters (LoRA) on megatron-core's column- and row-parallel linears, sharded as they are.

A target linear y = W x keeps W frozen and gains y += (alpha / rank) * B (A x), with A [rank, in]
and B [out, rank]. B starts at zero, so at step 0 the model is exactly the base model.

Tensor parallelism follows the base layer's split:
- a column-parallel linear (QKV, MLP in) has W split on its outputs. A is whole on every rank and B
  holds this rank's output rows. A's output goes through megatron's copy-to-TP region, whose
  backward sums the ranks' partial gradients, so A's gradient is whole and equal on every rank.
- a row-parallel linear (attention out, MLP out) has W split on its inputs. A holds this rank's input
  columns, A x is summed over the ranks (reduce-from-TP region), and B is whole.

The adapters are attributes of the base module (`lora_a`, `lora_b`), so every base parameter keeps its
name (checkpoints, HF conversion, the native engine) and adapter names end in `.lora_a` / `.lora_b`.
A's initial values are drawn for the whole matrix from a generator seeded by (seed, layer number,
module) and then cut to this rank's shard, so every parallel layout starts from the same adapters.

A model with a fresh head (a reward model, a critic) also trains that head whole (`train_whole`): it
is saved beside the adapters and loads with them.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from aligner import checkpointing
from aligner.config import at_least, one_of
from aligner.models import parameter_names as names
from aligner.runtime.errors import ConfigError

# `peft.target_modules` names -> module paths inside a transformer layer
TARGETS = {"linear_qkv": names.QKV, "linear_proj": names.ATTENTION_OUT, "linear_fc1": names.FC1,
           "linear_fc2": names.FC2}
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")
SCHEMES = ("none", "lora")


@dataclass
class PEFTConfig:
    """The `peft:` section: train low-rank adapters instead of every weight."""

    scheme: str = one_of(SCHEMES, "none")  # none: full-weight training; lora: adapters on target_modules
    rank: int = at_least(1, 16)
    alpha: float = at_least(0.0, 32.0, "the update is scaled by alpha / rank")
    dropout: float = at_least(0.0, 0.0, "dropout on the adapters' input (training only)")
    target_modules: list = field(default_factory=lambda: list(TARGETS))

    def check_fields(self) -> Optional[tuple[str, str]]:
        unknown = [name for name in self.target_modules if name not in TARGETS]
        if unknown or not self.target_modules:
            return "target_modules", (f"unknown module(s) {unknown}; " if unknown else "empty; ") + \
                f"choose from {', '.join(TARGETS)}"
        return None

    @property
    def enabled(self) -> bool:
        return self.scheme == "lora"

    def to_dict(self) -> dict:
        return {"scheme": self.scheme, "rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules)}


def checkpoint_meta(peft: PEFTConfig, base_dir, train_whole: Sequence[str] = ()) -> dict:
    """The `peft` section of an adapter checkpoint's meta: the settings, the modules trained whole beside the
    adapters, the base's path and a digest of its manifest (which recognises the base wherever it is moved)."""
    return {**peft.to_dict(), "train_whole": list(train_whole), "base": str(Path(base_dir).resolve()),
            "base_fingerprint": checkpointing.fingerprint(base_dir)}


def config_of(meta: dict) -> PEFTConfig:
    """The PEFTConfig an adapter checkpoint was trained with (from its meta's `peft` section)."""
    return PEFTConfig(**{key: meta[key] for key in ("scheme", "rank", "alpha", "dropout", "target_modules")})


def adapter_base(checkpoint_dir, peft_meta: dict, base=None):
    """The base checkpoint of an adapter checkpoint: `base` if given, else the path it recorded; it must be
    the same model (same manifest digest) when the adapter checkpoint recorded one."""
    base_dir = Path(base) if base is not None else Path(peft_meta["base"])
    if not (base_dir / checkpointing.META_FILE).is_file():
        raise ConfigError(f"{checkpoint_dir} holds LoRA adapters whose base checkpoint {base_dir} is not an aligner "
                          "checkpoint (moved or deleted?); pass its new place with --base")
    recorded = peft_meta.get("base_fingerprint")
    if recorded and checkpointing.fingerprint(base_dir) != recorded:
        raise ConfigError(f"{base_dir} is not the model {checkpoint_dir}'s adapters were trained on "
                          f"({peft_meta['base']}); pass that base with --base")
    return base_dir


def load_for_inference(checkpoint_dir, chunks: Sequence[torch.nn.Module], base=None,
                       skip_prefixes: Sequence[str] = ()) -> bool:
    """Load a checkpoint into freshly built (unwrapped) chunks: a whole model as it is, an adapter checkpoint
    onto its base (`adapter_base`) with live adapters. Returns whether the chunks now have adapters.
    skip_prefixes: parameters the checkpoint does not provide (as in `checkpointing.load`)."""
    peft_meta = checkpointing.read_meta(checkpoint_dir).get("peft")
    if peft_meta is None:
        checkpointing.load(checkpoint_dir, chunks, skip_prefixes=skip_prefixes)
        return False
    train_whole = tuple(peft_meta.get("train_whole", ()))
    # The base may lack what was trained whole (a policy checkpoint under a reward model's fresh head), and
    # may itself be an adapter checkpoint (adapters trained on a merged earlier run).
    load_merged(adapter_base(checkpoint_dir, peft_meta, base), chunks, skip_prefixes=(*skip_prefixes, *train_whole))
    apply_lora(chunks, config_of(peft_meta), seed=0, train_whole=train_whole)  # A is loaded next
    checkpointing.load(checkpoint_dir, chunks, skip_prefixes=skip_prefixes)
    return True


def load_merged(checkpoint_dir, chunks: Sequence[torch.nn.Module], skip_prefixes: Sequence[str] = ()) -> None:
    """Load a checkpoint as whole weights into chunks without adapters: an adapter checkpoint is loaded onto
    its base and merged into it, so any run may start from the result of a LoRA run."""
    chunks = checkpointing.unwrap_chunks(chunks)
    if "peft" not in checkpointing.read_meta(checkpoint_dir):
        checkpointing.load(checkpoint_dir, chunks, skip_prefixes=skip_prefixes)
        return
    trainable = [(param, param.requires_grad) for chunk in chunks for param in chunk.parameters()]
    load_for_inference(checkpoint_dir, chunks, skip_prefixes=skip_prefixes)
    merge(chunks)
    remove_adapters(chunks)
    for param, requires_grad in trainable:
        param.requires_grad = requires_grad


def _adapter_sharded_state(module, prefix: str, sharded_offsets, split_axis: dict) -> dict:
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    adapters = {"lora_a": module.lora_a, "lora_b": module.lora_b}
    return make_sharded_tensors_for_checkpoint(adapters, prefix, split_axis, sharded_offsets)


def _dropped(module, input_: torch.Tensor) -> torch.Tensor:
    return F.dropout(input_, module.lora_dropout, module.training) if module.lora_dropout else input_


def _column_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear, copy_to_tensor_model_parallel_region

    class LoRAColumnParallelLinear(ColumnParallelLinear):
        """ColumnParallelLinear + a low-rank update; B holds this rank's output rows."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            output, bias = super().forward(input_, weight, runtime_gather_output)
            if self.lora_enabled:
                low = copy_to_tensor_model_parallel_region(F.linear(_dropped(self, input_), self.lora_a))
                output = output + F.linear(low, self.lora_b) * self.lora_scale
            return output, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            adapters = _adapter_sharded_state(self, prefix, sharded_offsets, {"lora_b": 0})
            if self.lora_gated:
                # SwiGLU's fc1 rows are [gate; up] on every rank, so B's are too: saved as two halves, each
                # split over the ranks, as megatron's MLP saves the weight.
                from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

                key = f"{prefix}lora_b"
                adapters[key] = apply_swiglu_sharded_factory(
                    adapters[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
            state.update(adapters)
            return state

    return LoRAColumnParallelLinear


def _row_class():
    from megatron.core.tensor_parallel import RowParallelLinear, reduce_from_tensor_model_parallel_region

    class LoRARowParallelLinear(RowParallelLinear):
        """RowParallelLinear + a low-rank update; A holds this rank's input columns."""

        def forward(self, input_):
            output, bias = super().forward(input_)
            if self.lora_enabled:
                low = reduce_from_tensor_model_parallel_region(F.linear(_dropped(self, input_), self.lora_a))
                output = output + F.linear(low, self.lora_b) * self.lora_scale
            return output, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            state.update(_adapter_sharded_state(self, prefix, sharded_offsets, {"lora_a": 1}))
            return state

    return LoRARowParallelLinear


def _initial_a(rank: int, in_features: int, seed: int, layer_number: int, target: str) -> torch.Tensor:
    """The whole A of one adapter: uniform in +-1/sqrt(in) (PEFT's Kaiming default), from its own stream."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{layer_number}|{target}".encode()))
    bound = in_features ** -0.5
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound


def _output_requires_grad(module, inputs, output: torch.Tensor) -> None:
    """Megatron's full activation recompute runs each block through torch's reentrant checkpoint, whose output
    requires grad only if an input does: the frozen embedding's output does not, so without this the adapters
    inside every recomputed block would get no gradient and the run would train nothing."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def apply_lora(chunks: Sequence[torch.nn.Module], peft: PEFTConfig, seed: int, train_whole: Sequence[str] = ()) -> None:
    """Add adapters to every target linear of the (unwrapped) model chunks and freeze everything else, except
    the parameters whose names start with a `train_whole` prefix (a reward head's `output_layer.`): those keep
    training whole (and are saved with the adapters)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    column_class, row_class = _column_class(), _row_class()
    tp_rank = ps.get_tensor_model_parallel_rank()
    for chunk in chunks:
        config = chunk.config
        if config.sequence_parallel:
            raise ConfigError("peft.scheme=lora does not support parallel.sequence_parallel=true yet")
        if config.num_moe_experts:
            raise ConfigError("peft.scheme=lora does not support MoE models yet (model.num_moe_experts is set)")
        for layer in chunk.decoder.layers:
            for target in peft.target_modules:
                module = layer.get_submodule(TARGETS[target])
                if type(module) is ColumnParallelLinear and not module.gather_output:
                    module.__class__ = column_class
                    whole_a = _initial_a(peft.rank, module.input_size, seed, layer.layer_number, target)
                    out_local, split = module.output_size_per_partition, ("lora_b", 0)
                elif type(module) is RowParallelLinear:
                    module.__class__ = row_class
                    whole_a = _initial_a(peft.rank, module.input_size, seed, layer.layer_number, target)
                    in_local = module.input_size_per_partition
                    whole_a = whole_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
                    out_local, split = module.output_size, ("lora_a", 1)
                else:
                    raise ConfigError(f"peft.target_modules: {target} is a {type(module).__name__}; LoRA supports "
                                      "megatron's local layers (model.architecture.transformer_impl=local)")
                weight = module.weight
                module.lora_a = torch.nn.Parameter(whole_a.to(weight.dtype).to(weight.device).contiguous())
                module.lora_b = torch.nn.Parameter(torch.zeros(out_local, peft.rank, dtype=weight.dtype,
                                                               device=weight.device))
                module.lora_scale = peft.alpha / peft.rank
                module.lora_dropout = peft.dropout
                module.lora_enabled = True
                module.lora_gated = target == "linear_fc1" and config.gated_linear_unit
                # The split adapter is a TP-parallel parameter (megatron's grad norm then sums it over the
                # ranks); the whole one is a duplicate, counted once.
                set_tensor_model_parallel_attributes(getattr(module, split[0]), True, split[1], 1)
        if config.recompute_granularity == "full" and getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_output_requires_grad)
        chunk.lora_train_whole = tuple(train_whole)
        setattr(chunk, checkpointing.SAVED_KEY_ATTR, is_saved_key)  # checkpoints hold what is_saved_key keeps
        for name, param in chunk.named_parameters():
            whole = name.startswith(chunk.lora_train_whole) and param.requires_grad  # (a frozen bias stays so)
            param.requires_grad = name.endswith(ADAPTER_SUFFIXES) or whole


def adapter_modules(chunks: Sequence[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, "lora_a"):
                yield module


def has_adapters(chunks: Sequence[torch.nn.Module]) -> bool:
    return next(adapter_modules(chunks), None) is not None


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key names an adapter tensor."""
    return key.endswith(ADAPTER_SUFFIXES)


def is_saved_key(chunk: torch.nn.Module, key: str) -> bool:
    """Whether an adapter checkpoint holds this state-dict key of a chunk: an adapter, or a module trained whole."""
    return is_adapter_key(key) or key.startswith(getattr(chunk, "lora_train_whole", ()))


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    """Run the base model: every adapter off inside the block (the reference policy of LoRA training)."""
    modules = list(adapter_modules(chunks))
    for module in modules:
        module.lora_enabled = False
    try:
        yield
    finally:
        for module in modules:
            module.lora_enabled = True


class BaseReference:
    """The reference policy of LoRA training: the base model, i.e. the live chunks with their adapters off.
    Stands where `weight_swap.HostWeights` (a host copy of the weights) would: nothing is copied."""

    num_bytes = 0

    def swapped_in(self, chunks: Sequence[torch.nn.Module]):
        from megatron.core.utils import unwrap_model

        return adapters_disabled(unwrap_model(list(chunks)))


def remove_adapters(chunks: Sequence[torch.nn.Module]) -> None:
    """Turn every adapted linear back into megatron's own class, without its adapters (merge first to keep
    their update)."""
    for module in list(adapter_modules(chunks)):
        module.__class__ = module.__class__.__bases__[0]  # LoRAColumnParallelLinear -> ColumnParallelLinear
        for name in ("lora_a", "lora_b", "lora_scale", "lora_dropout", "lora_enabled", "lora_gated"):
            delattr(module, name)
    for chunk in chunks:
        chunk.__dict__.pop("lora_train_whole", None)
        chunk.__dict__.pop(checkpointing.SAVED_KEY_ATTR, None)


def merge(chunks: Sequence[torch.nn.Module]) -> None:
    """Fold every adapter into its weight (W += scale * B A, on this rank's shard) and zero its B, so the
    model computes the same function with no adapter work left."""
    with torch.no_grad():
        for module in adapter_modules(chunks):
            update = (module.lora_b.double() @ module.lora_a.double()) * module.lora_scale
            module.weight.copy_((module.weight.double() + update).to(module.weight.dtype))
            module.lora_b.zero_()
