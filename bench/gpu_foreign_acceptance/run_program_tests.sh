#!/usr/bin/env bash
# Issue 47's acceptance item: cuda.core's own tests/test_program.py, stock and with kcache's
# Program swapped in (program_plugin.py), on the GPU machine, compared test by test.
# Run from the repository root there, after prepare_program_tests.sh here, with carry
# [".device/whl", ".device/meta", ".device/cuda_core_tests"]:
#   bash bench/gpu_foreign_acceptance/run_program_tests.sh
# Four runs of the same file, each a fresh process:
#   stock   cuda.core's Program;
#   k1      kcache's, against a kcache server on this machine (SQLite, a publish token) that
#           compiles every miss with this machine's NVRTC, an empty node tier;
#   k2      kcache's again, a fresh empty node tier: what the server compiled for k1 is found;
#   local   kcache's with no server: the client compiles (KCACHE_LOCAL_COMPILE=1).
# The image's NVRTC is 13.0, which has no bundled headers (13.3+), so the toolchain's
# header directory is filled from the image's CUDA headers (server_headers.py), for the
# server and the local compiles alike: kcache compiles with the NVRTC cuda.core uses.
# Results: the JSON lines printed (compare.py per kcache run) and $OUT/program-results.tgz.
set -uo pipefail
T=$(pwd)/.device/cuda_core_tests
OUT=${OUT:-/tmp/program-out}
W=${ACCEPT_WORK:-/tmp/program-tests}
R=$W/results
RUN_S=${RUN_S:-120}
PORT=8471 SCOPES="--scope compile --scope publish"
mkdir -p "$OUT"
source bench/gpu_foreign_acceptance/device_server.sh
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import sys, cuda.core, cuda.bindings, cuda.pathfinder; from cuda.bindings import nvrtc; print(sys.version.split()[0], "cuda.core", cuda.core.__version__, "cuda.bindings", cuda.bindings.__version__, "cuda.pathfinder", cuda.pathfinder.__version__, "nvrtc", nvrtc.nvrtcVersion()[1:])'
  sha256sum "$T/test_program.py"
} 2>&1 | tee "$R/versions.txt"
export ACCEPT_OUT=$R

program_run() {  # program_run TAG KCACHE(0|1) [server|local]
  local tag=$1 swap=$2 mode=${3:-}
  local -a env_args=(ACCEPT_TAG="$tag" KCACHE_PROGRAM="$swap" KCACHE_CACHE_DIR="$W/tier-$tag")
  case $mode in
    server) env_args+=(KCACHE_URL=$URL KCACHE_TOKEN="$TOKEN" KCACHE_KNOWN_SERVERS="$W/known_servers") ;;
    local) env_args+=(KCACHE_URL= KCACHE_LOCAL_COMPILE=1) ;;
  esac
  (cd "$T" && env "${env_args[@]}" timeout -k 10 -s INT "$RUN_S" python3 -m pytest -c /dev/null \
    --rootdir "$T" -p program_plugin -p no:cacheprovider -q -rfEs \
    --junitxml="$R/program-$tag.xml" test_program.py >"$R/program-$tag.log" 2>&1)
  echo "{\"run\": \"$tag\", \"exit\": $?, \"last_line\": \"$(tail -1 "$R/program-$tag.log" | tr -d '"')\"}"
}
t0=$(date +%s)
program_run stock 0
program_run k1 1 server
program_run k2 1 server
program_run local 1 local
get "$URL/v1/stats?since=$t0" >"$R/stats.json" 2>/dev/null
python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({"server_stats": {k: s.get(k) for k in ("kernel_lookups","kernel_hits","kernel_misses","hit_rate")}}))' "$R/stats.json" 2>/dev/null
for run in k1 k2 local; do
  python3 "$A/compare.py" "program-$run" "$R/program-stock.xml" "$R/program-$run.xml"
  python3 -c 'import json,sys; print(json.dumps({"routes": sys.argv[2], **json.load(open(sys.argv[1]))["totals"]}))' "$R/$run-routes.json" "$run" 2>/dev/null
done
kill "$SERVER_PID" 2>/dev/null
tar czf "$OUT/program-results.tgz" -C "$W" results
