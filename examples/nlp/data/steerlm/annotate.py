"""Annotate SFT records with attribute values from a served attribute-prediction (regression) reward model.

    python examples/nlp/gpt/serve_reward_model.py init_from=ATTRIBUTE_RM normalize_rewards=false &
    python examples/nlp/data/steerlm/annotate.py --input sft.jsonl --output sft_annotated.jsonl \
        --attributes correctness --scale 0:4 --port 5555

SteerLM step 2. Each output line is the input record plus "attributes": {"correctness": 4}: the
model's score for the record, rounded to the nearest integer (halves up) and clipped to the
attribute's scale. The output is what `data.steerlm` conditioned SFT reads (aligner/data/steerlm.py).

- What is scored: each record is sent as a conversation, {"prompt": input, "response": output}, or
  for a {"conversations"}/{"messages"} record the turns before its last assistant turn and that
  turn; the server tokenizes it exactly as reward training tokenizes the same {"prompt",
  "response", "label"} record (its chat template, or [bos] + input + output + [eos] without one),
  so the score is of the tokens the attribute model was trained on (serve it with the
  chat_template and append_eos its training used).
  Other keys of a record are kept as they are; a record that already has "attributes" gets new ones.
- Many requests are in flight at once (--max-in-flight batches of --batch-size records), so the
  server's dynamic batcher keeps the model busy; lines are written in input order.
- Resumable: records already in --output (checked to be the same records, in order) are skipped,
  and a line cut off by an interrupted run is rewritten.
- The server must be started with normalize_rewards=false if the attribute model was trained with
  normalisation: the scales are those of the labels, not of normalised rewards.
"""
from __future__ import annotations

import argparse
import json
import math
from collections import deque
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from aligner.clients.reward import RewardClient
from aligner.config import OutputError, run_main
from aligner.data.jsonl import read_jsonl
from aligner.data.steerlm import ATTRIBUTES_KEY
from aligner.runtime.errors import UserError

SCORES_KEY = "attribute_scores"  # --keep-scores: the unrounded predictions

DEFAULT_SCALE = (0, 4)  # HelpSteer's 0..4 and the demo's correctness grades


class AnnotationError(UserError, ValueError):
    """Bad arguments or an output file that does not belong to the input."""


def parse_scales(items: list[str], attributes: list[str]) -> dict[str, tuple[int, int]]:
    """--scale values: "LO:HI" for every attribute, or "name=LO:HI" for one; default 0:4."""
    scales = {name: DEFAULT_SCALE for name in attributes}
    for item in items:
        name, equals, bounds = item.rpartition("=")
        low, colon, high = bounds.partition(":")
        try:
            low_value, high_value = int(low), int(high)
        except ValueError:
            low_value = high_value = None
        if not colon or low_value is None or low_value > high_value:
            raise AnnotationError(f"--scale {item!r}: expected LO:HI or NAME=LO:HI with integers LO <= HI, e.g. 0:4")
        if equals and name not in attributes:
            raise AnnotationError(f"--scale {item!r} names attribute {name!r}, not one of --attributes {attributes}")
        for target in ([name] if equals else attributes):
            scales[target] = (low_value, high_value)
    return scales


def to_scale(score: float, scale: tuple[int, int]) -> int:
    """A predicted score on the attribute's integer scale: nearest integer (halves up), clipped."""
    if not math.isfinite(score):
        raise AnnotationError(f"the reward model returned a non-finite score {score}")
    return int(min(max(math.floor(score + 0.5), scale[0]), scale[1]))


def record_sample(record: dict, path: str | Path, line: int) -> tuple:
    """(prompt, response) the attribute model scores for one SFT record."""
    from aligner.data.sft import prompt_and_answer  # torch + transformers: only when needed

    return prompt_and_answer(record, path, line)


def _unannotated(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in (ATTRIBUTES_KEY, SCORES_KEY)}


