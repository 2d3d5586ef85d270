#!/usr/bin/env bash
# Start the entropic server in the background, wait until it is ready, run a command against it
# (SGLANG_ENTROPIC_URL is set for it), then stop the server. Usage: serve_and_run.sh CMD [ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
port=${PORT:-30000}
log=${SERVER_LOG:-/tmp/sgl-entropic-server-$port.log}
setsid .venv/bin/python -m sgl_entropic.launch_server --port "$port" ${SERVER_ARGS:-} >"$log" 2>&1 &
server=$!
trap 'kill -- -"$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
echo "server: starting on port $port (log: $log)"
for _ in $(seq 1 240); do
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$server" 2>/dev/null; then echo "server: exited early; last log lines:" >&2; tail -20 "$log" >&2; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$port/health" >/dev/null || { echo "server: not ready after 240 s" >&2; tail -20 "$log" >&2; exit 1; }
echo "server: ready"
SGLANG_ENTROPIC_URL="http://127.0.0.1:$port" "$@"
