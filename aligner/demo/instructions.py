"""The real-model demo's task: everyday requests carrying one or two checkable constraints (IFEval-style).

A prompt is a request sentence ("Give some advice about keeping houseplants alive.") followed by one
sentence per constraint ("Answer in all lowercase letters. Do not use any commas."). Each constraint
type renders its sentence from its parameters, parses it back out of a prompt, and checks a response;
so a reward function needs nothing but the prompt and the response (the RL actor's
`reward.function` contract).

The held-out split shares no topic and no parameter value (word counts, words, phrases, JSON keys)
with the training split: a model that learned "lowercase" or "at most N words" in general passes
held-out prompts, one that memorised the training prompts does not.

Every generator is a pure function of its arguments (its own `random.Random`).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

SPLITS = ("train", "heldout")

# ---------------------------------------------------------------------------------------------
# Requests: task templates x topics (held-out topics never appear in training)

TASKS = (
    "Give some advice about {topic}.",
    "Explain {topic} to a friend.",
    "Write a short note about {topic}.",
    "Describe {topic} in simple terms.",
    "What should a beginner know about {topic}?",
    "Tell me why {topic} matters.",
    "Share a few tips on {topic}.",
    "Summarise what you know about {topic}.",
)

TOPICS = {
    "train": (
        "cooking pasta", "morning routines", "recycling at home", "learning a new language", "riding a bike",
        "saving money", "planting tomatoes", "writing a cover letter", "drinking enough water", "walking a dog",
        "cleaning a kitchen", "making friends", "reading before bed", "packing for a trip", "baking bread",
        "studying for exams", "keeping a diary", "fixing a flat tire", "brewing tea", "running a first mile",
        "sleeping well", "organising a desk", "visiting a museum", "choosing a book", "painting a room",
        "taking the bus", "caring for a cat", "learning to swim", "planning a birthday party",
        "staying focused", "feeding birds", "going camping", "writing a poem", "using a map",
        "making pancakes", "stretching after exercise", "washing clothes", "growing herbs",
        "playing chess", "taking photos", "learning to draw", "buying a used car", "making soup",
        "calling a friend", "hiking in the rain", "keeping a budget", "cutting vegetables", "singing in a choir",
    ),
    "heldout": (
        "keeping houseplants alive", "sharpening a pencil", "building a sandcastle", "flying a kite",
        "ironing a shirt", "watching the stars", "knitting a scarf", "wrapping a present", "picking ripe fruit",
        "writing a thank-you card", "setting a table", "learning to juggle", "feeding a goldfish",
        "making lemonade", "tying a tie", "carving a pumpkin", "cleaning windows", "training a puppy",
        "sorting old photos", "choosing running shoes", "visiting a farm", "baking cookies", "mending a sock",
        "watering a garden", "learning to whistle",
    ),
}

# Parameter pools: disjoint between the splits.
WORD_LIMITS = {"train": (8, 10, 15, 20, 30), "heldout": (12, 25)}
BULLET_COUNTS = {"train": (2, 3), "heldout": (4,)}
INCLUDE_WORDS = {"train": ("simple", "today", "always", "careful", "happy", "water", "friend", "time"),
                 "heldout": ("bright", "patience", "morning", "gentle")}
EXCLUDE_WORDS = {"train": ("very", "really", "good", "just"), "heldout": ("make", "will", "your")}
END_PHRASES = {"train": ("Hope this helps.", "That is all.", "Have a nice day."),
               "heldout": ("Any other questions?", "Good luck!")}
START_WORDS = {"train": ("Sure", "Well", "First", "Yes"), "heldout": ("Okay", "Honestly")}
JSON_KEYS = {"train": (("tip", "reason"), ("answer", "summary"), ("idea", "example")),
             "heldout": (("advice", "why"), ("main", "extra"))}


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9']+", text)


def _strip_fence(text: str) -> str:
    """A JSON answer may come in a markdown code fence."""
    fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.DOTALL)
    return fenced.group(1) if fenced else text


@dataclass(frozen=True)
class ConstraintType:
    """One kind of checkable constraint: how its sentence reads, how to find it in a prompt, how to check.

    pattern: a regex matching the rendered sentence, its non-empty groups the parameters as `render` wrote
    them; check(response, params, request) -> bool.
    """

    name: str
    template: str  # str.format template over the parameters
    pattern: str
    pools: Optional[dict]  # split -> parameter values (None: the constraint has no parameter)
    check: Callable[[str, tuple, str], bool]
    conflicts: tuple = ()

    def render(self, params: tuple) -> str:
        return self.template.format(*params)


def _letter_share(response: str, case: Callable[[str], bool]) -> float:
    letters = [char for char in response if char.isalpha()]
    return sum(map(case, letters)) / len(letters) if letters else 0.0


def _lowercase(response, params, request):
    return bool(re.search(r"[a-z]", response)) and response == response.lower()


def _uppercase(response, params, request):
    return bool(re.search(r"[A-Z]", response)) and response == response.upper()


def _max_words(response, params, request):
    return 0 < len(_words(response)) <= int(params[0])


def _bullets(response, params, request):
    return _bullet_count(response) == int(params[0])


def _include(response, params, request):
    return params[0].lower() in (word.lower() for word in _words(response))


def _exclude(response, params, request):
    return bool(response.strip()) and params[0].lower() not in (word.lower() for word in _words(response))


def _ends_with(response, params, request):
    return response.strip().endswith(params[0])


def _no_commas(response, params, request):
    return bool(response.strip()) and "," not in response


def _starts_with(response, params, request):
    words = _words(response)
    return bool(words) and words[0].lower() == params[0].lower()


def _json_keys(response, params, request):
    try:
        value = json.loads(_strip_fence(response))
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(params)


def _repeats_request(response, params, request):
    return response.strip().startswith(request)


def _quoted(response, params, request):
    text = response.strip()
    return len(text) >= 2 and text.startswith('"') and text.endswith('"')


def _bullet_count(response: str) -> int:
    return sum(1 for line in response.strip().splitlines() if re.match(r"\s*[-*•] ", line))


def _json_credit(response, params, request):
    text = _strip_fence(response).strip()
    try:
        value = json.loads(text)
    except ValueError:
        return 0.25 * text.startswith("{")
    return 0.5 + 0.25 * (len(set(value) & set(params)) / len(params)) if isinstance(value, dict) else 0.25


def _repeat_credit(response, params, request):
    wanted, given = request.split(), response.strip().split()
    matched = next((i for i, (a, b) in enumerate(zip(wanted, given)) if a != b), min(len(wanted), len(given)))
    return 0.9 * matched / len(wanted)


def _quoted_credit(response, params, request):
    text = response.strip()
    return 0.4 * (text[:1] == '"') + 0.4 * (text[-1:] == '"')


# Partial credit of a response that fails a constraint: how close it comes, below 1 (the RL reward's
# shaping: a constraint the model never meets at first still gives a group of samples a direction).
# Types without an entry get 0.
CREDITS = {
    "lowercase": lambda response, params, request: 0.9 * _letter_share(response, str.islower),
    "uppercase": lambda response, params, request: 0.9 * _letter_share(response, str.isupper),
    "max_words": lambda response, params, request: 0.9 * int(params[0]) / max(len(_words(response)), 1),
    "bullets": lambda response, params, request: 0.5 / (1 + abs(_bullet_count(response) - int(params[0]))),
    "end_phrase": lambda response, params, request: 0.5 * (params[0] in response),
    "no_commas": lambda response, params, request: 0.5 / (1 + response.count(",")),
    "json_keys": _json_credit,
    "repeat_request": _repeat_credit,
    "quoted": _quoted_credit,
}


CONSTRAINT_TYPES = {kind.name: kind for kind in (
    ConstraintType("lowercase", "Answer in all lowercase letters.", r"Answer in all lowercase letters\.()",
                   None, _lowercase, conflicts=("uppercase", "start_word", "end_phrase", "json_keys")),
    ConstraintType("uppercase", "Answer in all capital letters.", r"Answer in all capital letters\.()",
                   None, _uppercase, conflicts=("lowercase", "start_word", "end_phrase", "json_keys")),
    ConstraintType("max_words", "Answer in at most {0} words.", r"Answer in at most (\d+) words\.",
                   WORD_LIMITS, _max_words, conflicts=("bullets", "json_keys", "repeat_request")),
    ConstraintType("bullets", "Answer with exactly {0} bullet points, each on its own line starting with \"- \".",
                   r"Answer with exactly (\d+) bullet points, each on its own line starting with \"- \"\.",
                   BULLET_COUNTS, _bullets, conflicts=("max_words", "json_keys", "quoted", "repeat_request")),
    ConstraintType("include_word", "Include the word \"{0}\" in your answer.",
                   r"Include the word \"([A-Za-z]+)\" in your answer\.", INCLUDE_WORDS, _include,
                   conflicts=("uppercase",)),
    ConstraintType("exclude_word", "Do not use the word \"{0}\".", r"Do not use the word \"([A-Za-z]+)\"\.",
                   EXCLUDE_WORDS, _exclude),
    ConstraintType("end_phrase", "End your answer with the exact phrase \"{0}\"",
                   r"End your answer with the exact phrase \"([^\"]+)\"", END_PHRASES, _ends_with,
                   conflicts=("lowercase", "uppercase", "json_keys", "quoted")),
    ConstraintType("no_commas", "Do not use any commas.", r"Do not use any commas\.()", None, _no_commas,
                   conflicts=("json_keys",)),
    ConstraintType("start_word", "Start your answer with the word \"{0}\".",
                   r"Start your answer with the word \"([A-Za-z]+)\"\.", START_WORDS, _starts_with,
                   conflicts=("lowercase", "uppercase", "json_keys", "quoted", "repeat_request")),
    ConstraintType("json_keys", "Answer only with a JSON object with the keys \"{0}\" and \"{1}\".",
                   r"Answer only with a JSON object with the keys \"([a-z]+)\" and \"([a-z]+)\"\.", JSON_KEYS,
                   _json_keys, conflicts=("lowercase", "uppercase", "max_words", "bullets", "end_phrase",
                                          "no_commas", "start_word", "repeat_request", "quoted")),
    ConstraintType("repeat_request", "First repeat the request above word for word, then answer.",
                   r"First repeat the request above word for word, then answer\.()", None, _repeats_request,
                   conflicts=("max_words", "bullets", "start_word", "json_keys", "quoted")),
    ConstraintType("quoted", "Wrap your whole answer in double quotation marks.",
                   r"Wrap your whole answer in double quotation marks\.()", None, _quoted,
                   conflicts=("bullets", "end_phrase", "start_word", "json_keys", "repeat_request")),
)}


# ---------------------------------------------------------------------------------------------
# Prompts


@dataclass(frozen=True)
class Instruction:
    request: str  # the task sentence
    constraints: tuple  # ((type name, params), ...)

    @property
    def prompt(self) -> str:
        sentences = [CONSTRAINT_TYPES[name].render(params) for name, params in self.constraints]
        return " ".join([self.request, *sentences])


def _params(kind: ConstraintType, split: str, rng: random.Random) -> tuple:
    if kind.pools is None:
        return ()
    value = rng.choice(kind.pools[split])
    return tuple(str(v) for v in value) if isinstance(value, tuple) else (str(value),)


def draw_instruction(split: str, rng: random.Random, max_constraints: int = 2) -> Instruction:
    """One request (a task on a topic of `split`) with 1..max_constraints compatible constraints."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    request = rng.choice(TASKS).format(topic=rng.choice(TOPICS[split]))
    count = rng.randint(1, max_constraints)
    chosen: list[str] = []
    names = sorted(CONSTRAINT_TYPES)
    while len(chosen) < count:
        name = rng.choice(names)
        if name in chosen or any(name in CONSTRAINT_TYPES[other].conflicts or other in CONSTRAINT_TYPES[name].conflicts
                                 for other in chosen):
            continue
        chosen.append(name)
    return Instruction(request, tuple((name, _params(CONSTRAINT_TYPES[name], split, rng)) for name in chosen))


