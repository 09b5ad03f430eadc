"""Environments for the RL actor's episode tests, loaded by the sandbox workers by this file's path. They speak
only digits, '+' and '=' (the demo's character tokenizer), and import nothing of aligner."""
from __future__ import annotations


def _question(record: dict) -> str:
    prompt = record["prompt"]
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


class OneTurn:
    """The record's prompt, one reply, done: a single-turn rollout as an episode (no reward: the reward source
    scores it)."""

    def reset(self, record: dict) -> dict:
        return {"messages": [{"role": "user", "content": _question(record)}]}

    def step(self, action: str) -> dict:
        return {"messages": [], "reward": None, "done": True}


class AddUp:
    """`turns` questions, the record's first: each reply is checked, and the next question is asked; the reward is
    the fraction answered right (turn rewards 1/0 as they come)."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, record: dict) -> dict:
        left, right = (int(part) for part in _question(record).rstrip("=").split("+"))
        self.questions = [(left + i, right + 2 * i) for i in range(self.turns)]
        self.right = 0
        return {"messages": [{"role": "user", "content": f"{left}+{right}="}]}

    def step(self, action: str) -> dict:
        left, right = self.questions.pop(0)
        good = action.strip() == str(left + right)
        self.right += good
        if not self.questions:
            return {"messages": [], "reward": self.right / self.turns, "done": True}
        left, right = self.questions[0]
        return {"messages": [{"role": "user", "content": f"{left}+{right}="}], "reward": float(good), "done": False}


class Flaky(OneTurn):
    """OneTurn whose step raises on the records whose first number is a multiple of 3 (as buggy environment code
    does), after the model's turn."""

    def reset(self, record: dict) -> dict:
        self.broken = int(_question(record).split("+")[0]) % 3 == 0
        return super().reset(record)

    def step(self, action: str) -> dict:
        if self.broken:
            raise RuntimeError("this record breaks the environment")
        return super().step(action)
