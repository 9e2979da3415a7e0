#!/usr/bin/env bash
# Issue 47 item 4 on the GPU: a job's Triton kernel reaches a new node through the job's
# manifest, in one request, and Triton compiles nothing there (triton_job_manifest.py).
# Run from the repository root on the GPU machine, with carry [".device/whl", ".device/meta"]
# (prepare_program_tests.sh fills them here):
#   bash bench/gpu_foreign_acceptance/run_job_manifest.sh
set -uo pipefail
W=${ACCEPT_WORK:-/tmp/job-manifest}
R=$W/results
PORT=8472 SCOPES="--scope publish"
source bench/gpu_foreign_acceptance/device_server.sh
python3 -c 'import sys, triton, torch; print(sys.version.split()[0], "triton", triton.__version__, "torch", torch.__version__)'
KCACHE_URL=$URL KCACHE_TOKEN=$TOKEN KCACHE_KNOWN_SERVERS=$W/known_servers \
  timeout -k 10 240 python3 "$A/triton_job_manifest.py" "$W"
status=$?
kill "$SERVER_PID" 2>/dev/null
exit $status
