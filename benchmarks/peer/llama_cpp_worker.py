"""llama.cpp's side of benchmarks/generation_anchors.py: prompts continued greedily by llama.cpp, many at once.

    .cache/bench/llama-venv/bin/python benchmarks/peer/llama_cpp_worker.py GGUF PROMPTS_JSON TOKENS_JSON THREADS \
        LONGEST

Runs in the llama.cpp venv (benchmarks/peer/setup_llama_cpp.sh). Loads the GGUF once, with a context holding
every prompt of PROMPTS_JSON (a list of token-id lists) and LONGEST new tokens for each, one sequence id per prompt,
then serves "step BATCH N" (peer/protocol.py): the first BATCH prompts evaluated afresh in one batch (logits at each
one's last token only), then N tokens decoded greedily, one batch per step holding one token of every sequence,
as llama.cpp's own parallel/batched examples drive `llama_decode`. Stop tokens do not end a row (N tokens every
time, as on the other sides). Greedy is the argmax of each row's logits (numpy over llama.cpp's logits buffer).
Through the binding's low-level API because its `Llama.generate` decodes one sequence at a time; at batch 1 this
is the same work without generate's Python sampler chain. The tokens of the last step are written to TOKENS_JSON,
for the driver to compare with ours.
"""
from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402
from peer.protocol import serve_steps  # noqa: E402


@llama_cpp.llama_log_callback
def _quiet(level, text, user_data):
    """llama.cpp's log lines dropped (the binding's verbose=False)."""


class BatchedGreedy:
    """One llama.cpp context with a sequence id per prompt; `run(batch, n)` decodes n tokens for each of the first
    `batch` prompts."""

    def __init__(self, gguf: str, prompts: list[list[int]], longest: int, threads: int):
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        self.prompts = prompts
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        tokens = sum(len(p) for p in prompts)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = tokens + len(prompts) * longest + 8
        params.n_batch = params.n_ubatch = max(tokens, len(prompts))
        params.n_seq_max = len(prompts)
        params.kv_unified = True  # one cache for all sequences, as llama.cpp's batched example sets it
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create its context")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, len(prompts))

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _greedy(self, rows: int) -> list[int]:
        logits = ctypes.cast(llama_cpp.llama_get_logits(self.ctx), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(logits, shape=(rows, self.vocab)).argmax(axis=1).tolist()

    def run(self, batch: int, new_tokens: int) -> list[list[int]]:
        llama_cpp.llama_memory_clear(self.memory, True)
        prompts = self.prompts[:batch]
        self._decode([(token, position, row, position == len(prompt) - 1)
                      for row, prompt in enumerate(prompts) for position, token in enumerate(prompt)])
        rows = [[token] for token in self._greedy(batch)]
        for _ in range(new_tokens - 1):
            self._decode([(out[-1], len(prompt) + len(out) - 1, row, True)
                          for row, (prompt, out) in enumerate(zip(prompts, rows))])
            for out, token in zip(rows, self._greedy(batch)):
                out.append(token)
        return rows


def main() -> None:
    gguf, prompts_json, tokens_json, threads, longest = sys.argv[1:6]
    generator = BatchedGreedy(gguf, json.loads(Path(prompts_json).read_text()), int(longest), int(threads))

    def step(batch: str, new_tokens: str) -> float:
        rows = generator.run(int(batch), int(new_tokens))
        Path(tokens_json).write_text(json.dumps(rows))
        return float(sum(len(row) for row in rows))

    serve_steps(step)


if __name__ == "__main__":
    main()
