#!/usr/bin/env bash
# SGLang's model gateway (smg, `scripts/setup.sh --router`) in front of N entropic workers, all on
# this machine. Ctrl-C (or the end of CMD) stops them all.
#   scripts/router.sh                  gateway on :30000, 2 workers (`--entropic full`) on :30001..
#   scripts/router.sh CMD [ARGS...]    the same, then run CMD with SGLANG_ENTROPIC_URL=<gateway>
# WORKERS, PORT, ROUTER_METRICS_PORT, POLICY (smg's --policy, default cache_aware) and WORKER_ARGS (flags for every
# `python -m sgl_entropic.launch_server`, default `--entropic full`) change the set-up.
set -euo pipefail
cd "$(dirname "$0")/.."
workers=${WORKERS:-2}
port=${PORT:-30000}
policy=${POLICY:-cache_aware}
metrics_port=${ROUTER_METRICS_PORT:-$((port + 1000))}  # the gateway's own /metrics (its default 29000 is shared)
logs=${LOG_DIR:-/tmp/sgl-entropic-router}
mkdir -p "$logs"
# smg is run as `python -m smg`: the old sglang-router wheel installs a `smg` console script too.
.venv/bin/python -c 'import smg.launch_router' 2>/dev/null \
  || { echo "router: smg is not installed (bash scripts/setup.sh --router)" >&2; exit 1; }

pids=()
trap 'for p in ${pids[@]+"${pids[@]}"}; do kill -- -"$p" 2>/dev/null || true; done; wait 2>/dev/null || true' EXIT
wait_ready() {  # url pid log
  for _ in $(seq 1 300); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || { echo "router: $3 exited early:" >&2; tail -20 "$3" >&2; exit 1; }
    sleep 1
  done
  echo "router: $1 not ready after 300 s" >&2; tail -20 "$3" >&2; exit 1
}

urls=()
for i in $(seq 1 "$workers"); do
  wport=$((port + i))
  # Every worker shares the machine's 2 cores: an idle scheduler sleeps instead of spinning one.
  setsid .venv/bin/python -m sgl_entropic.launch_server --port "$wport" --sleep-on-idle \
    ${WORKER_ARGS:---entropic full} >"$logs/worker-$i.log" 2>&1 &
  pids+=($!)
  urls+=("http://127.0.0.1:$wport")
done
for i in $(seq 1 "$workers"); do wait_ready "${urls[$((i - 1))]}" "${pids[$((i - 1))]}" "$logs/worker-$i.log"; done
echo "router: workers ready: ${urls[*]}"

setsid .venv/bin/python -m smg launch --host 127.0.0.1 --port "$port" --worker-urls "${urls[@]}" \
  --policy "$policy" --prometheus-host 127.0.0.1 --prometheus-port "$metrics_port" >"$logs/router.log" 2>&1 &
pids+=($!)
wait_ready "http://127.0.0.1:$port" "${pids[-1]}" "$logs/router.log"
# /health answers before smg has registered its workers (in the background): /readiness counts them
registered() { curl -s "http://127.0.0.1:$port/readiness" | grep -qE "\"healthy_workers\": *$workers[,}]"; }
for _ in $(seq 1 120); do registered && break; sleep 1; done
registered || { echo "router: not all $workers workers registered after 120 s" >&2; tail -20 "$logs/router.log" >&2; exit 1; }
echo "router: smg ready on http://127.0.0.1:$port (policy $policy, /metrics on :$metrics_port; logs in $logs)"
if [ $# -gt 0 ]; then
  SGLANG_ENTROPIC_URL="http://127.0.0.1:$port" "$@"
else
  wait "${pids[-1]}"
fi
