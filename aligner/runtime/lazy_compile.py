"""megatron-core's fusion functions compiled at their first call, not at import.

megatron-core 0.16.1 decorates ~65 functions with `megatron.core.jit.jit_fuser`, which is `torch.compile`
(`enable_jit_fuser`, run when `megatron.core.jit` is imported). Decorating with `torch.compile` imports
TorchInductor, which made importing megatron-core 2.4x slower in every process of every run (measured
on a loaded 2-core AMD EPYC: 6.1 s, and 2.5 s without it), although aligner turns off each fusion that uses
those functions (`aligner/models/gpt.py`: `bias_activation_fusion=False`, ...). Here `jit_fuser` becomes a
decorator that calls `torch.compile` when the decorated function is first called: a function that runs
is compiled as before, one that never runs costs nothing.

`install()` is called when the `aligner` package is imported, before any of its modules imports
megatron-core; it adds a finder that adjusts `megatron.core.jit` right after that module runs and before
the fusion modules import `jit_fuser` from it. It needs megatron-core's module to still be named so and
to still set `jit_fuser`: tests/unit/test_lazy_compile.py checks both, so an upgrade that changes them fails there.
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Callable, Optional

import torch

JIT_MODULE = "megatron.core.jit"


def compile_on_first_call(function: Optional[Callable] = None, **options) -> Callable:
    """`torch.compile(function, **options)`, made when the returned function is first called.

    A plain function (not a callable object), so it binds as a method like the function it wraps.
    Also usable as `@compile_on_first_call(**options)`.
    """
    if function is None:
        return functools.partial(compile_on_first_call, **options)
    compiled: Optional[Callable] = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(function, **options)
        return compiled(*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then its `jit_fuser` replaced if it is torch.compile."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_on_first_call


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Have megatron-core's fusion decorator compile at the first call (idempotent; no effect once
    megatron-core is imported)."""
    if JIT_MODULE not in sys.modules and _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
