"""The demo task: two-digit addition with a demonstrator that systematically forgets carries.

A problem is a pair (a, b) with 0 <= a, b <= 99. The prompt is ``"12+7="`` and the response is the
bare sum ``"19"``; the tokenizer's eos token ends a response, the response text has no terminator.

Why a *systematic* error: greedy decoding picks a model's mode, and random demonstration noise is
never the mode, so an SFT model trained on randomly-noisy demonstrations is still right under greedy
decoding and leaves alignment nothing to fix. Here the demonstrator forgets the carry from the units
column on most carry problems (``p_forget_carry``, default 0.7), so the SFT model's mode is wrong
exactly on carry problems (45 % of all problems) and right elsewhere. Rewards
(:func:`score_response`), preference pairs and attribute labels all know the right answer, so
PPO/DPO/SteerLM/RLOO have something real and measurable to fix.

Every generator is a pure function of its arguments (it uses its own ``random.Random``, never the
global one), draws its problems from a fixed train/held-out split of the 10,000 problems, and
returns a list of plain dict records, the rows of the JSONL files ``make_data.py`` writes.
"""
from __future__ import annotations

import functools
import math
import random
import re
from typing import Sequence

from aligner.runtime.errors import ConfigError

MAX_OPERAND = 99
HELDOUT_FRACTION = 0.2
# Fixed, independent of any data seed: every stage and every seed agrees on which problems are
# held out, so held-out evaluation always uses problems no stage trained on.
SPLIT_SEED = 20261121
DEFAULT_P_FORGET_CARRY = 0.7
MAX_CORRECTNESS = 4
SPLITS = ("train", "heldout")

Problem = tuple[int, int]

_PROMPT_PATTERN = re.compile(r"(\d{1,2})\+(\d{1,2})=")


# ---------------------------------------------------------------------------------------------
# Problems, answers, the demonstrator's error


def format_prompt(a: int, b: int) -> str:
    """The prompt text of problem (a, b): ``"12+7="``."""
    _check_operands(a, b)
    return f"{a}+{b}="


def parse_prompt(prompt: str) -> Problem:
    """The operands (a, b) of a prompt ``"A+B="`` (surrounding whitespace allowed)."""
    match = _PROMPT_PATTERN.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(
            f"not an arithmetic prompt: {prompt!r}; expected 'A+B=' with integers "
            f"0 <= A, B <= {MAX_OPERAND} written without signs, spaces or leading '+', e.g. '12+7='"
        )
    return int(match.group(1)), int(match.group(2))


def correct_answer(a: int, b: int) -> str:
    """The right response to a+b: the decimal sum, without leading zeros (``"102"`` for 95+7)."""
    _check_operands(a, b)
    return str(a + b)


def has_carry(a: int, b: int) -> bool:
    """Whether the units column carries into the tens column (units digits sum to 10 or more)."""
    _check_operands(a, b)
    return a % 10 + b % 10 >= 10


def wrong_answer_forgot_carry(a: int, b: int) -> str:
    """The demonstrator's answer when it forgets the carry out of the units column.

    Column by column: the units digit is written correctly, ``(a + b) % 10``; the tens column is
    summed *without* the carried 1, and that tens sum is written out in full, so it may itself have
    two digits. The result is therefore always ``a + b - 10``: 18+5 -> "13" (not 23),
    95+7 -> "92" (not 102), 99+99 -> "188" (not 198), 5+5 -> "0" (not 10).
    Only defined for problems with a carry; elsewhere nothing is forgotten.
    """
    if not has_carry(a, b):
        raise ValueError(f"{a}+{b} has no carry, so there is no carry to forget")
    tens_without_carry = a // 10 + b // 10
    units = (a + b) % 10
    return str(tens_without_carry * 10 + units)


def demonstrate(a: int, b: int, rng: random.Random, p_forget_carry: float) -> str:
    """One demonstration of a+b: on carry problems the carry is forgotten with ``p_forget_carry``."""
    if has_carry(a, b) and rng.random() < p_forget_carry:
        return wrong_answer_forgot_carry(a, b)
    return correct_answer(a, b)


