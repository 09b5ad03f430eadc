"""Train the demo's character tokenizer on the JSONL files of a data directory.

    python examples/nlp/data/arithmetic/train_tokenizer.py --data-dir data/arithmetic \
        --out-dir data/arithmetic/tokenizer

Every string value in every record of every ``*.jsonl`` file is training text. The result is an
HF tokenizer directory; see aligner/demo/tokenizer.py for its ids, decoding and chat template.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator

from aligner.config import OutputError, run_main
from aligner.data.jsonl import read_jsonl
from aligner.demo.tokenizer import PRINTABLE_CHARACTERS, SPECIAL_TOKENS, train_char_tokenizer
from aligner.runtime.errors import ConfigError


def string_values(value: object) -> Iterator[str]:
    """All strings inside a JSON value (records nest labels in dicts)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from string_values(item)
    elif isinstance(value, list):
        for item in value:
            yield from string_values(item)


def read_texts(data_dir: Path) -> list[str]:
    paths = sorted(data_dir.glob("*.jsonl"))
    if not paths:
        raise ConfigError(
            f"no *.jsonl files in {data_dir}; write them first with "
            "examples/nlp/data/arithmetic/make_data.py --out-dir DIR"
        )
    texts = []
    for path in paths:
        for _, record in read_jsonl(path):
            texts.extend(string_values(record))
    return texts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="directory with *.jsonl files")
    parser.add_argument("--out-dir", type=Path, required=True, help="HF tokenizer directory to write")
    parser.add_argument("--printable", action="store_true",
                        help="also every printable ASCII character (tool calls, a tool environment's error messages)")
    args = parser.parse_args(argv)

    texts = read_texts(args.data_dir)
    try:
        train_char_tokenizer(texts, args.out_dir, PRINTABLE_CHARACTERS if args.printable else ())
    except OSError as error:
        raise OutputError(f"--out-dir {args.out_dir}: cannot write the tokenizer ({error.strerror or error})") from None

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.out_dir)
    special_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    print(f"{args.out_dir}: vocab size {len(tokenizer)} from {len(texts)} texts, special ids {special_ids}")


if __name__ == "__main__":
    run_main(main)
