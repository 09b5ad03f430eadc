# Shell functions the sbatch scripts share; they source this file from the repository root, where they run.

# A graceful stop of a heterogeneous job's component: SIGTERM to the tasks of its job step (found by the step's
# name) through scancel: srun answers a SIGTERM of its own by killing its tasks (SIGKILL), which would lose a
# step's work.
stop_step() {  # stop_step NAME PID
    local step
    step=$(squeue --noheader --steps --format="%i %j" | awk -v name="$1-$SLURM_JOB_ID" '$2 == name {print $1}')
    if [ -n "$step" ]; then scancel --signal=TERM "$step"; else kill -TERM "$2" 2>/dev/null || true; fi
}

# Generation worker servers for asynchronous RL (docs/guides/async_rl.md) as component GROUP of the job: n tasks
# per trainer rank, each listening on its node's name at WORKER_PORT + its local task id and writing
# "node:port" to $RESULTS/workers/<task id> once it listens. Waits (up to WORKER_WAIT_S) until all listen; sets
# WORKERS ("n1:5570,n2:5570,...", task order: rank r's are the r-th n) and WORKERS_PID. Makes the job's
# ALIGNER_WORKER_KEY unless one is set (the trainer and its workers exchange pickled messages).
start_generation_workers() {  # start_generation_workers GROUP TRAINER_RANKS
    local group=$1 ranks=$2 tasks_variable="SLURM_NTASKS_HET_GROUP_$1" addresses="$RESULTS/workers" waited=0
    local tasks=${!tasks_variable:-0}
    if [ "$tasks" -lt "$ranks" ] || [ $((tasks % ranks)) -ne 0 ]; then
        echo "error: $ranks trainer ranks and $tasks generation workers: give component $group as many tasks" \
            "per trainer rank (a multiple of $ranks)" >&2
        exit 2
    fi
    ALIGNER_WORKER_KEY=${ALIGNER_WORKER_KEY:-$(python -c "import secrets; print(secrets.token_hex(16))")}
    export ALIGNER_WORKER_KEY
    rm -rf "$addresses" && mkdir -p "$addresses"
    srun --het-group="$group" --job-name="aligner-workers-$SLURM_JOB_ID" bash -c \
        'exec python examples/nlp/gpt/serve_generation_worker.py --host "$(hostname)" \
            --port $(('"${WORKER_PORT:-5570}"' + SLURM_LOCALID)) --threads "${SLURM_CPUS_PER_TASK:-$(nproc)}" \
            --address-file "'"$addresses"'/$SLURM_PROCID"' >> "$RESULTS/workers.log" 2>&1 &
    WORKERS_PID=$!
    while [ "$(find "$addresses" -maxdepth 1 -type f ! -name '*.partial' | wc -l)" -lt "$tasks" ]; do
        if ! kill -0 "$WORKERS_PID" 2>/dev/null || [ "$waited" -ge "${WORKER_WAIT_S:-600}" ]; then
            echo "error: the generation workers did not all start within $waited s (their log:" \
                "$RESULTS/workers.log)" >&2
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    WORKERS=$(for task in $(seq 0 $((tasks - 1))); do cat "$addresses/$task"; done | paste -sd, -)
    echo "generation workers: $WORKERS"
}

stop_generation_workers() {  # (nothing when none were started)
    if [ -n "${WORKERS_PID:-}" ]; then stop_step aligner-workers "$WORKERS_PID"; wait "$WORKERS_PID" || true; fi
}
