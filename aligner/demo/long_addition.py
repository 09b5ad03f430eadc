"""The demo's agentic task: long additions (3- and 4-digit operands) with a calculator the model may call.

A problem is a pair (a, b) with 100 <= a, b <= 9999 (each operand's length, 3 or 4 digits, drawn first). The
prompt is ``"1234+5678="``; the answer is the bare sum ``"6912"``. A small character model cannot add such numbers
reliably in its head: a right answer needs every carry of up to four columns, and the demonstrator forgets them.

The demonstrations are conversations (`sft_records`). With ``p_call`` the demonstrator calls the calculator in the
toy model's tool-call format (``plain``: a line ``CALL calculate {json}``) and copies the tool's answer:

    user       1234+5678=
    assistant  CALL calculate {"expression": "1234+5678"}
    tool       6912
    assistant  6912

Otherwise it answers in its head with the habit of the two-digit task (`aligner.demo.arithmetic`): on a problem
with a carry it forgets every carry (``p_forget_carry``), each column written without the carry into it
(`wrong_answer_forgot_carries`). So the SFT model calls the tool on some problems and answers with the habit on the
others; RL with the calculator available can learn to call it always, RL without it only to add in its head.

Held-out problems (a fixed fifth of all pairs, by a hash of the pair, independent of any seed) are never drawn for
training. Every generator is a pure function of its arguments and returns plain dict records (JSONL rows).
"""
from __future__ import annotations

import json
import random
import re
import zlib
from typing import Sequence

from aligner.runtime.errors import ConfigError

MIN_OPERAND, MAX_OPERAND = 100, 9999
DEFAULT_P_CALL = 0.3
DEFAULT_P_FORGET_CARRY = 0.7
TOOL_NAME = "calculate"  # aligner/agents/builtin.py:calculate, offered as rollout.tools=[calculator]
SPLITS = ("train", "heldout")

Problem = tuple[int, int]

_PROMPT_PATTERN = re.compile(r"(\d{3,4})\+(\d{3,4})=")


def format_prompt(a: int, b: int) -> str:
    """The prompt text of problem (a, b): ``"1234+567="``."""
    _check_operands(a, b)
    return f"{a}+{b}="


def parse_prompt(prompt: str | list) -> Problem:
    """The operands of a prompt ``"A+B="`` (or of the last user turn of a list of messages)."""
    if not isinstance(prompt, str):
        prompt = [message["content"] for message in prompt if message["role"] == "user"][-1]
    match = _PROMPT_PATTERN.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"not a long-addition prompt: {prompt!r}; expected 'A+B=' with operands of 3 or 4 digits, "
                         "e.g. '1234+567='")
    return int(match.group(1)), int(match.group(2))


def carries(a: int, b: int) -> int:
    """How many columns carry into the next one."""
    _check_operands(a, b)
    count, carry = 0, 0
    while a or b:
        carry = int(a % 10 + b % 10 + carry >= 10)
        count += carry
        a, b = a // 10, b // 10
    return count


def wrong_answer_forgot_carries(a: int, b: int) -> str:
    """The demonstrator's answer when it forgets every carry: each column's digit sum without the carry into it,
    the last column written in full (so 958+167 -> "1015", not 1125; as `arithmetic.wrong_answer_forgot_carry` does
    for two digits). Only defined for problems with a carry."""
    if not carries(a, b):
        raise ValueError(f"{a}+{b} has no carry, so there is no carry to forget")
    digits, place = 0, 1
    while a >= 10 or b >= 10:
        digits += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return str(digits + (a + b) * place)


def tool_call(a: int, b: int) -> str:
    """The model's call of the calculator in the plain tool-call format."""
    return f"CALL {TOOL_NAME} {json.dumps({'expression': f'{a}+{b}'})}"


