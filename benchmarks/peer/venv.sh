# Shared by the peers' set-up scripts (setup.sh: TRL; setup_llama_cpp.sh: llama.cpp), sourced after they set
# VENV and WANT (what they install, pins included): each peer lives in a venv of its own, never a project
# dependency, and shares the project's CI pins of torch and transformers (constraints/ci.txt), so pip never
# pulls a CUDA build. A stamp file in the venv records WANT; an install that matches it is not redone.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
SHARED_PINS="$(grep -E '^(torch|transformers)==' "$ROOT/constraints/ci.txt" | tr '\n' ' ')"
STAMP="$VENV/.peer-installed"
LOG="$(mktemp)"

# exit 0 printing the venv when it already holds WANT
installed_already() {
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
        rm -f "$LOG"
        echo "$VENV"
        exit 0
    fi
}

fail() { echo "$PEER setup failed: $1 (log: $LOG)" >&2; exit 1; }

# the venv with an up-to-date pip
make_venv() {
    { test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"; } >>"$LOG" 2>&1 || fail "cannot create venv $VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >>"$LOG" 2>&1 || fail "pip upgrade"
}

# record WANT and print the venv
installed() {
    echo "$WANT" > "$STAMP"
    rm -f "$LOG"
    echo "$VENV"
}
