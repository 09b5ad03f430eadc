"""Our engine against the strongest CPU generation anchors on the same weights: llama.cpp and tuned HF.

    python benchmarks/generation_anchors.py [--model smollm2] [--batches 1,8] [--prompt-tokens 16] \
        [--new-tokens 64] [--repeats 5] [--threads 2] [--no-llama-cpp] [--no-tuned-hf]

Sides, all fp32 on the same weights (`benchmarks/models.py`), all greedy and fixed length (every row gets exactly
--new-tokens tokens; stop tokens do not end a row):
- ours: the native engine (as generation.py runs it);
- ours general (where the engine's C++ decode step applies): the engine with ALIGNER_CPU_DECODE=general, its
  decode steps through torch's operations (aligner/generation/native/cpu_decode.py), so the C++ step's share of
  each ratio shows;
- HF: transformers' `generate` as users call it (dynamic cache, eager);
- tuned HF: `generate` on a static KV cache with the model's forward through `torch.compile` (the recipe
  transformers documents for fast generation), compiled in the warm-up;
- llama.cpp: llama-cpp-python built from source for this CPU (benchmarks/peer/setup_llama_cpp.sh, its own venv,
  never a project dependency) on the model converted by llama.cpp's own converter to an **F32** GGUF (the same
  values as ours); every batch: the rows are sequences of one `llama_decode` batch (peer/llama_cpp_worker.py,
  through the binding's low-level API, as llama.cpp's batched example drives it). It runs as a worker process
  taking turns with this one (peer/protocol.py) and times itself.
Each round runs every side at --new-tokens and at 1 new token (prefill + first token), the sides' order reversed
every other round; decode ms/token = (t_N - t_1) / (N - 1), medians over rounds. Printed per batch: each side's
tokens/s and decode step, greedy tokens equal to ours, and `ratio anchor_SIDE_bB_decode VALUE` = the side's decode
step / ours (above 1: ours is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

# torch.compile (tuned HF) compiles in this process, no pool of compile workers left running beside the timings
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
if not __package__:  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))  # the `peer` package

from peer.protocol import Worker, in_turn  # noqa: E402

from benchmarks.generation import load_sides, make_prompts  # noqa: E402
from benchmarks.machine import cpu_header, load_average  # noqa: E402
from benchmarks.run_bench import ratio_line  # noqa: E402

LLAMA_SETUP = REPO_ROOT / "benchmarks" / "peer" / "setup_llama_cpp.sh"
LLAMA_WORKER = REPO_ROOT / "benchmarks" / "peer" / "llama_cpp_worker.py"


def llama_python() -> Path:
    """The llama.cpp venv's python (built on first use; one line and exit 2 if that fails)."""
    done = subprocess.run(["bash", str(LLAMA_SETUP)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "llama.cpp setup failed")
    return Path(done.stdout.strip().splitlines()[-1]) / "bin" / "python"


def f32_gguf(python: Path, hf_dir: Path) -> Path:
    """The HF directory converted by llama.cpp's converter to an F32 GGUF beside it (once)."""
    target = hf_dir.parent / "model-f32.gguf"
    if target.is_file():
        return target
    converter = python.parent.parent / "share" / "llama.cpp" / "convert_hf_to_gguf.py"
    partial = target.with_suffix(".partial")
    done = subprocess.run([str(python), str(converter), str(hf_dir), "--outtype", "f32", "--outfile", str(partial)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {hf_dir}: {done.stderr.strip().splitlines()[-1:]}")
    os.replace(partial, target)
    return target


class Side:
    """One generator: `run(batch, new_tokens)` -> (seconds, the tokens of row 0..batch-1 as lists)."""

    def __init__(self, name: str, run: Callable[[int, int], tuple[float, list[list[int]]]], batches: set[int]):
        self.name, self.run, self.batches = name, run, batches


def timed_call(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per batch size")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per batch size (tuned HF compiles)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--no-tuned-hf", action="store_true")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    from aligner.config import run_main

    run_main(lambda: run(args, batches))


def run(args, batches: list[int]) -> None:
    from transformers import StaticCache

    from aligner.generation.engine import SamplingParams
    from aligner.generation.native import NativeEngine, cpu_decode
    from aligner.runtime import distributed
    from benchmarks.models import resolve_model

    torch.set_num_threads(args.threads)
    print(cpu_header(), flush=True)
    distributed.initialize(distributed.ParallelConfig())
    sides_models = load_sides(args.model)
    prompts = make_prompts(sides_models, max(batches), args.prompt_tokens)
    total = args.prompt_tokens + args.new_tokens
    engine = NativeEngine([sides_models.model], sides_models.cfg, pad_id=0, eos_id=2, max_batch_size=max(batches),
                          max_sequence_length=total)
    hf = sides_models.hf_model

    def ours(batch: int, new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens, greedy=True, fixed_length=True, seed=1)
        seconds, rollout = timed_call(lambda: engine.generate(prompts[:batch], params))
        return seconds, rollout.response_tokens[:, :new_tokens].tolist()

    def hf_generate(batch: int, new_tokens: int, static: bool):
        ids = torch.tensor(prompts[:batch])
        extra = {"past_key_values": StaticCache(config=hf.config, max_cache_len=total)} if static else {}

        def call():
            with torch.inference_mode():
                return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
                                   **extra)
        seconds, out = timed_call(call)
        return seconds, out[:, args.prompt_tokens:].tolist()

    def ours_general(batch: int, new_tokens: int):  # ours without the C++ decode step: what it gains
        os.environ[cpu_decode.SETTING_VARIABLE] = "general"
        try:
            return ours(batch, new_tokens)
        finally:
            os.environ[cpu_decode.SETTING_VARIABLE] = setting

    setting = os.environ.get(cpu_decode.SETTING_VARIABLE, "auto")
    sides = [Side("ours", ours, set(batches)), Side("HF", lambda b, n: hf_generate(b, n, False), set(batches))]
    ours(1, 2)
    cpu = engine.state.cpu_decode
    if cpu is not None and cpu.available():
        sides.insert(1, Side("ours general", ours_general, {batch for batch in batches if cpu.runs(batch)}))
    compiled: Optional[Callable] = None
    if not args.no_tuned_hf:
        eager_forward = hf.forward
        compiled = torch.compile(eager_forward, dynamic=False)

        def tuned(batch: int, new_tokens: int):
            hf.forward = compiled
            try:
                return hf_generate(batch, new_tokens, True)
            finally:
                hf.forward = eager_forward
        sides.append(Side("tuned HF", tuned, set(batches)))
    worker: Optional[Worker] = None
    scratch = Path(tempfile.mkdtemp(prefix="anchors-"))
    if not args.no_llama_cpp:
        python = llama_python()
        gguf = f32_gguf(python, resolve_model(args.model).hf_dir)
        (scratch / "prompts.json").write_text(json.dumps(prompts))
        worker = Worker("llama.cpp", [str(python), str(LLAMA_WORKER), str(gguf), str(scratch / "prompts.json"),
                                      str(scratch / "tokens.json"), str(args.threads), str(args.new_tokens)],
                        scratch / "llama.log", {"OMP_NUM_THREADS": str(args.threads)})
        worker.start()
        worker.expect("ready")

        def llama(batch: int, new_tokens: int):
            worker.send(f"step {batch} {new_tokens}")
            seconds, *_ = worker.expect("done")
            return float(seconds), json.loads((scratch / "tokens.json").read_text())
        sides.append(Side("llama.cpp", llama, set(batches)))
        print(f"llama.cpp: {gguf} (F32), llama-cpp-python {LLAMA_SETUP.name}'s build, {args.threads} threads")

    print(f"generation anchors: {sides_models.description}, fp32, greedy, prompts of {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens (fixed length), {args.threads} threads; {args.repeats} rounds per batch "
          f"after {args.warmup} warm-up rounds", flush=True)
    try:
        for batch in batches:
            report_batch(batch, [side for side in sides if batch in side.batches], args)
    finally:
        if worker is not None:
            worker.send("quit")
            worker.expect("rss")
            worker.close()
    distributed.shutdown()


def report_batch(batch: int, sides: list[Side], args) -> None:
    """Time every side at this batch size in alternating rounds; print their rows and ratio lines."""
    for _ in range(args.warmup):
        for side in sides:
            side.run(batch, args.new_tokens)
            side.run(batch, 1)
    full: dict[str, list[float]] = {side.name: [] for side in sides}
    first: dict[str, list[float]] = {side.name: [] for side in sides}
    tokens: dict[str, list[list[int]]] = {}
    for round_index in range(args.repeats):
        for side in in_turn(sides, round_index):
            seconds, tokens[side.name] = side.run(batch, args.new_tokens)
            full[side.name].append(seconds)
            first[side.name].append(side.run(batch, 1)[0])
    steps = {name: [(f - o) / (args.new_tokens - 1) for f, o in zip(full[name], first[name])] for name in full}
    print(f"batch {batch} (load {load_average():.2f})")
    ours_step = steps["ours"]
    for side in sides:
        name = side.name
        agree = sum(row == mine for row, mine in zip(tokens[name], tokens["ours"]))
        line = (f"  {name:<12} {batch * args.new_tokens / statistics.median(full[name]):8.1f} tokens/s  decode "
                f"{statistics.median(steps[name]) * 1e3:7.2f} ms/step (min {min(steps[name]) * 1e3:.2f})  prefill+1 "
                f"{statistics.median(first[name]) * 1e3:7.2f} ms")
        if name != "ours":
            ratio = statistics.median(theirs / mine for theirs, mine in zip(steps[name], ours_step))
            line += f"  decode vs ours {ratio:.2f}x  greedy rows equal to ours {agree} of {batch}"
            print(line)
            print(ratio_line(f"anchor_{name.lower().replace(' ', '_').replace('.', '_')}_b{batch}_decode", ratio))
        else:
            print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
