"""An episode: the exact tokens an agent's rollout trains on, as a list of segments.

    episode = Episode([Segment.prompt(prompt_ids)])
    episode.add_model(ids, logprobs, policy_version=3)        # what the engine generated, as generated
    episode.add(renderer.continuation(...))                   # boundary + environment tokens of a turn
    episode.tokens, episode.loss_mask, episode.behaviour_logprobs   # the training row

Segments are `prompt` (the rendered start), `model` (ids the engine generated), `environment` (an
observation: a tool result, the environment's reply) and `boundary` (the chat template's own tokens
between turns). Their concatenation is exactly the row trained on; the loss mask is 1 on model tokens
and nowhere else. A model segment carries the logprobs the engine sampled it with (the processed
distribution: temperature, top-k/p) and the version of the policy that generated it; model ids are
never decoded and re-encoded (text exists only for tool-call parsers and rewards).

A single-turn rollout is an episode of one prompt segment and one model segment.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

SEGMENT_KINDS = ("prompt", "model", "environment", "boundary")
# How an episode ended. done: the environment said so; max_turns / truncated: a limit cut it; timeout: its
# deadline or a tool's passed; env_error: the environment failed (not the model's doing).
EPISODE_STATUSES = ("done", "max_turns", "truncated", "timeout", "env_error")


@dataclass(frozen=True)
class Segment:
    """One run of tokens of one kind; model segments also carry their logprobs and policy version."""

    kind: str
    tokens: tuple[int, ...]
    logprobs: Optional[tuple[float, ...]] = None  # model segments: the engine's logprob of each token
    policy_version: Optional[int] = None  # model segments: the policy step whose weights generated them

    def __post_init__(self):
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind {self.kind!r}; expected one of {', '.join(SEGMENT_KINDS)}")
        object.__setattr__(self, "tokens", tuple(int(token) for token in self.tokens))
        if self.kind == "model":
            if self.logprobs is None or self.policy_version is None:
                raise ValueError("a model segment needs the engine's logprobs and the policy version")
            object.__setattr__(self, "logprobs", tuple(float(value) for value in self.logprobs))
            if len(self.logprobs) != len(self.tokens):
                raise ValueError(f"a model segment of {len(self.tokens)} tokens has {len(self.logprobs)} logprobs")
        elif self.logprobs is not None or self.policy_version is not None:
            raise ValueError(f"a {self.kind} segment carries no logprobs or policy version (only model segments do)")

    @classmethod
    def prompt(cls, tokens: Iterable[int]) -> "Segment":
        return cls("prompt", tuple(tokens))

    @classmethod
    def model(cls, tokens: Iterable[int], logprobs: Iterable[float], policy_version: int) -> "Segment":
        return cls("model", tuple(tokens), tuple(logprobs), policy_version)

    @classmethod
    def environment(cls, tokens: Iterable[int]) -> "Segment":
        return cls("environment", tuple(tokens))

    @classmethod
    def boundary(cls, tokens: Iterable[int]) -> "Segment":
        return cls("boundary", tuple(tokens))

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Episode:
    """The segments of one rollout, in order, and how it ended.

    The first segment is the prompt. Rewards: `reward` is the episode's final score; `turn_rewards` holds one
    entry per model turn when the environment scores turns (kept for credit assignment; None where a turn
    got none).
    """

    segments: list[Segment]
    status: Optional[str] = None  # None while running, then one of EPISODE_STATUSES
    reward: Optional[float] = None
    turn_rewards: list[Optional[float]] = field(default_factory=list)
    last_turn_stopped: bool = False  # the last model turn ended with a stop token (not cut by a token limit)
    info: dict = field(default_factory=dict)  # the environment's last `info` (JSON), e.g. its tool-call counts

    def __post_init__(self):
        if not self.segments or self.segments[0].kind != "prompt":
            raise ValueError("an episode starts with its prompt segment")
        if any(segment.kind == "prompt" for segment in self.segments[1:]):
            raise ValueError("an episode has one prompt segment, the first")

    @classmethod
    def single_turn(cls, prompt: Sequence[int], response: Sequence[int], logprobs: Sequence[float],
                    policy_version: int, stopped: bool = True) -> "Episode":
        episode = cls([Segment.prompt(prompt)])
        episode.add_model(response, logprobs, policy_version, stopped)
        return episode

    def add(self, segments: Iterable[Segment]) -> None:
        """Append segments (an environment turn's boundary and observation tokens); empty ones are dropped."""
        for segment in segments:
            self._append(segment)

    def add_model(self, tokens: Sequence[int], logprobs: Sequence[float], policy_version: int,
                  stopped: bool = True) -> None:
        """A model turn as generated; stopped: it ended with a stop token (False: cut by max_new_tokens)."""
        self._append(Segment.model(tokens, logprobs, policy_version))
        self.last_turn_stopped = stopped

    def _append(self, segment: Segment) -> None:
        if self.status is not None:
            raise ValueError(f"the episode already ended ({self.status}); nothing can be added")
        if segment.kind == "prompt":
            raise ValueError("an episode has one prompt segment, the first")
        if len(segment):
            self.segments.append(segment)

    def end(self, status: str) -> None:
        if status not in EPISODE_STATUSES:
            raise ValueError(f"episode status {status!r}; expected one of {', '.join(EPISODE_STATUSES)}")
        self.status = status

    @property
    def tokens(self) -> list[int]:
        return [token for segment in self.segments for token in segment.tokens]

    @property
    def loss_mask(self) -> list[int]:
        """1 on every model token, 0 on prompt, environment and boundary tokens."""
        return [int(segment.kind == "model") for segment in self.segments for _ in segment.tokens]

    @property
    def behaviour_logprobs(self) -> list[float]:
        """The engine's logprob at each model token, 0.0 elsewhere (aligned with `tokens`)."""
        return [value for segment in self.segments
                for value in (segment.logprobs if segment.kind == "model" else (0.0,) * len(segment))]

    @property
    def policy_versions(self) -> list[int]:
        """The policy version of each model segment, in order."""
        return [segment.policy_version for segment in self.segments if segment.kind == "model"]

    @property
    def oldest_version(self) -> Optional[int]:
        """The oldest policy version among its model segments (an episode's staleness is its oldest token's);
        None without a model segment."""
        return min(self.policy_versions, default=None)

    def to_plain(self) -> dict:
        """The episode as JSON-able values (a checkpoint keeps the episodes a generation worker made ahead)."""
        return {"segments": [[s.kind, list(s.tokens), None if s.logprobs is None else list(s.logprobs),
                              s.policy_version] for s in self.segments],
                "status": self.status, "reward": self.reward, "turn_rewards": list(self.turn_rewards),
                "last_turn_stopped": self.last_turn_stopped, "info": self.info}

    @classmethod
    def from_plain(cls, plain: dict) -> "Episode":
        """`to_plain`'s episode again, equal to the original (JSON keeps Python floats exactly)."""
        segments = [Segment(kind, tuple(tokens), None if logprobs is None else tuple(logprobs), version)
                    for kind, tokens, logprobs, version in plain["segments"]]
        return cls(segments, plain["status"], plain["reward"], list(plain["turn_rewards"]),
                   plain["last_turn_stopped"], dict(plain["info"]))

    @property
    def prompt_length(self) -> int:
        return len(self.segments[0])

    @property
    def model_turns(self) -> int:
        return sum(segment.kind == "model" for segment in self.segments)

    def count(self, kind: str) -> int:
        """Tokens of one segment kind."""
        if kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind {kind!r}; expected one of {', '.join(SEGMENT_KINDS)}")
        return sum(len(segment) for segment in self.segments if segment.kind == kind)

    def __len__(self) -> int:
        return sum(len(segment) for segment in self.segments)
