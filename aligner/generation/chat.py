"""Talking to a trained model: interactive multi-turn chat with streamed output, or a JSONL of prompts.

Entry point: examples/nlp/gpt/chat.py with aligner/conf/chat.yaml (schema `ChatConfig` below).

- init_from: an aligner checkpoint directory, a run directory (its latest intact checkpoint), a Hugging
  Face model directory or a .gguf file; the last two are imported once into the import cache
  (aligner.hf.sources).
- Prompts are encoded as every algorithm encodes them (`aligner.data.conversation.ChatEncoder`):
  with the tokenizer's chat template and its generation prompt (`chat_template: true`, a text
  prompt being one user turn); without a template or with `chat_template=false`, a text prompt
  is [bos] + text and messages take the plain "User:/Assistant:" layout.
- Interactive (no prompts_file): each user line is appended to the conversation, the whole
  conversation is encoded, and the reply is printed as it is generated, `stream_chunk_tokens`
  tokens at a time. /reset starts a new conversation, /exit (or end of input) quits.
- Batch (prompts_file + output_file): each record is {"prompt": text}, {"prompt": [messages]} or
  {"messages": [{"role", "content"}, ...]} (ending with the turn to answer); each output line is
  the input record plus "response" (and "error" if the record was too long). output_file is
  checked writable before the model is loaded, and its lines are written in input order as the
  answers come, so a batch stopped by SIGTERM/SIGINT keeps the answers so far (it says how many).

- steer (SteerLM): attribute values such as {correctness: 4} for a checkpoint trained with
  attribute-conditioned SFT; every prompt asks for them, rendered as in training
  (aligner/data/steerlm.py: a system message, or a line before a bare prompt).

Generation runs on `NativeEngine` (KV cache) with the `sampling:` options, greedy by default.
Stop tokens: the tokenizer's eos plus the eos id(s) of an imported model's generation_config.
Under torchrun the model may be split with TP/PP (one replica): rank 0 reads the input and
prints, every rank generates.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Dict, Iterator, Optional, TextIO

import torch.distributed as dist
from omegaconf import MISSING

from aligner import checkpointing
from aligner.config import OutputError, one_of
from aligner.data.conversation import ChatEncoder, parse_prompt, template_errors
from aligner.data.jsonl import DataError, read_jsonl
from aligner.data.steerlm import condition_messages, condition_prompt, steering_for_checkpoint
from aligner.generation.engine import GenerationEngine, SamplingParams
from aligner.generation.native import NativeEngine
from aligner.hf.convert import read_hf_source
from aligner.hf.sources import resolve_model_source
from aligner.models import lora
from aligner.models.gpt import GPTConfig, build_model_chunks
from aligner.runtime import distributed, seeds
from aligner.runtime.distributed import PRECISIONS, ParallelConfig, rank_and_world_from_env
from aligner.runtime.errors import ConfigError
from aligner.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aligner.data.conversation import ChatEncoder

COMMANDS_HELP = "/reset starts a new conversation, /exit quits"


@dataclass
class ChatSamplingConfig:
    """The `sampling:` section."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy (argmax)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 1234


@dataclass
class ChatConfig:
    """Schema of aligner/conf/chat.yaml (examples/nlp/gpt/chat.py)."""

    RENAMED_KEYS: ClassVar[tuple] = (("checkpoint", "init_from"),)

    init_from: str = MISSING  # checkpoint, run dir (its latest), HF model dir or .gguf (aligner.hf.sources)
    tokenizer_path: Optional[str] = None  # null: the checkpoint's tokenizer
    precision: str = one_of(PRECISIONS, "auto")
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: ChatSamplingConfig = field(default_factory=ChatSamplingConfig)
    system_prompt: Optional[str] = None  # interactive mode: a system message opening each conversation
    steer: Optional[Dict[str, int]] = None  # SteerLM checkpoint: attribute values to ask for, e.g. {correctness: 4}
    prompts_file: Optional[str] = None  # JSONL of {"prompt": text or messages} / {"messages": [...]}; null: interactive
    output_file: Optional[str] = None  # batch mode: where the responses go
    batch_size: int = 16  # batch mode: prompts per seeded batch; the engine's cache rows (refilled across batches)
    max_sequence_length: Optional[int] = None  # prompt + response tokens; null: model.max_position_embeddings
    stream_chunk_tokens: int = 4  # interactive mode: tokens generated between two prints
    chat_template: bool = True  # encode prompts with the tokenizer's chat template (if it has one)

    def validate(self) -> None:
        if (self.prompts_file is None) != (self.output_file is None):
            raise ConfigError("batch mode needs both prompts_file and output_file (neither for interactive chat)")
        for name in ("batch_size", "stream_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.sampling.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens must be >= 1, got {self.sampling.max_new_tokens}")

    def sampling_params(self, stop_token_ids: list[int]) -> SamplingParams:
        s = self.sampling
        return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                              top_p=s.top_p, greedy=s.temperature == 0, seed=s.seed, stop_token_ids=stop_token_ids)


