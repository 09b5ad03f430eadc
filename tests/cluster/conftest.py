"""The cluster tier's process: `make test` runs it in the background beside the distributed tier, and a shell
starts a background command with SIGINT ignored (no job control), which Python and every process it starts (the
cluster's daemons, its jobs) would keep. Ctrl-C is taken again, as in a foreground run: an interrupted `make test`
stops this tier too, and the fixtures take the mini cluster down."""
from __future__ import annotations

import signal


def pytest_configure(config) -> None:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