def plausible_wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong answer a careless solver would give: the forgot-carry answer on carry problems,
    otherwise the sum off by one or by ten (never negative, never the right answer)."""
    if has_carry(a, b):
        return wrong_answer_forgot_carry(a, b)
    total = a + b
    offsets = [offset for offset in (-1, 1, -10, 10) if total + offset >= 0]
    return str(total + rng.choice(offsets))


# ---------------------------------------------------------------------------------------------
# The train / held-out split


@functools.lru_cache(maxsize=None)
def _split() -> dict[str, tuple[Problem, ...]]:
    # Stratified by carry so both splits have exactly the natural 45 % share of carry problems.
    rng = random.Random(SPLIT_SEED)
    split: dict[str, list[Problem]] = {"train": [], "heldout": []}
    everything = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    for carry in (False, True):
        stratum = [problem for problem in everything if has_carry(*problem) == carry]
        rng.shuffle(stratum)
        num_heldout = round(len(stratum) * HELDOUT_FRACTION)
        split["heldout"] += stratum[:num_heldout]
        split["train"] += stratum[num_heldout:]
    return {name: tuple(sorted(problems)) for name, problems in split.items()}


def problems(split: str) -> tuple[Problem, ...]:
    """All problems of a split, sorted: ``"train"`` (8,000) or ``"heldout"`` (2,000)."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; expected one of {SPLITS}")
    return _split()[split]


def _draw(split: str, n: int, rng: random.Random) -> list[Problem]:
    """n problems of a split, in random order: without replacement until the split is used up,
    then again over a fresh shuffle (so every problem appears once before any appears twice)."""
    if n < 0:
        raise ConfigError(f"number of records must be >= 0, got {n}")
    pool = list(problems(split))
    drawn: list[Problem] = []
    while len(drawn) < n:
        rng.shuffle(pool)
        drawn += pool[: n - len(drawn)]
    return drawn


def _rng(purpose: str, seed: int) -> random.Random:
    # Distinct streams per generator: sft_records and rl_prompts with one seed draw different problems.
    return random.Random(f"{purpose}:{seed}")


# ---------------------------------------------------------------------------------------------
# Rewards and evaluation


def score_response(prompt: str | list, response_text: str) -> float:
    """The rule-based reward: 1.0 if the stripped response is exactly the right sum, else 0.0.

    Exact string match: "019" or "19." score 0. The prompt is a task prompt (see parse_prompt), or,
    as a conversational prompt file gives it, a list of {"role", "content"} messages whose last
    user turn is one.
    """
    if not isinstance(prompt, str):
        prompt = [message["content"] for message in prompt if message["role"] == "user"][-1]
    a, b = parse_prompt(prompt)
    return 1.0 if response_text.strip() == correct_answer(a, b) else 0.0


def accuracy(prompts: Sequence[str], responses: Sequence[str]) -> float:
    """Mean :func:`score_response` over paired prompts and responses."""
    _check_paired(prompts, responses)
    return sum(score_response(p, r) for p, r in zip(prompts, responses)) / len(prompts)


def accuracy_by_carry(prompts: Sequence[str], responses: Sequence[str]) -> dict[str, float]:
    """Accuracy overall and on carry / no-carry problems, with the group sizes.

    Returns ``{"all", "carry", "no_carry", "num_carry", "num_no_carry"}``; a group without problems
    has accuracy nan.
    """
    _check_paired(prompts, responses)
    scores: dict[bool, list[float]] = {True: [], False: []}
    for prompt, response in zip(prompts, responses):
        scores[has_carry(*parse_prompt(prompt))].append(score_response(prompt, response))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values) if values else math.nan

    return {
        "all": mean(scores[True] + scores[False]),
        "carry": mean(scores[True]),
        "no_carry": mean(scores[False]),
        "num_carry": len(scores[True]),
        "num_no_carry": len(scores[False]),
    }


def correctness_grade(prompt: str, response_text: str) -> int:
    """Graded correctness 0..4 of a response, by how far its value is from the right sum.

    4: right (same rule as score_response); 3: off by 1 or 2, or the right value with leading
    zeros; 2: off by 3..10 (a forgotten carry is off by exactly 10); 1: off by 11..50;
    0: further off, or not a plain non-negative number.
    """
    a, b = parse_prompt(prompt)
    text = response_text.strip()
    if text == correct_answer(a, b):
        return MAX_CORRECTNESS
    if not text.isdigit() or not text.isascii():
        return 0
    # Distance 0 here means the right value written non-canonically ("019"): not right, but close.
    distance = abs(int(text) - (a + b))
    if distance <= 2:
        return 3
    if distance <= 10:
        return 2
    if distance <= 50:
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Record generators (the rows of the JSONL files)


def sft_records(
    n: int, seed: int, p_forget_carry: float = DEFAULT_P_FORGET_CARRY, split: str = "train"
) -> list[dict]:
    """Demonstrations ``{"input": "18+5=", "output": "13"}`` from the careless demonstrator.

    Problems are drawn uniformly from the split, so carry problems keep their natural 45 % share;
    each carry demonstration is independently wrong (forgot-carry) with ``p_forget_carry``. Use
    ``split="heldout"`` for a validation set whose loss measures generalisation to unseen problems.
    """
    if not 0.0 <= p_forget_carry <= 1.0:
        raise ConfigError(f"p_forget_carry must be a probability in [0, 1], got {p_forget_carry}")
    rng = _rng(f"sft:{split}", seed)
    return [
        {"input": format_prompt(a, b), "output": demonstrate(a, b, rng, p_forget_carry)}
        for a, b in _draw(split, n, rng)
    ]