# ----------------------------------------------------------------------------- loading
@dataclass
class ChatModel:
    """A loaded model ready to answer: generation engine, tokenizer, stop tokens, context size."""

    engine: GenerationEngine
    tokenizer: object  # aligner.tokenizer.Tokenizer
    stop_token_ids: list
    max_sequence_length: int
    vocab_size: int
    steerlm: object = None  # SteerLMConfig of a conditioned checkpoint when steering is asked for
    steer: Optional[dict] = None  # the attribute values every prompt asks for
    chunks: list = field(default_factory=list)  # the model chunks the engine runs (for scoring beside it)


def _log(line: str) -> None:
    """A start-up line on stderr (rank 0): stdout carries the conversation."""
    if _is_rank_zero():
        print(line, file=sys.stderr)


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def load_chat_model(cfg: ChatConfig, stack: contextlib.ExitStack) -> ChatModel:
    """Start the runtime, import an HF directory if given one, load the checkpoint, build the engine."""
    checkpoint = resolve_model_source(cfg.init_from, "init_from", _log)  # an HF/GGUF source: imported at TP=1
    steerlm = steering_for_checkpoint(checkpoint, cfg.steer)  # an error before loading if they do not fit
    data_parallel = distributed.initialize(cfg.parallel)
    if data_parallel != 1:
        raise ConfigError(
            f"chat runs one model replica: launch tensor_model_parallel_size x pipeline_model_parallel_size "
            f"processes, not {dist.get_world_size()}"
        )
    seeds.set_seed(cfg.sampling.seed)
    model_cfg = GPTConfig.from_dict(checkpointing.read_meta(checkpoint)["model"])
    tokenizer = Tokenizer(cfg.tokenizer_path or checkpoint / checkpointing.TOKENIZER_DIR)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model_cfg.vocab_size}")
    chunks = build_model_chunks(model_cfg, cfg.parallel, distributed.resolve_precision(cfg.precision))
    lora.load_for_inference(checkpoint, chunks)  # an adapter checkpoint: onto its base, adapters live
    for chunk in chunks:
        chunk.eval()
    max_length = cfg.max_sequence_length or model_cfg.max_position_embeddings
    engine = NativeEngine(chunks, model_cfg, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
                          max_batch_size=cfg.batch_size if cfg.prompts_file else 1, max_sequence_length=max_length)
    stop = {tokenizer.eos_id}
    generation_config = read_hf_source(checkpoint).get("generation_config") or {}
    eos = generation_config.get("eos_token_id")
    stop.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ChatModel(engine, tokenizer, sorted(stop), max_length, model_cfg.vocab_size, steerlm,
                     None if cfg.steer is None else dict(cfg.steer), chunks=list(chunks))


