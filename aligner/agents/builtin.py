"""Built-in tools and environments. They run in sandbox workers, loaded by this file's path (`BUILTIN`), so this
module imports nothing of aligner (a worker that imported the package would import torch).

- `calculate(expression)`: arithmetic on numbers (+ - * / // % **, parentheses), nothing else evaluated.
- `GuessTheNumber`: a multi-turn game with feedback: the model guesses, the game says higher or lower;
  reward 1 for finding the number within `max_guesses`, else 0.
"""
from __future__ import annotations

import ast
import operator
import random
import re
from pathlib import Path

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 1000
MAX_EXPRESSION = 200


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.dump(node)[:40]}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 79) * 3"
    """
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION} characters")
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


class GuessTheNumber:
    """The model guesses a whole number; after each guess it hears "Higher.", "Lower." or "Correct!".

    The secret is the record's "secret" when it has one, else drawn from the record's "seed" (or its prompt)."""

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 7):
        if low >= high:
            raise ValueError(f"low ({low}) must be below high ({high})")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret = low
        self.guesses = 0

    def reset(self, record: dict) -> dict:
        secret = record.get("secret")
        if secret is None:
            secret = random.Random(str(record.get("seed", record.get("prompt", "")))).randint(self.low, self.high)
        self.secret, self.guesses = int(secret), 0
        text = (f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: answer with the number "
                f"only. You have {self.max_guesses} guesses.")
        return {"messages": [{"role": "user", "content": text}]}

    def step(self, action: str) -> dict:
        self.guesses += 1
        numbers = re.findall(r"-?\d+", action)
        if not numbers:
            feedback, reward, done = "Answer with a number.", 0.0, False
        elif int(numbers[-1]) == self.secret:
            return {"messages": [], "reward": 1.0, "done": True, "info": {"guesses": self.guesses}}
        else:
            feedback = "Higher." if int(numbers[-1]) < self.secret else "Lower."
            reward, done = 0.0, False
        if self.guesses >= self.max_guesses:
            return {"messages": [], "reward": 0.0, "done": True, "info": {"guesses": self.guesses}}
        return {"messages": [{"role": "user", "content": feedback}], "reward": reward, "done": done,
                "info": {"guesses": self.guesses}}


HERE = Path(__file__).resolve()
BUILTIN = {"calculator": f"{HERE}:calculate", "guess_the_number": f"{HERE}:GuessTheNumber"}
