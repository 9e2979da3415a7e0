#!/usr/bin/env bash
# Issue 47's GPU acceptance: CuPy's, cuda.core's and Triton's own tests with kcache behind
# their cache hooks, against a kcache server on this machine (SQLite, a publish token)
# that device_server.sh starts, as for the other runners here.
# Run from the repository root on the GPU machine, after prepare.sh here (it fills
# .device/: the server's wheels and the libraries' tests). Results: $OUT/results.tgz and
# the JSON lines this prints (one per comparison and per run).
set -uo pipefail
OUT=${OUT:-/tmp/accept-out}
W=${ACCEPT_WORK:-/tmp/accept}
R=$W/results
PHASE_S=${PHASE_S:-200}  # each phase is killed past this (A and B: at most 2 x 220 s)
CUPY_WORKERS=${CUPY_WORKERS:-4}
mkdir -p "$OUT"
# ---- the server (device_server.sh): the carried wheels on PYTHONPATH, the toolchain's
# header directory, SQLite on its embedded defaults under $W/server, one token with the
# publish scope; it empties $W and leaves REPO, A, D, URL, TOKEN, SERVER_PID, kc and get.
# Never a bare `wait` below: it would wait for the server too (each phase waits for its own jobs).
PORT=8470 SCOPES="--scope publish"
source bench/gpu_foreign_acceptance/device_server.sh
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import sys, triton, torch, cupy, cuda.core, cuda.bindings; from cupy.cuda import compiler; print(sys.version.split()[0], "triton", triton.__version__, "torch", torch.__version__, "cupy", cupy.__version__, "cuda.core", cuda.core.__version__, "cuda.bindings", cuda.bindings.__version__, "nvrtc", compiler._get_nvrtc_version())'
} 2>&1 | tee "$R/versions.txt"
export KCACHE_URL=$URL KCACHE_TOKEN=$TOKEN KCACHE_KNOWN_SERVERS=$W/known_servers
export ACCEPT_OUT=$R
stats() {  # stats SINCE NAME: the server's audit of foreign and kcache lookups since SINCE
  get "$KCACHE_URL/v1/stats?since=$1" >"$R/stats-$2.json"
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({"server_stats": sys.argv[2], **{k: s[k] for k in ("kernel_lookups","kernel_hits","kernel_misses","observed_hits","hit_rate")}}))' "$R/stats-$2.json" "$2"
}

CUPY_TESTS="tests/cupy_tests/core_tests/test_raw.py tests/cupy_tests/core_tests/test_elementwise.py tests/cupy_tests/core_tests/test_reduction.py"
cupy_run() {  # cupy_run TAG [KCACHE=1]: CuPy's tests, empty CuPy disk cache and node tier
  (cd "$D/cupy" && env ACCEPT_TAG=cupy-$1 CUPY_CACHE_DIR="$W/cupy-cache-$1" KCACHE_CACHE_DIR="$W/tier-cupy-$1" \
    KCACHE_CUPY_BACKEND=${2:-0} timeout -k 20 -s INT "$PHASE_S" python3 -m pytest -p cupy_plugin -p no:cacheprovider \
    -m "not slow" -n "$CUPY_WORKERS" -q -rfE --junitxml="$R/cupy-$1.xml" $CUPY_TESTS >"$R/cupy-$1.log" 2>&1)
}
triton_run() {  # triton_run TAG [MANAGER]: Triton's test_cache.py, empty Triton home and node tier
  (cd "$D/triton" && env ACCEPT_TAG=triton-$1 TRITON_HOME="$W/triton-home-$1" KCACHE_CACHE_DIR="$W/tier-triton-$1" \
    ${2:+TRITON_CACHE_MANAGER=$2} timeout -k 20 -s INT "$PHASE_S" python3 -m pytest -p triton_plugin -p no:cacheprovider \
    -q -rfE --junitxml="$R/triton-$1.xml" test_cache.py >"$R/triton-$1.log" 2>&1)
}
cuda_core_run() {  # cuda_core_run TAG [KCACHE=1]
  (cd "$D/cuda_core" && env ACCEPT_TAG=cuda_core-$1 KCACHE_CUDA_CORE=${2:-0} KCACHE_CACHE_DIR="$W/tier-cc-$1" \
    timeout -k 10 -s INT 90 python3 -m pytest -p cuda_core_plugin -p no:cacheprovider -q -rfE \
    --junitxml="$R/cuda_core-$1.xml" test_program_compile_cache.py >"$R/cuda_core-$1.log" 2>&1)
}
MANAGER=kcache_client.triton:CacheManager

# ---- phase A: stock and first kcache runs side by side (each compiles everything)
snapshot() {  # snapshot PHASE T0: say the phase is done, keep what is there so far in $OUT
  echo "{\"phase\": \"$1\", \"seconds\": $(($(date +%s) - $2))}"
  tar czf "$OUT/results.tgz" -C "$W" results
}
t0=$(date +%s)
pids=()
cupy_run stock & pids+=($!)
cupy_run k1 1 & pids+=($!)
triton_run stock & pids+=($!)
triton_run k1 $MANAGER & pids+=($!)
cuda_core_run stock; cuda_core_run k 1
wait "${pids[@]}"
snapshot A "$t0"
stats "$t0" A
# ---- phase B: second kcache runs, fresh processes with empty local caches: hits only
sleep 1; t1=$(date +%s)
pids=()
cupy_run k2 1 & pids+=($!)
triton_run k2 $MANAGER & pids+=($!)
wait "${pids[@]}"
snapshot B "$t1"
stats "$t1" B
# ---- phase C: a Triton kernel compiled by rank 0 of a 2-rank job is a hit on rank 1
t2=$(date +%s)
timeout -k 10 120 python3 "$A/triton_two_ranks.py" "$W/two-ranks" >"$R/two-ranks.log" 2>&1
echo "{\"two_ranks_exit\": $?}"; grep '^{' "$R/two-ranks.log"
stats "$t2" C

for suite in cupy triton; do
  python3 "$A/compare.py" "$suite" "$R/$suite-stock.xml" "$R/$suite-k1.xml" "$R/$suite-k2.xml"
  for run in k1 k2; do python3 "$A/summarize.py" "$R" "$suite-$run"; done
done
python3 "$A/compare.py" cuda_core "$R/cuda_core-stock.xml" "$R/cuda_core-k.xml"
cat "$R"/cuda_core-k.json 2>/dev/null; echo
for f in "$R"/*.log; do echo "== $(basename "$f"): $(tail -1 "$f")"; done
kill "$SERVER_PID"
snapshot end "$t0"
