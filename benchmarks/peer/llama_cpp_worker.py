"""llama.cpp's side of benchmarks/generation_anchors.py: one prompt continued greedily by llama-cpp-python.

    .cache/bench/llama-venv/bin/python benchmarks/peer/llama_cpp_worker.py GGUF PROMPT_JSON TOKENS_JSON THREADS

Runs in the llama.cpp venv (benchmarks/peer/setup_llama_cpp.sh). Loads the GGUF once (a context of the prompt
and the longest continuation), then serves "step N" (peer/protocol.py): the prompt (PROMPT_JSON: a list of token
ids) evaluated afresh and N tokens decoded greedily (temperature 0, no repetition penalty), as a user's
`Llama.generate` runs them; stop tokens do not end it (N tokens every time, as on the other sides). The tokens of
the last step are written to TOKENS_JSON, for the driver to compare with ours.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the `peer` package

from peer.protocol import serve_steps  # noqa: E402

CONTEXT_SLACK = 8


def main() -> None:
    gguf, prompt_json, tokens_json, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    prompt = json.loads(Path(prompt_json).read_text())
    longest = int(sys.argv[5]) if len(sys.argv) > 5 else 64
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=len(prompt) + longest + CONTEXT_SLACK, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)

    def step(new_tokens: str) -> float:
        wanted = int(new_tokens)
        generated = []
        for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            generated.append(int(token))
            if len(generated) == wanted:
                break
        Path(tokens_json).write_text(json.dumps(generated))
        return float(len(generated))

    serve_steps(step)


if __name__ == "__main__":
    main()
