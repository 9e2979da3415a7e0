# Sourced by the GPU machine's runners (run_program_tests.sh, run_job_manifest.sh), from the
# repository root there, with W (a work directory), R (its results directory), PORT and
# SCOPES (the token's, e.g. "--scope publish") set: puts the carried wheels on PYTHONPATH,
# fills the toolchain's header directory from the image's CUDA headers (its NVRTC 13.0 has
# no bundled headers: server_headers.py), starts `kcache serve` (SQLite under $W/server) and
# waits for it. Leaves REPO, A, D, URL, TOKEN, SERVER_PID, kc and get defined.
REPO=$(pwd)
A=$REPO/bench/gpu_foreign_acceptance
D=$REPO/.device
rm -rf "$W" && mkdir -p "$R"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$D"/whl/*.whl || exit 1
export PYTHONPATH=$REPO:$REPO/client:$REPO/server:/tmp/site:$A:$D/meta
kc() { python3 -c 'import sys; from kcache.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
get() {  # get URL: the body (with $KCACHE_TOKEN if set), or fail; no curl needed
  python3 -c 'import os,sys,urllib.request as u; r=u.Request(sys.argv[1], headers={"Authorization": "Bearer "+os.environ.get("KCACHE_TOKEN","")}); sys.stdout.write(u.urlopen(r, timeout=30).read().decode())' "$1"
}
export KCACHE_TOOLCHAIN_DIR=$W/toolchain
python3 "$A/server_headers.py" "$KCACHE_TOOLCHAIN_DIR" || exit 1
KD=$W/server
kc db upgrade --data-dir "$KD" >"$R/server-upgrade.log" 2>&1 || { cat "$R/server-upgrade.log"; exit 1; }
# shellcheck disable=SC2086  # SCOPES is several arguments
TOKEN=$(kc token create device-writer $SCOPES --data-dir "$KD" 2>/dev/null) || exit 1
setsid python3 -c 'import sys; from kcache.cli import main; sys.exit(main(sys.argv[1:]))' \
  serve --data-dir "$KD" --port "$PORT" >"$R/server.log" 2>&1 </dev/null &
SERVER_PID=$!
URL=http://127.0.0.1:$PORT
for _ in $(seq 60); do get "$URL/healthz" >/dev/null 2>&1 && break; sleep 0.5; done
get "$URL/healthz" || { tail -30 "$R/server.log"; exit 1; }
echo