def instructions(split: str, n: int, seed: int, max_constraints: int = 2) -> list[Instruction]:
    rng = random.Random(f"instructions|{split}|{seed}")
    return [draw_instruction(split, rng, max_constraints) for _ in range(n)]


def prompt_records(split: str, n: int, seed: int) -> list[dict]:
    """`{"prompt": [{"role": "user", "content": ...}]}` rows: the RL actor's and the evaluation's prompt file."""
    return [{"prompt": [{"role": "user", "content": item.prompt}]} for item in instructions(split, n, seed)]


# ---------------------------------------------------------------------------------------------
# Parsing a prompt back, checking a response


def _prompt_text(prompt) -> str:
    """The last user turn of a conversation, or the text itself."""
    if isinstance(prompt, str):
        return prompt
    users = [turn["content"] for turn in prompt if turn.get("role") == "user"]
    if not users:
        raise ValueError("the prompt has no user turn")
    return users[-1]


def parse_instruction(prompt) -> Instruction:
    """The request and constraints of a prompt this module wrote (text, or messages whose last user turn
    it is); constraints in the order they appear. Raises ValueError on a prompt without any constraint."""
    text = _prompt_text(prompt)
    found = []
    for kind in CONSTRAINT_TYPES.values():
        for match in re.finditer(kind.pattern, text):
            found.append((match.start(), kind.name, tuple(group for group in match.groups() if group)))
    if not found:
        raise ValueError(f"no constraint found in the prompt {text[:120]!r}")
    found.sort()
    request = text[:found[0][0]].strip()
    return Instruction(request, tuple((name, params) for _, name, params in found))