def conversation(a: int, b: int, rng: random.Random, p_call: float, p_forget_carry: float) -> list[dict]:
    """One demonstration of a+b (see the module docstring)."""
    prompt = {"role": "user", "content": format_prompt(a, b)}
    if rng.random() < p_call:
        answer = str(a + b)
        return [prompt, {"role": "assistant", "content": tool_call(a, b)}, {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer}]
    forget = carries(a, b) and rng.random() < p_forget_carry
    return [prompt, {"role": "assistant", "content": wrong_answer_forgot_carries(a, b) if forget else str(a + b)}]


def in_split(a: int, b: int) -> str:
    """"heldout" for a fixed fifth of all problems (a hash of the pair, the same for every seed), else "train"."""
    return "heldout" if zlib.crc32(f"{a}+{b}".encode()) % 5 == 0 else "train"


def _draw(split: str, n: int, rng: random.Random) -> list[Problem]:
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; expected one of {SPLITS}")
    if n < 0:
        raise ConfigError(f"number of records must be >= 0, got {n}")
    drawn: list[Problem] = []
    while len(drawn) < n:
        a, b = (rng.randint(*rng.choice([(100, 999), (1000, MAX_OPERAND)])) for _ in range(2))
        if in_split(a, b) == split:
            drawn.append((a, b))
    return drawn


def _rng(purpose: str, seed: int) -> random.Random:
    return random.Random(f"long_addition:{purpose}:{seed}")


def sft_records(n: int, seed: int, p_call: float = DEFAULT_P_CALL, p_forget_carry: float = DEFAULT_P_FORGET_CARRY,
                split: str = "train") -> list[dict]:
    """Demonstrations ``{"messages": [...]}``: with ``p_call`` a calculator call and its answer copied, else an
    answer in the head that forgets the carries with ``p_forget_carry``."""
    for name, value in (("p_call", p_call), ("p_forget_carry", p_forget_carry)):
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"{name} must be a probability in [0, 1], got {value}")
    rng = _rng(f"sft:{split}", seed)
    return [{"messages": conversation(a, b, rng, p_call, p_forget_carry)} for a, b in _draw(split, n, rng)]


def rl_prompts(n: int, seed: int) -> list[dict]:
    """Prompts ``{"prompt": "1234+567="}`` for RL, from train problems."""
    return [{"prompt": format_prompt(a, b)} for a, b in _draw("train", n, _rng("rl", seed))]


def heldout_prompts(n: int, seed: int = 0) -> list[dict]:
    """Evaluation prompts ``{"prompt", "answer"}`` of distinct held-out problems."""
    rng, seen, records = _rng("heldout", seed), set(), []
    while len(records) < n:
        (a, b), = _draw("heldout", 1, rng)
        if (a, b) not in seen:
            seen.add((a, b))
            records.append({"prompt": format_prompt(a, b), "answer": str(a + b)})
    return records


def score_response(prompt: str | list, response_text: str) -> float:
    """The reward of a final answer: 1.0 if the stripped text is exactly the sum, else 0.0 (a tool call left as the
    answer scores 0)."""
    a, b = parse_prompt(prompt)
    return 1.0 if response_text.strip() == str(a + b) else 0.0


def accuracy(prompts: Sequence[str], responses: Sequence[str]) -> dict[str, float]:
    """Accuracy overall and on problems with and without a carry, with the group sizes (nan for an empty group)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"{len(prompts)} prompts and {len(responses)} responses: they must pair up, at least one")
    scores: dict[bool, list[float]] = {True: [], False: []}
    for prompt, response in zip(prompts, responses):
        scores[carries(*parse_prompt(prompt)) > 0].append(score_response(prompt, response))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else float("nan")

    return {"all": mean(scores[True] + scores[False]), "carry": mean(scores[True]), "no_carry": mean(scores[False]),
            "num_carry": len(scores[True]), "num_no_carry": len(scores[False])}


def _check_operands(a: int, b: int) -> None:
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, int) or isinstance(value, bool) or not MIN_OPERAND <= value <= MAX_OPERAND:
            raise ValueError(f"operand {name}={value!r} must be an int in {MIN_OPERAND}..{MAX_OPERAND}")