def count_done(output: Path, records: list[tuple[int, dict]]) -> int:
    """How many input records the output already holds; cuts off a partly written last line."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]  # an interrupted write leaves a line without its newline
    if len(complete) != len(data):
        with open(output, "r+b") as handle:
            handle.truncate(len(complete))
    lines = complete.decode("utf-8").splitlines()
    if len(lines) > len(records):
        raise AnnotationError(f"{output} has {len(lines)} lines but the input only {len(records)} records; "
                              "it was written from another input: delete it or choose another --output")
    for index, text in enumerate(lines):
        input_line, record = records[index]
        try:
            written = json.loads(text)
        except json.JSONDecodeError:
            written = None
        if (not isinstance(written, dict) or ATTRIBUTES_KEY not in written
                or _unannotated(written) != _unannotated(record)):
            raise AnnotationError(
                f"{output}:{index + 1} is not the annotation of input line {input_line}; the output was written "
                "from another input (or edited): delete it or choose another --output")
    return len(lines)


def annotate(records: list[tuple[int, dict]], input_path: Path, output: Path, client: RewardClient,
             attributes: list[str], scales: dict[str, tuple[int, int]], *, batch_size: int = 64,
             max_in_flight: int = 8, progress: bool = True, keep_scores: bool = False) -> int:
    """Annotate the records not yet in `output` (appending in order); returns how many were added."""
    done = count_done(output, records)
    todo = records[done:]
    samples = [record_sample(record, input_path, line) for line, record in todo]  # every error before sending
    bar = tqdm(total=len(records), initial=done, desc="annotating", unit="rec", disable=not progress)
    pending: deque = deque()  # (start index into todo, future), oldest first

    with open(output, "a", encoding="utf-8") as handle:
        def write_oldest() -> None:
            start, future = pending.popleft()
            scores = future.result()  # [batch, A]
            if scores.shape[1] != len(attributes):
                raise AnnotationError(f"the server returns {scores.shape[1]} attribute scores per text but "
                                      f"--attributes names {len(attributes)} ({', '.join(attributes)}); give the "
                                      "served model's attributes in its order")
            for (_, record), row in zip(todo[start:start + len(scores)], scores):
                values = {name: to_scale(float(score), scales[name]) for name, score in zip(attributes, row)}
                annotated = {**_unannotated(record), ATTRIBUTES_KEY: values}
                if keep_scores:
                    annotated[SCORES_KEY] = {name: float(score) for name, score in zip(attributes, row)}
                handle.write(json.dumps(annotated, ensure_ascii=False) + "\n")
            handle.flush()  # whole batches only: an interruption loses at most the batches in flight
            bar.update(len(scores))

        for start in range(0, len(todo), batch_size):
            if len(pending) >= max_in_flight:
                write_oldest()
            batch = samples[start:start + batch_size]
            pending.append((start, client.infer_conversations_async([prompt for prompt, _ in batch],
                                                                    [response for _, response in batch])))
        while pending:
            write_oldest()
    bar.close()
    return len(todo)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", type=Path, required=True,
                        help="JSONL of SFT records (input/output, conversations or messages)")
    parser.add_argument("--output", type=Path, required=True, help="annotated JSONL (appended to when resuming)")
    parser.add_argument("--attributes", required=True,
                        help="comma-separated attribute names, in the served model's output order, e.g. correctness")
    parser.add_argument("--scale", action="append", default=[],
                        help="integer scale LO:HI of every attribute, or NAME=LO:HI for one (repeatable); default 0:4")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5555)
    parser.add_argument("--model-name", default="reward_model")
    parser.add_argument("--limit", type=int, default=None, help="annotate only the first N records of --input")
    parser.add_argument("--batch-size", type=int, default=64, help="records per request")
    parser.add_argument("--max-in-flight", type=int, default=8, help="requests in flight at once")
    parser.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the server")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    parser.add_argument("--keep-scores", action="store_true",
                        help=f"also write the unrounded predictions as {SCORES_KEY!r}")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    """User errors raise (AnnotationError, DataError, ClientError, ...); run_main prints them as one line."""
    args = parse_args(argv)
    attributes = [name.strip() for name in args.attributes.split(",") if name.strip()]
    if not attributes:
        raise AnnotationError("--attributes names no attribute")
    scales = parse_scales(args.scale, attributes)
    if args.batch_size < 1 or args.max_in_flight < 1:
        raise AnnotationError("--batch-size and --max-in-flight must be >= 1")
    records = list(read_jsonl(args.input))[: args.limit]
    if not records:
        raise AnnotationError(f"{args.input} holds no records to annotate")
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"--output {args.output}: cannot create its directory ({error.strerror})") from None
    with RewardClient(args.host, args.port, args.model_name, timeout_s=args.request_timeout,
                      ready_timeout_s=args.ready_timeout, max_workers=args.max_in_flight) as client:
        client.wait_until_ready(timeout_s=args.ready_timeout)
        added = annotate(records, args.input, args.output, client, attributes, scales,
                         batch_size=args.batch_size, max_in_flight=args.max_in_flight,
                         progress=not args.no_progress, keep_scores=args.keep_scores)
    print(f"annotated {added} records ({len(records) - added} already in {args.output}); "
          f"{len(records)} in {args.output}")


if __name__ == "__main__":
    run_main(main)