def check(prompt, response: str) -> dict[str, bool]:
    """{constraint type: satisfied} for every constraint of the prompt."""
    instruction = parse_instruction(prompt)
    return {name: bool(CONSTRAINT_TYPES[name].check(response, params, instruction.request))
            for name, params in instruction.constraints}


def credit(prompt, response: str) -> dict[str, float]:
    """{constraint type: 1.0 if satisfied, else its partial credit in [0, 1)} for every constraint."""
    instruction = parse_instruction(prompt)
    scores = {}
    for name, params in instruction.constraints:
        kind = CONSTRAINT_TYPES[name]
        if kind.check(response, params, instruction.request):
            scores[name] = 1.0
        else:
            partial = CREDITS.get(name)
            scores[name] = min(float(partial(response, params, instruction.request)), 0.9) if partial else 0.0
    return scores


def score_response(prompt, response_text: str) -> float:
    """The RL reward: the mean over the prompt's constraints of 1 (satisfied) or the partial credit."""
    scores = credit(prompt, response_text)
    return sum(scores.values()) / len(scores)


def satisfied_fraction(prompt, response_text: str) -> float:
    """The strict score: the fraction of the prompt's constraints the response satisfies (0, 0.5 or 1)."""
    results = check(prompt, response_text)
    return sum(results.values()) / len(results)


