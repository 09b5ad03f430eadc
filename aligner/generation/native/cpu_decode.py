"""The native engine's decode step on a CPU, in fp32, as one C++ call (`cpu_decode.cpp`).

Why a hand-written kernel: at one row a decode step is a chain of matrix-vector products bound by how fast the
weights stream from memory, plus about 40 small operations a layer. No library torch calls streams a weight at
the memory's speed for a single column (on an AMD EPYC, SmolLM2's products through oneDNN read 19-33 GB/s, MKL
11-12 GB/s on one thread), and each small torch operation costs microseconds of dispatch, more than its
arithmetic. So up to `own_rows` rows the step runs its own products (each weight row streamed once for every
row of the step); at more it runs oneDNN's products on the engine's packed weight copies (the general path's),
and everything between them in C++ (norms, rotary, cache writes, attention, activation): on SmolLM2 and an AMD
EPYC with AVX-512 1.4x the general path's speed at one row, 1.15-1.4x at 2-32, level at 64
(docs/concepts/performance.md). The C++ step runs the general path's math
(`forward.Forward._decode_layer`, which the tests compare it to) for Llama-style layers.

It is used where `unsupported` finds nothing: fp32 on a CPU, one process (no tensor or pipeline parallelism),
RMSNorm, rotary embeddings of one base, SwiGLU, linear biases or none, no live LoRA adapter, no MoE, no q/k
norms, none of Gemma's norms or scalings; a step of more than one row also needs the packed copies
(`NativeEngine(pack_weights=True)`, the default on a CPU). The static step (`static_decode`, what a CUDA graph
captures) stays on torch's operations. Everything else takes the general path. `ALIGNER_CPU_DECODE=general`
turns it off.

The extension is compiled for this CPU (-march=native) by torch's extension loader, by `make install` (`main`) or
else on first use, under a name that hashes the source, the flags and the CPU's flags (the machine may change
under a shared home directory); later processes load the built library. A build that fails (no C++ compiler,
say) leaves the general path, with one warning that says why.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path
from typing import Optional

import torch
from torch.utils import cpp_extension

from aligner.runtime.cpu_products import this_cpu
from aligner.runtime.errors import ConfigError

log = logging.getLogger(__name__)

SETTING_VARIABLE = "ALIGNER_CPU_DECODE"
SETTINGS = ("auto", "general")
SOURCE = Path(__file__).with_name("cpu_decode.cpp")
# -fopenmp: at::parallel_for splits a product over torch's threads only in code built with OpenMP (without it the
# step ran on one thread: 16 ms a SmolLM2 step against 11 on two threads, AMD EPYC). The library binds to the
# libgomp torch has already loaded (one OpenMP runtime, one thread pool in the process).
FLAGS = ["-O3", "-march=native", "-fopenmp"]
MAX_HEAD_DIM = 1024  # cpu_decode.cpp's kMaxHeadDim
# The most rows the C++ step's own products serve on a CPU without AVX-512 (at most cpu_decode.cpp's kMaxOwnRows).
# SmolLM2's greedy decode on an AMD EPYC with AVX2 only: 1.42 / 1.37 / 1.33x the speed of the same step on oneDNN's
# products at 2 / 4 / 8 rows (docs/concepts/performance.md). With AVX-512, oneDNN's products were the faster from
# 4 rows on an AMD EPYC (a hand-written blocked product 0.91-0.98x at 4 rows, 0.54-0.77x at 8), so there the own
# products serve one row.
OWN_ROWS_WITHOUT_AVX512 = 8
_extension: dict = {}  # "module": the loaded extension, or None once a build failed


def enabled() -> bool:
    """Whether ALIGNER_CPU_DECODE allows the C++ step ("auto", the default) or not ("general")."""
    setting = os.environ.get(SETTING_VARIABLE, "auto").strip().lower() or "auto"
    if setting not in SETTINGS:
        raise ConfigError(f"{SETTING_VARIABLE}={setting!r}: choose one of {', '.join(SETTINGS)}")
    return setting == "auto"


def unsupported(state, segments: list) -> Optional[str]:
    """Why the C++ step cannot run the bound model (state: the engine's EngineState), or None when it can."""
    cfg = state.cfg
    if state.device is None or state.device.type != "cpu" or state.dtype != torch.float32:
        return "not fp32 on a CPU"
    if state.tp_size > 1 or state.pp_size > 1 or len(segments) != 1:
        return "tensor or pipeline parallel"
    for flag, name in ((cfg.normalization != "RMSNorm", "normalization"), (cfg.activation != "swiglu", "activation"),
                       (cfg.position_embedding_type != "rope", "position embeddings"),
                       (cfg.qk_layernorm, "qk_layernorm"), (cfg.zero_centered_norm, "zero_centered_norm"),
                       (cfg.post_layer_norms, "post_layer_norms"), (cfg.scale_embeddings, "scale_embeddings"),
                       (cfg.num_moe_experts is not None, "MoE")):
        if flag:
            return f"the model's {name}"
    if state.head_dim > MAX_HEAD_DIM or state.head_dim % 2:
        return f"head_dim {state.head_dim}"
    segment = segments[0]
    if segment.word_embeddings is None or segment.output_weight is None:
        return "a segment without the embedding or the output layer"
    for layer in segment.layers:
        if layer.rope_half is not None:
            return "two rotary bases"
        if any(linear.lora_a is not None for linear in (layer.qkv, layer.proj, layer.fc1, layer.fc2)):
            return "a live LoRA adapter"
    tensors = [segment.word_embeddings, segment.output_weight, segment.final_norm[0]]
    for layer in segment.layers:
        tensors += [layer.input_norm.weight, layer.mlp_norm.weight]
        for linear in (layer.qkv, layer.proj, layer.fc1, layer.fc2):
            tensors += [linear.weight] + ([] if linear.bias is None else [linear.bias])
    if not all(t.is_contiguous() and t.dtype == torch.float32 for t in tensors):
        return "a weight that is not contiguous fp32"
    return None


def own_rows(flags: str) -> int:
    """The most rows a step runs through the C++ step's own products on a CPU with these /proc/cpuinfo flags (the
    extension is built for this CPU: with AVX2 and FMA and without AVX-512 it has the products of many rows)."""
    present = set(flags.split())
    return OWN_ROWS_WITHOUT_AVX512 if {"avx2", "fma"} <= present and "avx512f" not in present else 1


def extension():
    """The compiled extension, built on first use; None where it cannot be built (warned once)."""
    if "module" not in _extension:
        _extension["module"] = _build()
    return _extension["module"]


def build_root() -> Path:
    """Where torch's extensions are built: $TORCH_EXTENSIONS_DIR, else torch's default (under ~/.cache)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def _build():
    source = SOURCE.read_text()
    key = "\n".join([source, " ".join(FLAGS), this_cpu("flags"), torch.__version__])
    name = f"aligner_cpu_decode_{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    root = build_root()
    build_dir = root / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        # One process builds at a time; the kernel releases the lock of a process that dies. torch's own lock
        # file, which a process killed mid-build leaves behind (and torch would then wait on forever), can only
        # be stale while this lock is held.
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            return cpp_extension.load(name, [str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                                      build_directory=str(build_dir), verbose=False)
    # No compiler or ninja (RuntimeError, OSError), a read-only cache (OSError), a library that does not load
    # (ImportError): the general path still runs.
    except (RuntimeError, OSError, ImportError) as error:
        reason = str(error).strip().splitlines()
        log.warning("the C++ decode step on a CPU could not be built (%s); decoding through the "
                    "general path", reason[-1] if reason else type(error).__name__)
        return None


class CpuDecode:
    """The bound model's C++ decode step (built on the first step that uses it): `step` -> logits [batch, vocab].

    Up to `own_rows` rows run its own products (`rows_times_matrix` in the .cpp); more rows run oneDNN's products
    on the engine's packed weight copies, so only where the engine packs its weights (`batched`: `pack_weights`,
    the default).
    """

    def __init__(self, state, segment):
        self.state, self.segment = state, segment
        self.own_rows = own_rows(this_cpu("flags"))
        self.batched = segment.output_product is not segment.output_weight and all(
            linear.product is not linear.weight
            for layer in segment.layers for linear in (layer.qkv, layer.proj, layer.fc1, layer.fc2))
        self._model = None

    def available(self) -> bool:
        """Whether the extension is (or can be) built; the first call builds it."""
        return extension() is not None

    def runs(self, batch: int) -> bool:
        """Whether a step of `batch` rows runs here (up to own_rows always; more with packed weights)."""
        return batch <= self.own_rows or self.batched

    def _bound(self):
        if self._model is None:
            module, state, segment = extension(), self.state, self.segment

            def linear(weight, bias, product):
                return module.Linear(weight, bias, None if product is weight else product)

            layers = [module.LayerWeights(layer.input_norm.weight, layer.mlp_norm.weight,
                                          *(linear(part.weight, part.bias, part.product)
                                            for part in (layer.qkv, layer.proj, layer.fc1, layer.fc2)))
                      for layer in segment.layers]
            output = linear(segment.output_weight, None, segment.output_product)
            self._model = module.DecodeModel(layers, segment.word_embeddings, segment.final_norm[0], output,
                                             state.heads, state.groups, state.head_dim, state.scale,
                                             state.cfg.norm_epsilon, self.own_rows)
        return self._model

    def step(self, tokens: torch.Tensor, inputs, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """tokens [batch], one a row, with the step's forward.DecodeInputs (every row's cache column, the columns
        read, the rotary tables [d, batch], the attention bias [batch * groups, 1, kv_len] or None); keys
        [layers, rows, groups, d, len] and values [layers, rows, groups, len, d] (rows 0 .. batch - 1 are
        written and read)."""
        batch = tokens.shape[0]
        columns = inputs.column.expand(batch).contiguous()
        cos, sin = (table.t().contiguous() for table in inputs.rope)
        bias = None if inputs.attention_bias is None else inputs.attention_bias.squeeze(1)
        return self._bound().step(tokens.contiguous(), columns, inputs.kv_len, cos, sin, bias, keys, values)


def bind(state, segments: list) -> Optional[CpuDecode]:
    """The C++ step for the bound model, or None where it does not apply (see `unsupported`)."""
    if not enabled() or unsupported(state, segments) is not None:
        return None
    return CpuDecode(state, segments[0])


def main() -> int:
    """Build the extension now (`make install` does), one line."""
    import time

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    module = extension()
    if module is not None:
        print(f"C++ decode step on a CPU: {module.__name__} ready on "
              f"{module.parallel_threads()} of torch's {torch.get_num_threads()} threads "
              f"({time.perf_counter() - start:.0f} s, {build_root()})")
    return 0  # a machine without a compiler still decodes, on the general path (warned above)
