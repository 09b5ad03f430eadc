#!/usr/bin/env bash
# Installs the TRL peer used by benchmarks/train_steps.py in its own venv (never a project dependency).
# torch and transformers take the project's CI pins (benchmarks/peer/venv.sh); only those two: the project's
# numpy<2 would hold back the pyarrow that `datasets` needs.
# Idempotent (a stamp file records the pins it was installed with). Usage: benchmarks/peer/setup.sh [VENV]
set -u
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.cache/bench/trl-venv}"
PEER="peer"
PEER_PINS="trl==1.16.0 datasets accelerate"
# shellcheck source=benchmarks/peer/venv.sh
source "$(dirname "$0")/venv.sh"
WANT="$PEER_PINS $SHARED_PINS"
installed_already
make_venv
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet $SHARED_PINS $PEER_PINS \
    >>"$LOG" 2>&1 || fail "pip install $PEER_PINS"
"$VENV/bin/python" -c "import datasets, trl, torch; assert trl.__version__ == '1.16.0', trl.__version__" \
    >>"$LOG" 2>&1 || fail "trl 1.16.0 (with datasets, torch) does not import"
installed