# ----------------------------------------------------------------------------- generating
def generate_tokens(model: ChatModel, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    """New tokens of each prompt, cut after the first stop token (kept). Batch mode streams through
    NativeEngine.generate_stream instead (`answer_file`)."""
    rollout = model.engine.generate(prompts, sampling)
    return [rollout.response_tokens[row, : int(rollout.response_lengths[row])].tolist() for row in range(len(prompts))]


def stream_reply(model: ChatModel, prompt: list[int], sampling: SamplingParams, chunk_tokens: int,
                 write: Callable[[str], None]) -> list[int]:
    """Generate a reply `chunk_tokens` at a time, writing the decoded text as it grows; returns its tokens.

    Greedy replies equal one-shot generation (each chunk continues the prompt plus the tokens so
    far); sampled chunks use seed + tokens so far, so no two chunks reuse a noise stream.
    """
    reply: list[int] = []
    printed = ""
    stop = set(model.stop_token_ids)
    while len(reply) < sampling.max_new_tokens:
        budget = min(chunk_tokens, sampling.max_new_tokens - len(reply))
        step = dataclasses.replace(sampling, max_new_tokens=budget, seed=sampling.seed + len(reply))
        new = generate_tokens(model, [prompt + reply], step)[0]
        reply += new
        text = model.tokenizer.decode([t for t in reply if t not in stop])
        ready = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
        if ready.startswith(printed) and len(ready) > len(printed):
            write(ready[len(printed):])
            printed = ready
        if not new or new[-1] in stop:
            break
    text = model.tokenizer.decode([t for t in reply if t not in stop])
    if text.startswith(printed) and len(text) > len(printed):
        write(text[len(printed):])
    return reply


def steered_messages(model: ChatModel, messages: list[dict]) -> list[dict]:
    """The messages as the model sees them: with the requested attribute values when steering."""
    return messages if model.steer is None else condition_messages(messages, model.steer, model.steerlm)


def steered_prompt(model: ChatModel, prompt: str) -> str:
    return prompt if model.steer is None else condition_prompt(prompt, model.steer, model.steerlm)


def response_text(model: ChatModel, tokens: list[int]) -> str:
    stop = set(model.stop_token_ids)
    return model.tokenizer.decode([t for t in tokens if t not in stop])


# ----------------------------------------------------------------------------- modes
def _broadcast(value):
    """Rank 0's value on every rank (the input is read on rank 0 only)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_lines(stream: TextIO, out: TextIO) -> Iterator[Optional[str]]:
    """User lines (rank 0 reads, every rank gets them); None at end of input."""
    while True:
        line = None
        if _is_rank_zero():
            out.write("user> ")
            out.flush()
            raw = stream.readline()
            line = raw.rstrip("\n") if raw else None
        line = _broadcast(line)
        yield line
        if line is None:
            return


def chat_interactive(model: ChatModel, cfg: ChatConfig, stream: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    """The read-reply loop; returns the number of replies given."""

    def write(text: str) -> None:
        if _is_rank_zero():
            out.write(text)
            out.flush()

    encoder = ChatEncoder(model.tokenizer, cfg.chat_template)
    sampling = cfg.sampling_params(model.stop_token_ids)
    opening = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages = list(opening)
    write(f"chat with {cfg.init_from} ({COMMANDS_HELP})\n")
    replies = 0
    for line in _read_lines(stream, out):
        if line is None or line.strip() in ("/exit", "/quit"):
            write("\n" if line is None else "")
            break
        if line.strip() == "/reset":
            messages = list(opening)
            write("(new conversation)\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = encoder.prompt_tokens(steered_messages(model, messages))
        if len(prompt) + sampling.max_new_tokens > model.max_sequence_length:
            messages.pop()
            write(f"(the conversation is {len(prompt)} tokens; with max_new_tokens={sampling.max_new_tokens} it "
                  f"does not fit the model's {model.max_sequence_length}: /reset to start over)\n")
            continue
        write("assistant> ")
        reply = stream_reply(model, prompt, sampling, cfg.stream_chunk_tokens, write)
        write("\n")
        messages.append({"role": "assistant", "content": response_text(model, reply)})
        replies += 1
    return replies


def encode_record(model: ChatModel, encoder: ChatEncoder, record: dict, path: str, line: int) -> list[int]:
    """Prompt tokens of one batch-mode record, {"prompt": text or messages} or {"messages": [...]},
    steered when asked to (`ChatEncoder.prompt_tokens` of the steered prompt)."""
    if "messages" not in record and "prompt" not in record:
        raise DataError(f"{path}:{line}: record has neither 'prompt' nor 'messages' "
                        f"(keys present: {', '.join(sorted(map(repr, record))) or 'none'})")
    prompt = parse_prompt(record, "messages" if "messages" in record else "prompt", path, line)
    prompt = steered_prompt(model, prompt) if isinstance(prompt, str) else steered_messages(model, prompt)
    with template_errors(path, line):
        return encoder.prompt_tokens(prompt)


def require_writable_output(cfg: ChatConfig) -> None:
    """Batch mode, before the model is loaded: an OutputError naming output_file unless it can be written
    (an existing file is opened for appending, so a refused run leaves it as it was) and is not the input."""
    path = Path(cfg.output_file)
    if path.exists() and Path(cfg.prompts_file).exists() and path.samefile(cfg.prompts_file):
        raise OutputError(f"output_file={path} is the prompts_file: answering would overwrite the prompts")
    existing = next(parent for parent in path.parents if parent.exists())
    if not existing.is_dir():  # (mkdir would say "File exists")
        raise OutputError(f"output_file={path} is not writable ({existing} is a file, not a directory)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=path.parent, prefix=".write_check_"):
                pass
    except OSError as error:
        raise OutputError(f"output_file={path} is not writable ({error.strerror or error})") from None


class AnswerWriter:
    """Batch mode's output file (rank 0 writes it): each record's line goes out, unbuffered, once it and every
    record before it are answered, so the file always holds whole lines: the answers so far, in input order."""

    def __init__(self, path: Path, total: int):
        self.path, self.total = path, total
        self._ready: dict[int, dict] = {}
        self._next = 0  # the position of the next line to write
        self._file = None
        if _is_rank_zero():
            try:
                self._file = open(path, "wb", buffering=0)
            except OSError as error:
                raise OutputError(f"output_file={path} is not writable ({error.strerror or error})") from None

    def put(self, position: int, output: dict) -> None:
        self._ready[position] = output
        while self._next in self._ready:
            line = memoryview((json.dumps(self._ready.pop(self._next), ensure_ascii=False) + "\n").encode("utf-8"))
            if self._file is not None:
                try:
                    while line:  # a raw write may take part of it (one write call for a line, in practice)
                        line = line[self._file.write(line):]
                except OSError as error:
                    raise OutputError(f"output_file={self.path}: cannot write answer {self._next + 1} of "
                                      f"{self.total} ({error.strerror or error}); the {self._next} before it "
                                      "are in the file") from None
            self._next += 1

    def written(self) -> int:
        """Lines in the file (rank 0; counted, not tracked: a signal may land between a write and its count)."""
        if self._file is None:
            return self._next
        self._file.flush()
        with open(self.path, "rb") as handle:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def answer_file(model: ChatModel, cfg: ChatConfig) -> int:
    """Batch mode: one output line per input record, written as the answers come; returns the number of
    records answered. Interrupted (SIGTERM/SIGINT), it says how many answers the file holds and re-raises."""
    encoder = ChatEncoder(model.tokenizer, cfg.chat_template)
    sampling = cfg.sampling_params(model.stop_token_ids)
    records = list(read_jsonl(cfg.prompts_file))
    outputs: list[dict] = []
    pending: list[tuple[int, list[int]]] = []  # (position in outputs, prompt tokens)
    for line, record in records:  # every record encoded (a bad one refused) before the output file is opened
        prompt = encode_record(model, encoder, record, cfg.prompts_file, line)
        outputs.append(dict(record))
        if len(prompt) + sampling.max_new_tokens > model.max_sequence_length:
            outputs[-1].update(response=None, error=(
                f"prompt of {len(prompt)} tokens + max_new_tokens={sampling.max_new_tokens} exceeds "
                f"max_sequence_length={model.max_sequence_length}"))
            continue
        pending.append((len(outputs) - 1, prompt))
    # Batches of batch_size streamed through the engine (rows freed by short answers are refilled from the
    # next batch). Rows are seeded by their position in a batch: offset the seed so batches differ.
    requests = iter([(start, [p for _, p in pending[start:start + cfg.batch_size]],
                      dataclasses.replace(sampling, seed=sampling.seed + start))
                     for start in range(0, len(pending), cfg.batch_size)])
    longest = max((len(p) for _, p in pending), default=0)
    generated = {position for position, _ in pending}
    writer = AnswerWriter(Path(cfg.output_file), len(outputs))
    try:
        for position, output in enumerate(outputs):
            if position not in generated:  # answered already: too long to generate
                writer.put(position, output)
        for start, rollout in model.engine.generate_stream(lambda: next(requests, None), longest_prompt=longest):
            for row, (position, _) in enumerate(pending[start:start + cfg.batch_size]):
                tokens = rollout.response_tokens[row, : int(rollout.response_lengths[row])].tolist()
                outputs[position]["response"] = response_text(model, tokens)
                writer.put(position, outputs[position])
    except KeyboardInterrupt:  # a signal (aligner.runtime.stopping): run_main says which and exits 128 + it
        if _is_rank_zero():
            written = writer.written()
            print(f"{written} of {len(outputs)} answers written to {cfg.output_file} (in input order; the other "
                  f"{len(outputs) - written} were not)", file=sys.stderr, flush=True)
        raise
    finally:
        writer.close()
    return len(outputs)


def run_chat(cfg: ChatConfig, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> None:
    """Load the model and run batch or interactive mode (the whole entry point)."""
    cfg.validate()
    if cfg.prompts_file and rank_and_world_from_env()[0] == 0:  # rank 0 writes it; found before the model loads
        require_writable_output(cfg)
    with contextlib.ExitStack() as stack:
        model = load_chat_model(cfg, stack)
        try:
            if cfg.prompts_file:
                count = answer_file(model, cfg)
                if _is_rank_zero():
                    print(f"wrote {count} responses to {cfg.output_file}", file=stdout, flush=True)
            else:
                chat_interactive(model, cfg, stdin, stdout)
        finally:
            model.engine.free()
            distributed.shutdown()
