"""megatron-core's fusion decorator compiles at the first call (aligner/runtime/lazy_compile.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from aligner.runtime.lazy_compile import compile_on_first_call

from ..conftest import REPO_ROOT


def test_importing_megatron_after_aligner_leaves_torchinductor_unimported():
    """In a fresh interpreter: megatron's `jit_fuser` is replaced and its import no longer pulls in
    TorchInductor's compiler (what made every process of every run ~3 s slower)."""
    code = textwrap.dedent("""
        import sys
        import aligner
        import megatron.core
        from megatron.core.models.gpt import GPTModel
        from megatron.core import jit
        from megatron.core.fusions import fused_bias_swiglu
        from aligner.runtime.lazy_compile import compile_on_first_call
        assert jit.jit_fuser is compile_on_first_call, jit.jit_fuser
        assert "torch._inductor.compile_fx" not in sys.modules
        assert fused_bias_swiglu.swiglu.__wrapped__.__name__ == "swiglu"  # decorated, not yet compiled
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_megatron_compiles_at_import_without_the_finder():
    """The control: the same import without aligner first does pull in the compiler, so the test above
    measures the finder, not a megatron-core that stopped compiling."""
    code = "import sys, megatron.core; print('torch._inductor.compile_fx' in sys.modules)"
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "True", result.stderr[-3000:]


def test_torch_compile_runs_at_the_first_call_only(monkeypatch):
    compiled = []

    def fake_compile(function, **options):
        compiled.append(options)
        return lambda *args, **kwargs: function(*args, **kwargs) * 10

    monkeypatch.setattr(torch, "compile", fake_compile)

    @compile_on_first_call
    def double(x):
        return 2 * x

    class Layer:
        factor = 3

        @compile_on_first_call(dynamic=False)
        def scale(self, x):
            return self.factor * x

    assert compiled == []  # decorating compiles nothing
    assert double(1) == 20 and double(2) == 40  # through the compiled function
    assert compiled == [{}]  # once
    assert Layer().scale(1) == 30  # binds as a method; the options reach torch.compile
    assert compiled == [{}, {"dynamic": False}]
    assert double.__name__ == "double"
