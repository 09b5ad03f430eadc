#!/usr/bin/env bash
# Installs the TRL peer used by benchmarks/train_steps.py in its own venv (never a project dependency).
# torch and transformers take the project's CI pins (constraints/ci.txt, as `make install` does), so both
# sides run the same torch build (the CPU wheel) and pip never pulls a CUDA build. Only those two: the
# project's numpy<2 would hold back the pyarrow that `datasets` needs.
# Idempotent: a stamp file records the pins it was installed with. Usage: benchmarks/peer/setup.sh [VENV]
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.cache/bench/trl-venv}"
PYTHON="${PYTHON:-python3}"
PEER_PINS="trl==1.16.0 datasets accelerate"
STAMP="$VENV/.peer-installed"
SHARED_PINS="$(grep -E '^(torch|transformers)==' "$ROOT/constraints/ci.txt" | tr '\n' ' ')"
WANT="$PEER_PINS $SHARED_PINS"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "$VENV"
    exit 0
fi
LOG="$(mktemp)"
fail() { echo "peer setup failed: $1 (log: $LOG)" >&2; exit 1; }
{ test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"; } >>"$LOG" 2>&1 || fail "cannot create venv $VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip >>"$LOG" 2>&1 || fail "pip upgrade"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --quiet $SHARED_PINS $PEER_PINS \
    >>"$LOG" 2>&1 || fail "pip install $PEER_PINS"
"$VENV/bin/python" -c "import datasets, trl, torch; assert trl.__version__ == '1.16.0', trl.__version__" \
    >>"$LOG" 2>&1 || fail "trl 1.16.0 (with datasets, torch) does not import"
echo "$WANT" > "$STAMP"
rm -f "$LOG"
echo "$VENV"