def best_worst_pairs(samples: Sequence[dict], group_size: int) -> list[dict]:
    """DPO pairs from sampled answers: `samples` are {"prompt", "response"} rows, `group_size` adjacent rows per
    prompt; each group whose best and worst answers score apart (`score_response`) gives
    {"prompt", "chosen": best, "rejected": worst}; ties go to the earlier answer."""
    pairs = []
    for start in range(0, len(samples), group_size):
        group = [row for row in samples[start:start + group_size] if row.get("response")]
        scores = [score_response(row["prompt"], row["response"]) for row in group]
        if len(group) < 2 or max(scores) == min(scores):
            continue
        best, worst = scores.index(max(scores)), scores.index(min(scores))
        pairs.append({"prompt": group[best]["prompt"], "chosen": group[best]["response"],
                      "rejected": group[worst]["response"]})
    return pairs


def satisfaction(prompts: Sequence, responses: Sequence[str]) -> dict:
    """Prompt-level (all constraints met) and constraint-level rates, overall and per constraint type."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"{len(prompts)} prompts vs {len(responses)} responses; expected equal, non-zero counts")
    per_type: dict[str, list[bool]] = {}
    all_met = []
    for prompt, response in zip(prompts, responses):
        results = check(prompt, response)
        all_met.append(all(results.values()))
        for name, ok in results.items():
            per_type.setdefault(name, []).append(ok)
    flat = [ok for oks in per_type.values() for ok in oks]
    return {"prompt_level": sum(all_met) / len(all_met), "constraint_level": sum(flat) / len(flat),
            "per_type": {name: (sum(oks) / len(oks), len(oks)) for name, oks in sorted(per_type.items())}}


# Five general prompts answered before and after alignment, for a person to see the model still talks.
GENERAL_PROMPTS = (
    "What is the capital of France?",
    "Give me two tips for a good night's sleep.",
    "What is a healthy breakfast?",
    "Why is the sky blue?",
    "How do I boil an egg?",
)
# The one general prompt with a single right answer, and the word that answer contains.
GENERAL_FACTS = {"What is the capital of France?": "Paris"}
# Function words of French that no English answer uses as words of its own; the breakage seen when a 135M model's
# constraint training leaks into its general answers is an answer that drifts into French.
_FRENCH_WORDS = frozenset({"est", "la", "le", "les", "des", "une", "du", "et", "au", "aux", "français", "française"})


def _words(text: str) -> list[str]:
    return re.findall(r"[a-zà-ÿ0-9]+", text.lower())


def general_answer_faults(prompt: str, answer: Optional[str]) -> list[str]:
    """What makes `answer` no longer an answer to the general `prompt`, one short phrase each (empty: intact).

    Each is a fact about the answer, not a threshold: it is in French; it names no word the question did not
    ("The sky blue." to "Why is the sky blue?": the question echoed); it misses the fact `GENERAL_FACTS` names.
    """
    words = _words(answer or "")
    faults = []
    french = sorted(set(words) & _FRENCH_WORDS) + (["l'"] if re.search(r"(^|\W)l'", (answer or "").lower()) else [])
    if french:
        faults.append(f"French words ({', '.join(french)})")
    if not set(words) - set(_words(prompt)):
        faults.append("echoes the question" if words else "empty")
    fact = GENERAL_FACTS.get(prompt)
    if fact is not None and fact.lower() not in words:
        faults.append(f"does not name {fact}")
    return faults


def new_general_faults(prompt: str, base_answer: Optional[str], answer: Optional[str]) -> list[str]:
    """The faults of `answer` that the base model's answer to the same prompt does not have (the base model of
    `make demo-real` already echoes "Boil an egg:"; training is judged on what it broke)."""
    before = general_answer_faults(prompt, base_answer)
    return [fault for fault in general_answer_faults(prompt, answer) if fault not in before]
