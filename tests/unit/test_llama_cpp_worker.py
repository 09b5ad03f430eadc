"""benchmarks/peer/llama_cpp_worker.py's batched greedy decode, over a stand-in for llama-cpp-python's low-level
API that keeps llama.cpp's rules (the real binding lives in its own venv, built by setup_llama_cpp.sh): one cache
of (sequence, position) cells bounded by n_ctx, at most n_batch entries and n_seq_max sequences per context,
each sequence's positions consecutive, and one logits row per entry that asks for logits, in batch order. Its
"model" predicts from a sequence's whole history, so a token sent to the wrong sequence or position, or a row
read from the wrong place, changes the tokens; the reference is the same rule unrolled one prompt at a time."""
from __future__ import annotations

import ctypes
import importlib.util
import sys
import types

import pytest

from ..conftest import REPO_ROOT

VOCAB = 97
WORKER = REPO_ROOT / "benchmarks" / "peer" / "llama_cpp_worker.py"


def next_token(history: list[int]) -> int:
    """The stand-in model's greedy choice after a sequence's tokens (every one of them matters)."""
    return (31 * sum(t * (i + 1) for i, t in enumerate(history)) + 7 * len(history)) % VOCAB


def reference(prompt: list[int], new_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(new_tokens):
        history.append(next_token(history))
    return history[len(prompt):]


class FakeLlamaCpp(types.ModuleType):
    """The calls the worker makes, with llama.cpp's constraints checked; counts its decodes."""

    def __init__(self):
        super().__init__("llama_cpp")
        self.decodes: list[int] = []  # entries per llama_decode
        self.cells: dict[int, list[int]] = {}  # sequence -> its tokens, position = index
        self.params = None
        self.logits = None
        self.llama_log_callback = lambda function: function

    def llama_log_set(self, callback, user_data):
        pass

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return types.SimpleNamespace()

    def llama_model_load_from_file(self, path, params):
        assert isinstance(path, bytes)
        return object()

    def llama_model_get_vocab(self, model):
        return "vocab"

    def llama_vocab_n_tokens(self, vocab):
        return VOCAB

    def llama_context_default_params(self):
        return types.SimpleNamespace(n_ctx=512, n_batch=2048, n_ubatch=512, n_seq_max=1, kv_unified=False,
                                     n_threads=4, n_threads_batch=4, no_perf=False)

    def llama_init_from_model(self, model, params):
        assert params.n_ubatch <= params.n_batch
        self.params = params
        return object()

    def llama_get_memory(self, ctx):
        return "memory"

    def llama_memory_clear(self, memory, data):
        self.cells.clear()

    def llama_batch_init(self, n_tokens, embd, n_seq_max):
        return types.SimpleNamespace(token=[0] * n_tokens, pos=[0] * n_tokens, n_seq_id=[0] * n_tokens,
                                     seq_id=[[0] * n_seq_max for _ in range(n_tokens)], logits=[False] * n_tokens,
                                     n_tokens=0)

    def llama_decode(self, ctx, batch):
        params = self.params
        if not 0 < batch.n_tokens <= params.n_ubatch:
            return -1  # llama.cpp splits a batch into n_ubatch pieces; the worker sets them equal
        rows = []
        for i in range(batch.n_tokens):
            assert batch.n_seq_id[i] == 1
            sequence = batch.seq_id[i][0]
            if not 0 <= sequence < params.n_seq_max:
                return -1
            history = self.cells.setdefault(sequence, [])
            if batch.pos[i] != len(history):  # llama.cpp refuses non-consecutive positions of a sequence
                return -1
            history.append(batch.token[i])
            if batch.logits[i]:
                rows.append(next_token(history))
        if sum(map(len, self.cells.values())) > params.n_ctx:
            return 1  # no room in the cache
        self.logits = (ctypes.c_float * (len(rows) * VOCAB))()
        for row, token in enumerate(rows):
            for column in range(VOCAB):  # the chosen token highest, the others in a fixed order below it
                self.logits[row * VOCAB + column] = 1.0 if column == token else -((column * 13) % VOCAB) / VOCAB
        self.decodes.append(batch.n_tokens)
        return 0

    def llama_get_logits(self, ctx):
        return self.logits


@pytest.fixture
def worker(monkeypatch):
    """The worker module loaded afresh over the stand-in (sys.path and sys.modules restored afterwards)."""
    fake = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("peer", "peer.protocol"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    spec = importlib.util.spec_from_file_location("llama_cpp_worker_under_test", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, fake


PROMPTS = [[5, 9, 2, 14], [3, 3], [40, 1, 8, 8, 8, 2, 11], [60], [2, 7, 1]]


@pytest.mark.parametrize("batch", [1, 3, 5])
def test_every_row_is_the_greedy_continuation_of_its_own_prompt(worker, batch):
    module, fake = worker
    generator = module.BatchedGreedy("model.gguf", PROMPTS, longest=12, threads=2)
    rows = generator.run(batch, 12)
    assert rows == [reference(prompt, 12) for prompt in PROMPTS[:batch]]
    # all prompts in one decode, then one decode per step holding one token of every row
    assert fake.decodes == [sum(map(len, PROMPTS[:batch]))] + [batch] * 11


def test_a_run_starts_from_an_empty_cache_and_repeats_itself(worker):
    module, fake = worker
    generator = module.BatchedGreedy("model.gguf", PROMPTS, longest=12, threads=2)
    first = generator.run(5, 12)
    assert generator.run(5, 12) == first
    assert generator.run(2, 3) == [row[:3] for row in first[:2]]


def test_the_context_holds_every_prompt_and_its_longest_continuation(worker):
    module, fake = worker
    generator = module.BatchedGreedy("model.gguf", PROMPTS, longest=12, threads=3)
    params = fake.params
    assert params.n_seq_max == len(PROMPTS) and params.kv_unified
    assert params.n_threads == params.n_threads_batch == 3
    generator.run(5, 12)  # every cell of the largest run fits
    assert sum(map(len, fake.cells.values())) <= params.n_ctx
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        generator.run(5, 12 + params.n_ctx)  # far past the context the worker asked for
