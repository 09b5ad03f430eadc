"""Learning rates known to work for fine-tuning a pretrained model, by method, model size and adapters.

A run whose `optim.lr` is more than FAR times above or below the known rate for its method, size and
adapters gets one warning line at start-up (never a refusal: the table is advice, not a limit). Toy
models (fewer than SMALLEST_MODEL parameters) and random inits get no advice.

Sources: TRL's trainer defaults (SFTConfig 2e-5, DPOConfig 1e-6, GRPOConfig 1e-6) for full-weight runs;
for models under 1B parameters, what the recipes in aligner/conf/recipes/ measured on SmolLM2-135M-Instruct
(tests/real_model/test_recipes.py) and what examples/demo/run_demo_real.py runs (RLOO at 1e-3 and DPO at
3e-4 with rank-16 adapters, which read those recipes). The LoRA rows for 1B+ models are the common rule
that adapters take about 10x the full-weight rate, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

METHODS = ("sft", "preference", "rl")  # supervised (SFT, RS, KD); DPO, KTO, SPIN; the RL actor (PPO, GRPO family)
FAR = 10.0  # a rate this many times above or below the known one gets the warning
SMALLEST_MODEL = 50e6  # parameters; below this, toy models: no advice
RECIPES = "aligner/conf/recipes/"


@dataclass(frozen=True)
class KnownRate:
    method: str
    lora: bool
    max_parameters: float  # the row applies to models up to this many parameters
    lr: float
    source: str


KNOWN_RATES = (
    KnownRate("sft", False, 1e9, 1e-5, "the SmolLM2-135M recipe"),
    KnownRate("sft", True, 1e9, 2e-4, "the SmolLM2-135M recipe"),
    KnownRate("sft", False, float("inf"), 2e-5, "TRL's SFTConfig default"),
    KnownRate("sft", True, float("inf"), 2e-4, "TRL's SFT default x 10 for LoRA"),
    KnownRate("preference", False, 1e9, 1e-6, "the SmolLM2-135M recipe, TRL's DPOConfig default"),
    KnownRate("preference", True, 1e9, 3e-4, "examples/demo/run_demo_real.py on SmolLM2-135M"),
    KnownRate("preference", False, float("inf"), 1e-6, "TRL's DPOConfig default"),
    KnownRate("preference", True, float("inf"), 1e-5, "TRL's DPO default x 10 for LoRA"),
    KnownRate("rl", False, 1e9, 1e-6, "the SmolLM2-135M recipe, TRL's GRPOConfig default"),
    KnownRate("rl", True, 1e9, 1e-3, "examples/demo/run_demo_real.py (RLOO) on SmolLM2-135M"),
    KnownRate("rl", False, float("inf"), 1e-6, "TRL's GRPOConfig default"),
    KnownRate("rl", True, float("inf"), 1e-5, "TRL's GRPO default x 10 for LoRA"),
)


def known_rate(method: str, lora: bool, num_parameters: float) -> Optional[KnownRate]:
    """The table's row for a method, adapters or not, and a model size; None for toy models."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {METHODS}")
    if num_parameters < SMALLEST_MODEL:
        return None
    return next(row for row in KNOWN_RATES
                if row.method == method and row.lora == lora and num_parameters <= row.max_parameters)


def lr_warning(lr: float, method: str, lora: bool, num_parameters: float) -> Optional[str]:
    """One line when `lr` is more than FAR times away from the known rate, else None."""
    row = known_rate(method, lora, num_parameters)
    if row is None or lr <= 0:
        return None
    ratio = lr / row.lr
    if 1 / FAR <= ratio * (1 + 1e-9) and ratio <= FAR * (1 + 1e-9):  # (1e-5 / 1e-6 is 10.000000000000002)
        return None
    how = f"{ratio:.0f}x above" if ratio > 1 else f"{1 / ratio:.0f}x below"
    kind = "LoRA" if lora else "full-weight"
    consequence = ("it can wreck the model's general answers in a few steps" if ratio > 1
                   else "the model will barely move")
    return (f"optim.lr={lr:g} is {how} the {row.lr:g} known to work for {kind} {method} on a "
            f"{num_parameters / 1e6:.0f}M-parameter model ({row.source}): {consequence}; see {RECIPES}")
