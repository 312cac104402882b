#!/usr/bin/env bash
# The Ray path at one replica against the single-process server: the same model, strategy and torch threads,
# the same seeded Poisson traces at two rates (12 requests, 32 new tokens each), after two warm-up requests per
# server. Usage (from the repository root): bash docs/benchmarks/ray_overhead_2026-12-06_xeon/run.sh [THREADS
# [SUBFOLDER]]; the results here: THREADS 1; those in two_threads/: `run.sh 2 two_threads` (on this 2-core
# machine the proxy and Ray's processes share the cores with the replica's threads).
set -euo pipefail
threads=${1:-1}
out=docs/benchmarks/ray_overhead_2026-12-06_xeon${2:+/$2}
model=(--target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct --strategy laspec --log-level warning)

measure() {  # name port [serve options...]
    local name=$1 port=$2; shift 2
    hf-adaptive-spec serve "${model[@]}" --port "$port" "$@" > "$out/${name}_server.log" 2>&1 &
    local pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
        kill -0 "$pid" || { echo "$name: the server exited"; exit 1; }
        sleep 1
    done
    hf-adaptive-spec loadtest --url "http://127.0.0.1:$port" --rate 1 --requests 2 --max-tokens 32 --seed 99 \
        --time-limit 300 > /dev/null  # warm-up, not reported
    for rate in 0.5 1; do
        hf-adaptive-spec loadtest --url "http://127.0.0.1:$port" --rate "$rate" --requests 12 --max-tokens 32 \
            --seed 0 --time-limit 600 --label "$name" --out "$out/${name}_rate${rate}.json"
    done
    kill -TERM "$pid"
    wait "$pid"
}

measure single-process 8021 --threads "$threads"
measure ray-1-replica 8022 --replicas 1 --replica-cpus "$threads"
