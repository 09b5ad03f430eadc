"""Cache rows of multi-turn episodes (`NativeEngine.generate_turns`): which episode each row holds, and the moves
that keep the decoding rows first while the others keep their caches."""
from __future__ import annotations

from typing import Optional


class EpisodeRows:
    """The episode each cache row holds, for the engine's KV cache views keys [layers, rows, groups, d, len] and
    values [layers, rows, groups, len, d].

    Rows 0 .. live - 1 decode (the engine's live block). An episode out of the live block (its turn ended, its
    answer not yet prefilled) keeps its row and that row's filled columns (`filled`); a free row holds nothing.
    Moving a row copies its filled columns only.
    """

    def __init__(self, keys, values, capacity: int):
        self.keys, self.values = keys, values
        self.occupant: list[Optional[int]] = [None] * capacity
        self.filled: dict[int, int] = {}  # episode -> filled columns of its row, while out of the live block

    @property
    def free(self) -> int:
        return self.occupant.count(None)

    def leave(self, episode: int, filled: int) -> None:
        """The episode's turn ended with `filled` columns in its row: it keeps them out of the live block."""
        self.filled[episode] = filled

    def release(self, episode: int) -> None:
        """The episode has ended: its row is free."""
        self.occupant[self.occupant.index(episode)] = None
        del self.filled[episode]

    def place(self, episode: int, row: int) -> None:
        """Move the episode's row (an episode not started: a free row) to `row`, swapping with what is there."""
        current = self.occupant.index(episode if episode in self.filled else None)
        if current != row:
            other = self.occupant[row]
            self._swap(current, self.filled.get(episode, 0), row, self.filled.get(other, 0))
            self.occupant[current] = other
        self.occupant[row] = episode

    def rejoin(self, episode: int) -> int:
        """The episode is back in the live block; returns its filled columns (where its new tokens go)."""
        return self.filled.pop(episode)

    def compact(self, done: list, lengths: list) -> list:
        """After a step whose rows `done` ended their turn: move the live rows behind the new live count into
        the rows of the ended ones (swapped, so an episode that goes on keeps its cache; a freed row is simply
        overwritten). lengths: filled columns of each old live row. Returns, for each new live row, the old
        row it holds now."""
        count = len(done) - sum(done)
        movers = [row for row, finished in enumerate(done) if not finished and row >= count]
        order = list(range(count))
        for hole, mover in zip((row for row in range(count) if done[row]), movers):
            other = self.occupant[hole]
            self._swap(mover, lengths[mover], hole, 0 if other is None else self.filled[other])
            self.occupant[hole], self.occupant[mover] = self.occupant[mover], other
            order[hole] = mover
        return order

    def _swap(self, first: int, first_filled: int, second: int, second_filled: int) -> None:
        """Exchange the filled columns of two rows (a row with 0 filled columns is free: a plain move)."""
        keys, values = self.keys, self.values
        saved = None
        if second_filled:
            saved = (keys[:, second, :, :, :second_filled].clone(), values[:, second, :, :second_filled].clone())
        if first_filled:
            keys[:, second, :, :, :first_filled].copy_(keys[:, first, :, :, :first_filled])
            values[:, second, :, :first_filled].copy_(values[:, first, :, :first_filled])
        if saved is not None:
            keys[:, first, :, :, :second_filled].copy_(saved[0])
            values[:, first, :, :second_filled].copy_(saved[1])
