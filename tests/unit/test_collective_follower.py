"""A follower rank of `CollectiveServing` (servers/triton.py) after a failed call: a user's error (a checkpoint to
restore that is not there) is one log line, anything else a traceback; either way it goes on following until
rank 0 says STOP. The commands are fed in place of rank 0's broadcasts (the channel itself runs in
tests/distributed/test_critic_server_dp.py and test_reward_server_tp.py)."""
from __future__ import annotations

import logging

import torch

from aligner.checkpointing.base import CheckpointError
from servers.triton import CollectiveServing, Command


def _follower(fn, commands):
    serving = CollectiveServing(fn)  # one process: rank 0, no group; made a follower below
    serving._rank, serving._world, serving._group = 1, 2, object()
    feed = iter(commands)
    serving._receive = lambda: next(feed)
    return serving


def test_a_follower_logs_a_user_error_in_one_line_and_a_bug_with_its_traceback_and_keeps_following(caplog):
    calls = []

    def fn(tensor):
        calls.append(int(tensor))
        if int(tensor) == 1:
            raise CheckpointError("checkpoint.save_dir=/x holds no checkpoint of step 3")
        if int(tensor) == 2:
            raise ZeroDivisionError("a bug")

    run = [(Command.RUN, [torch.tensor(value)]) for value in (1, 2, 3)]
    with caplog.at_level(logging.INFO, logger="servers.triton"):
        _follower(fn, [*run, (Command.STOP, [])]).follow()
    assert calls == [1, 2, 3]
    failures = [record for record in caplog.records if "the collective call failed" in record.getMessage()]
    assert [record.levelno for record in failures] == [logging.WARNING, logging.ERROR]
    user, bug = failures
    assert user.getMessage() == ("rank 1: the collective call failed: checkpoint.save_dir=/x holds no checkpoint "
                                 "of step 3") and user.exc_info is None
    assert bug.exc_info is not None and bug.exc_info[0] is ZeroDivisionError