def correct_sft_records(n: int, seed: int) -> list[dict]:
    """Demonstrations ``{"input": "18+5=", "output": "23"}`` that are all right, from train problems.

    A careful demonstrator: the ground truth for self-play fine-tuning (SPIN), which can only move
    the model towards its demonstrations. Its own random stream, so its problems differ from
    :func:`sft_records`'.
    """
    rng = _rng("sft_correct", seed)
    return [{"input": format_prompt(a, b), "output": correct_answer(a, b)} for a, b in _draw("train", n, rng)]


def heldout_prompts(n: int | None = None, seed: int = 0) -> list[dict]:
    """Evaluation prompts ``{"prompt": "37+45=", "answer": "82"}`` from distinct held-out problems.

    n=None gives all 2,000 held-out problems; n larger than that is an error (no repeats).
    """
    pool_size = len(problems("heldout"))
    if n is None:
        n = pool_size
    if n > pool_size:
        raise ConfigError(f"asked for {n} held-out prompts but only {pool_size} held-out problems exist")
    return [
        {"prompt": format_prompt(a, b), "answer": correct_answer(a, b)}
        for a, b in _draw("heldout", n, _rng("heldout", seed))
    ]


def preference_records(n: int, seed: int, split: str = "train") -> list[dict]:
    """Preference pairs ``{"prompt", "chosen", "rejected"}``: chosen is always right, rejected
    always a plausible wrong answer (the forgot-carry answer on carry problems, else off by 1 or 10)."""
    rng = _rng(f"preference:{split}", seed)
    return [
        {
            "prompt": format_prompt(a, b),
            "chosen": correct_answer(a, b),
            "rejected": plausible_wrong_answer(a, b, rng),
        }
        for a, b in _draw(split, n, rng)
    ]


def unpaired_records(n: int, seed: int, split: str = "train") -> list[dict]:
    """KTO's unpaired feedback ``{"prompt", "completion", "label"}`` on n problems: each problem's right
    answer (label true) and a plausible wrong one (false), as in preference_records, as two examples."""
    return [{"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
            for pair in preference_records(n, seed, split) for side in ("chosen", "rejected")]


# Shares of the responses in attribute records: right, plausibly wrong, any number 0..198.
_ATTRIBUTE_RESPONSE_MIX = (("correct", 0.4), ("plausible_wrong", 0.4), ("random", 0.2))


def attribute_records(n: int, seed: int, split: str = "train") -> list[dict]:
    """Attribute-labelled samples ``{"text": "18+5=13", "label": {"correctness": 2}}`` (SteerLM).

    The one attribute is :func:`correctness_grade` (0..4) of the response. Responses are right
    (40 %), plausibly wrong as in preference_records (40 %), or a uniformly random number in
    0..198 (20 %), so every grade occurs.
    """
    rng = _rng(f"attributes:{split}", seed)
    kinds = [kind for kind, _ in _ATTRIBUTE_RESPONSE_MIX]
    weights = [weight for _, weight in _ATTRIBUTE_RESPONSE_MIX]
    records = []
    for a, b in _draw(split, n, rng):
        kind = rng.choices(kinds, weights)[0]
        if kind == "correct":
            response = correct_answer(a, b)
        elif kind == "plausible_wrong":
            response = plausible_wrong_answer(a, b, rng)
        else:
            response = str(rng.randint(0, 2 * MAX_OPERAND))
        prompt = format_prompt(a, b)
        records.append(
            {"text": prompt + response, "label": {"correctness": correctness_grade(prompt, response)}}
        )
    return records


def rl_prompts(n: int, seed: int) -> list[dict]:
    """Prompts ``{"prompt": "18+5="}`` for on-policy RL (PPO, RLOO), from train problems."""
    return [{"prompt": format_prompt(a, b)} for a, b in _draw("train", n, _rng("rl", seed))]


# ---------------------------------------------------------------------------------------------


def _check_operands(a: int, b: int) -> None:
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_OPERAND:
            raise ValueError(f"operand {name}={value!r} must be an int in 0..{MAX_OPERAND}")


def _check_paired(prompts: Sequence[str], responses: Sequence[str]) -> None:
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; they must pair up")
    if not prompts:
        raise ValueError("accuracy of zero responses is undefined; pass at least one")
