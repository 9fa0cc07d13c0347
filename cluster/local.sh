#!/usr/bin/env bash
# A local Ray cluster of this project's own: bound to 127.0.0.1, its own temp dir and ports, started
# as one process group so that `stop` ends exactly what `start` began (never `ray stop`, which kills
# every Ray process on the machine).
#
#   cluster/local.sh start | stop | status | submit -- python sweeps/pair_residual.py --task stsb
#   cluster/local.sh start --nodes 3 [--gpus-per-worker 1]   # head + 2 worker nodes sharing no disk (cluster/nodes.py)
#   cluster/local.sh start --autoscale                       # head only (= --nodes 1 --autoscale); Ray's autoscaler adds worker nodes on demand
#   cluster/local.sh serve [serving/config.yaml] [KEY=VALUE ...]   # serve deploy on this cluster, wait until RUNNING;
#                                                  # KEY=VALUE sets an argument of its applications (cluster/serve_config.py)
#   cluster/local.sh stop-job <submission id>      # stop a job (SIGTERM to its driver) and wait for its end;
#                                                  # Ctrl-C under `submit` does the same to the job it follows
#   cluster/local.sh release [--if-left]           # stop, unless another job or a Serve application is on it
#                                                  # (the end of `make run`: it never ends another's work)
#   eval "$(cluster/local.sh env)"                 # this shell's Ray clients (a driver run by hand) reach it
#
# Environment: VENV (.venv), EMBED_RAY_DIR (.cache/ray_local), RAY_PORT (6390), RAY_DASHBOARD_PORT (8265),
# RAY_CLIENT_PORT (6391), RAY_AGENT_PORT (52375), RAY_AGENT_GRPC_PORT, RAY_RUNTIME_ENV_AGENT_PORT,
# RAY_METRICS_PORT, DASHBOARD_METRIC_PORT (44227), AUTOSCALER_METRIC_PORT (44217) (Ray's defaults),
# RAY_NUM_CPUS (all cores), RAY_AUTH_TOKEN_PATH ($EMBED_RAY_DIR/auth_token, made on first start), EMBED_DATA_DIR
# (as make: the mirror ../shared/data beside the clone when it is there, with HF_HUB_OFFLINE=1),
# the Ray Serve settings of cluster/serve.env (each overridable from the environment). `submit` forwards EMBED_DATA_DIR, EMBED_CACHE_DIR, EMBED_STORAGE_DIR,
# EMBED_TEACHER_FOLD_WORKERS, MLFLOW_TRACKING_URI, MLFLOW_ARTIFACT_ROOT, MLflow's client settings MLFLOW_TRACKING_USERNAME/PASSWORD and
# MLFLOW_HTTP_REQUEST_* (retries, backoff, timeout) and HF_HUB_OFFLINE to the job; with no MLFLOW_TRACKING_URI it forwards this
# clone's own store (sqlite:///<repo>/mlflow.db, artifacts in <repo>/mlartifacts, what `make` uses), never leaving the
# job to put one in its temporary copy of the working dir; likewise the caches (.cache/embed_lib) and Tune's state
# (.cache/ray_results). `job-env` prints what `submit` would forward. A one-node `start` and `serve` take the same
# defaults, so that the cluster's replicas read them from whatever directory it was started in.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# data: the Makefile's rule (the mirror ../shared/data beside the clone when it is there, then offline), so that a
# cluster started by hand, and the jobs submitted to it, read what `make cluster-start`'s do (without it a served
# champion's warm corpus went to the Hub: every Encoder replica failed offline, and Serve retried each for minutes)
if [[ -z "${EMBED_DATA_DIR:-}" && -f "$ROOT/../shared/data/stsb/train.parquet" ]]; then
  EMBED_DATA_DIR="$(cd "$ROOT/../shared/data" && pwd)"; export EMBED_DATA_DIR HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
fi
VENV="${VENV:-$ROOT/.venv}"
STATE="${EMBED_RAY_DIR:-$ROOT/.cache/ray_local}"
PORT="${RAY_PORT:-6390}"
DASH="${RAY_DASHBOARD_PORT:-8265}"
PIDFILE="$STATE/head.pid"
# a multi-node cluster of cluster/nodes.py (`start --nodes N`): submit, serve, status and stop go to it while it runs
# (its state lives inside this cluster's state dir, so that a test's own EMBED_RAY_DIR never reaches a developer's)
MULTI="${EMBED_MULTI_DIR:-$STATE/multi}"
multi() { [[ -f "$MULTI/cluster.json" ]]; }
DASH_URL="http://127.0.0.1:$DASH"
if multi; then
  DASH_URL="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["dashboard"])' "$MULTI/cluster.json")"
  export RAY_AUTH_TOKEN_PATH="$MULTI/auth_token"
fi
# ports of our own, away from Ray's defaults, so a `ray.init()` elsewhere on the machine cannot take them
RAY_CLIENT_PORT="${RAY_CLIENT_PORT:-6391}"  # outside the worker range 10002-19999
RAY_AGENT_PORT="${RAY_AGENT_PORT:-52375}"
export PATH="$VENV/bin:$PATH"  # job entrypoints (`python ...`) resolve to the project's interpreter
# A single-node cluster: with this Ray takes 127.0.0.1 as the node address (it replaces
# --node-ip-address=127.0.0.1 by the host's address otherwise) and binds GCS, raylet, workers, agents and
# the metrics servers to loopback. Clients that connect with ray.init(address=...) need it too (the
# tests' conftest sets it); it only forbids adding worker nodes, which this script never does.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}"
# Prometheus metrics export of the dashboard agent: off unless EMBED_RAY_METRICS=1 (Ray's own
# RAY_enable_metrics_collection wins when set). The dashboard's and autoscaler's metrics servers always
# start; on this cluster they listen on 127.0.0.1 only.
export RAY_enable_metrics_collection="${RAY_enable_metrics_collection:-$([[ "${EMBED_RAY_METRICS:-0}" == 1 ]] && echo 1 || echo 0)}"
# token authentication on: the cluster and every client of it read this project's own token file
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$STATE/auth_token}"
# where nothing else is named, the clone's own store and caches, as the Makefile names them (sqlite:///<repo>/mlflow.db
# with artifacts in <repo>/mlartifacts, .cache/embed_lib, .cache/ray_results): a one-node cluster started by hand
# then serves from any working directory (its replicas read MLflow's default, ./mlflow.db of the directory `start`
# ran in, and found no champion from any other; their embedding cache went to ./.cache there, cold)
clone_defaults() {
  if [[ -z "${MLFLOW_TRACKING_URI:-}" ]]; then
    export MLFLOW_TRACKING_URI="sqlite:///$ROOT/mlflow.db" MLFLOW_ARTIFACT_ROOT="${MLFLOW_ARTIFACT_ROOT:-$ROOT/mlartifacts}"
  fi
  export EMBED_CACHE_DIR="${EMBED_CACHE_DIR:-$ROOT/.cache/embed_lib}" EMBED_STORAGE_DIR="${EMBED_STORAGE_DIR:-$ROOT/.cache/ray_results}"
}
# the cluster of several nodes' MLflow server (its URL, user and the cluster token) as this shell's MLflow settings
use_cluster_mlflow() {
  local server
  server="$(python3 "$ROOT/cluster/nodes.py" env)" || return 2
  eval "$(grep MLFLOW_ <<<"$server")"
}
# the runtime env of a submitted job: working_dir, its excludes, and the settings the job must see as the submitter
# does (absolute paths: the job runs in a temporary copy of the tree)
job_env() {
  if multi; then
    # several nodes share no disk: the cluster's MLflow server (its URL, user and the cluster token), never a local store
    if [[ -n "${MLFLOW_TRACKING_URI:-}" && "$MLFLOW_TRACKING_URI" != http*://* ]]; then
      echo "MLFLOW_TRACKING_URI=$MLFLOW_TRACKING_URI is a local store, and this cluster has several nodes that share no" \
           "disk: unset it to use the cluster's MLflow server, or name another server's http(s):// URL" >&2
      return 2
    fi
    if [[ -z "${MLFLOW_TRACKING_URI:-}" ]]; then use_cluster_mlflow || return 2; fi
  fi
  # the store, the caches and Tune's state (what --resume reads) where `make` keeps them, not in the job's temporary
  # copy of the working dir
  clone_defaults
  python3 -c 'import json, os, sys
keys = ["EMBED_DATA_DIR", "EMBED_CACHE_DIR", "EMBED_STORAGE_DIR", "EMBED_TEACHER_FOLD_WORKERS", "MLFLOW_TRACKING_URI",
        "MLFLOW_ARTIFACT_ROOT", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "HF_HUB_OFFLINE"]
keys += [k for k in os.environ if k.startswith("MLFLOW_HTTP_REQUEST_")]  # the MLflow client: retries, backoff, timeout
print(json.dumps({"working_dir": ".", "excludes": json.load(open(sys.argv[1]))["excludes"],
                  "env_vars": {k: os.environ[k] for k in keys if os.environ.get(k)}}))' "$ROOT/cluster/runtime_env.json"
}
ensure_token() {
  mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
  [[ -s "$RAY_AUTH_TOKEN_PATH" ]] || (umask 077; python3 -c 'import secrets; print(secrets.token_hex(32), end="")' >"$RAY_AUTH_TOKEN_PATH")
}

# Ray Serve throughput settings (cluster/serve.env); a variable already set in the environment wins
while IFS='=' read -r key value; do
  [[ -n "${!key+set}" ]] || export "$key=$value"
done < <(grep -E '^[A-Z_][A-Z0-9_]*=' "$ROOT/cluster/serve.env")

running() { [[ -f "$PIDFILE" ]] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
# the HAProxy files of this cluster (a dir `start` made under /tmp/embhap-*), removed at stop and before a start
drop_haproxy_dir() {
  local dir; dir="$(cat "$STATE/haproxy.dir" 2>/dev/null || true)"
  [[ "$dir" == /tmp/embhap-* ]] && rm -rf "$dir"
  rm -f "$STATE/haproxy.dir"
}

case "${1:-}" in
  start)
    if [[ "${2:-}" == "--nodes" ]]; then
      # several nodes: cluster/nodes.py (network namespaces, worker nodes as another user, the MLflow server)
      nodes="${3:-}"
      [[ "$nodes" =~ ^[0-9]+$ ]] && (( nodes >= 1 )) || {
        echo "--nodes '${nodes}': give the number of nodes, head included (2 or more; 1 with --autoscale)" >&2; exit 2; }
      shift 3
      (( nodes > 1 )) || [[ " $* " == *" --autoscale"* ]] || { echo "--nodes $nodes: a one-node cluster is plain 'start'" >&2; exit 2; }
      exec python3 "$ROOT/cluster/nodes.py" start --workers $((nodes - 1)) "$@"
    fi
    # the autoscaler without --nodes: a head alone, worker nodes added on demand (start --nodes 1 --autoscale)
    if [[ "${2:-}" == "--autoscale" ]]; then shift 1; exec python3 "$ROOT/cluster/nodes.py" start --workers 0 "$@"; fi
    # one node takes no options: refuse one rather than start a cluster that ignores it
    [[ -z "${2:-}" ]] || { echo "start: unknown option '$2'; one node is plain 'start', several 'start --nodes N" \
                                "[--autoscale] [--gpus-per-worker G]' (cluster/nodes.py start --help)" >&2; exit 2; }
    if running; then echo "local Ray already running (pgid $(cat "$PIDFILE")), dashboard http://127.0.0.1:$DASH"; exit 0; fi
    clone_defaults
    # the fixed ports this cluster binds, each free: another process on one (often another Ray cluster on Ray's
    # default dashboard port) left this one half started, waiting 120 s for a dashboard it could not bind
    taken=""
    for var in RAY_PORT:$PORT RAY_DASHBOARD_PORT:$DASH RAY_CLIENT_PORT:$RAY_CLIENT_PORT RAY_AGENT_PORT:$RAY_AGENT_PORT \
               DASHBOARD_METRIC_PORT:${DASHBOARD_METRIC_PORT:-44227} AUTOSCALER_METRIC_PORT:${AUTOSCALER_METRIC_PORT:-44217} \
               RAY_AGENT_GRPC_PORT:${RAY_AGENT_GRPC_PORT:-} RAY_RUNTIME_ENV_AGENT_PORT:${RAY_RUNTIME_ENV_AGENT_PORT:-} \
               RAY_METRICS_PORT:${RAY_METRICS_PORT:-}; do
      p="${var#*:}"; [[ -n "$p" ]] || continue
      ss -ltnH "sport = :$p" 2>/dev/null | grep -q . || continue
      who="$(python3 "$ROOT/cluster/dashboard.py" holder "$p" 2>/dev/null || true)"
      taken="$taken ${var%%:*}=$p (${who:-another process})"
    done
    if [[ -n "$taken" ]]; then
      echo "start: port(s) in use:$taken. Another Ray cluster? Give this one other ports (e.g. RAY_DASHBOARD_PORT=8266" \
           "DASHBOARD_METRIC_PORT=44228 AUTOSCALER_METRIC_PORT=44218 make run), or stop what holds them." >&2
      exit 1
    fi
    mkdir -p "$STATE/tmp"
    rm -f "$STATE/left-running"
    ensure_token
    # Serve's ingress: HAProxy (cluster/serve.env) with ports and files of this cluster's own (a short dir: Unix
    # sockets), its stats and metrics on loopback (cluster/haproxy-loopback); RAY_SERVE_ENABLE_HA_PROXY=0: the proxy
    drop_haproxy_dir
    if [[ "${RAY_SERVE_ENABLE_HA_PROXY:-0}" == 1 ]]; then
      hap="$(mktemp -d /tmp/embhap-XXXXXX)"; echo "$hap" >"$STATE/haproxy.dir"
      hap_env="$(python "$ROOT/serving/serve_env.py" haproxy "$hap")" || { rm -rf "$hap"; exit 2; }
      eval "$hap_env"
      echo "haproxy" >"$STATE/ingress"
    else
      echo "proxy" >"$STATE/ingress"
    fi
    # a stopped job's driver (Ctrl-C under `submit`, `stop-job`) gets SIGTERM, then SIGKILL after this many seconds
    # (Ray's default: 3): a sweep stops its trials through Tune, saving its state, and closes its MLflow runs
    export RAY_JOB_STOP_WAIT_TIME_S="${RAY_JOB_STOP_WAIT_TIME_S:-30}"
    # every port can be set, so that two clusters (a developer's and the tests') never collide
    setsid ray start --head --block --node-ip-address=127.0.0.1 --port="$PORT" \
      --dashboard-host=127.0.0.1 --dashboard-port="$DASH" --temp-dir="$STATE/tmp" \
      ${RAY_NUM_CPUS:+--num-cpus=$RAY_NUM_CPUS} \
      ${RAY_CLIENT_PORT:+--ray-client-server-port=$RAY_CLIENT_PORT} \
      ${RAY_AGENT_PORT:+--dashboard-agent-listen-port=$RAY_AGENT_PORT} \
      ${RAY_AGENT_GRPC_PORT:+--dashboard-agent-grpc-port=$RAY_AGENT_GRPC_PORT} \
      ${RAY_RUNTIME_ENV_AGENT_PORT:+--runtime-env-agent-port=$RAY_RUNTIME_ENV_AGENT_PORT} \
      ${RAY_METRICS_PORT:+--metrics-export-port=$RAY_METRICS_PORT} \
      --disable-usage-stats >"$STATE/head.log" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 480); do
      if curl -sf -H "Authorization: Bearer $(cat "$RAY_AUTH_TOKEN_PATH")" "http://127.0.0.1:$DASH/api/version" >/dev/null 2>&1; then
        echo "local Ray up: address 127.0.0.1:$PORT, dashboard/jobs http://127.0.0.1:$DASH"; exit 0; fi
      running || { echo "ray start failed; see $STATE/head.log" >&2; tail -20 "$STATE/head.log" >&2; exit 1; }
      sleep 0.25
    done
    echo "local Ray did not answer on :$DASH within 120 s; see $STATE/head.log. Stopping what started." >&2
    "$0" stop >&2 || true
    exit 1 ;;
  stop)
    rm -f "$STATE/left-running"
    if multi; then python3 "$ROOT/cluster/nodes.py" stop; running || exit 0; fi
    # everything the cluster started shares the session of `setsid ray start` (workers take their own
    # process group, not their own session): stop that session, nothing else on the machine
    if running; then
      sid="$(cat "$PIDFILE")"
      pids="$(ps -eo pid=,sid= | awk -v s="$sid" '$2 == s {print $1}' | paste -sd '|')"
      ports="$(ss -ltnpH 2>/dev/null | grep -E "pid=(${pids:-none})," | awk '{n = split($4, a, ":"); print a[n]}' | sort -un | paste -sd ' ')"
      pkill -TERM -s "$sid" 2>/dev/null || true
      for _ in $(seq 1 30); do pgrep -s "$sid" >/dev/null || break; sleep 0.1; done
      pkill -KILL -s "$sid" 2>/dev/null || true  # `ray start --block` and gcs/raylet linger after TERM
      open=""
      for _ in $(seq 1 100); do
        open=""
        for p in $ports; do ss -ltnH "sport = :$p" 2>/dev/null | grep -q . && open="$open $p"; done
        [[ -z "$open" ]] && ! pgrep -s "$sid" >/dev/null && break
        sleep 0.1
      done
      rm -f "$PIDFILE"
      drop_haproxy_dir
      if [[ -n "$open" ]]; then echo "local Ray stopped, but port(s)$open still listen after 10 s" >&2; exit 1; fi
      echo "local Ray stopped (ports closed: ${ports:-none})"
    else
      echo "local Ray not running"
      rm -f "$PIDFILE"
    fi ;;
  release)
    # the end of `make run` on a cluster it started: a job submitted meanwhile (another `make run`) or an application
    # deployed on it (`make serve`) keeps it running, marked as left; nothing else on it: stop. `release --if-left`
    # (a `make run` ending on a cluster it did not start) acts only on a cluster so marked, so the last run stops it
    [[ "${2:-}" != "--if-left" || -f "$STATE/left-running" ]] || exit 0
    if { running || multi; } && work="$(python3 "$ROOT/cluster/dashboard.py" busy "$DASH_URL")"; then
      touch "$STATE/left-running"
      last=""; [[ "$work" == *"job "* ]] && last=" (or the last make run to end on it, once nothing else is there)"
      echo "local Ray left running, it holds other work: $work. make cluster-stop stops it$last."; exit 0
    fi
    exec "$0" stop ;;
  env)
    # what a client process needs to connect (a driver run by hand instead of `submit`): without
    # RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 the driver takes the host's address as its node address, which
    # this loopback-only node does not have, and ray.init waits without end
    printf 'export RAY_ADDRESS=%q RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=%q RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0\n' \
      "127.0.0.1:$PORT" "$RAY_AUTH_TOKEN_PATH" ;;
  status)
    if multi; then python3 "$ROOT/cluster/nodes.py" status; exit; fi
    if running; then echo "running (pgid $(cat "$PIDFILE")), dashboard http://127.0.0.1:$DASH"; else echo "stopped"; exit 1; fi ;;
  job-env)
    job_env ;;
  stop-job)
    [[ -n "${2:-}" ]] || { echo "stop-job: give the job's submission id (embed-...; the dashboard's job list)" >&2; exit 2; }
    running || multi || { echo "stop-job: local Ray is not running ($STATE)" >&2; exit 1; }
    exec python3 "$ROOT/cluster/dashboard.py" stop-job "$DASH_URL" "$2" ;;
  submit)
    shift; [[ "${1:-}" == "--" ]] && shift
    (( $# )) || { echo "submit: no command; e.g. cluster/local.sh submit -- python sweeps/pair_residual.py --task stsb" >&2
                  exit 2; }
    running || multi || { echo "submit: local Ray is not running ($STATE): cluster/local.sh start first" >&2; exit 1; }
    env_json=$(job_env) || exit 2
    cd "$ROOT"
    id="embed-$(date +%Y%m%d-%H%M%S)-$$"
    out="$(mktemp)"; trap 'rm -f "$out"' EXIT
    # submit (right after `start` the job agent may not have registered yet: retry that one refusal), then follow
    # the job's log to its end: cluster/dashboard.py reads the job API several times a second and prints the
    # verdict as its last line (`ray job submit` without --no-wait notices a job's end seconds late)
    # a Ctrl-C before the job is followed (during the submit, or as follow-job starts) stops the job if it was
    # submitted; follow-job keeps one that reaches it as it starts (cluster/dashboard.py)
    ctrl_c=""; trap 'ctrl_c=1' INT
    for attempt in $(seq 1 60); do
      ray job submit --no-wait --address "$DASH_URL" --submission-id "$id" \
        --runtime-env-json "$env_json" -- "$@" >"$out" 2>&1 && break
      [[ -z $ctrl_c ]] || break
      grep -q "No available agent" "$out" && [[ $attempt != 60 ]] || { cat "$out"; echo "Job '$id' NOT SUBMITTED"; exit 1; }
      sleep 2
    done
    grep -o "Job '$id' submitted successfully" "$out" || true
    if [[ -n $ctrl_c ]]; then
      echo "Ctrl-C: stopping job '$id' if it was submitted" >&2
      rc=0; python3 "$ROOT/cluster/dashboard.py" stop-job "$DASH_URL" "$id" 2>"$out" || rc=$?  # 3: no such job
      case $rc in 0) ;; 3) echo "Job '$id' NOT SUBMITTED" ;; *) cat "$out" >&2; echo "Job '$id' UNKNOWN" ;; esac
      exit 130
    fi
    python3 "$ROOT/cluster/dashboard.py" follow-job "$DASH_URL" "$id" ;;
  serve)
    # deploy a Serve config (default serving/config.yaml) on this cluster and wait until it is RUNNING; KEY=VALUE
    # after it sets that argument of every application (model_uri=models:/pair-residual-qqp@champion), in a copy
    # under the cluster's state dir, checked against the application's arguments first (cluster/serve_config.py)
    shift
    config="$ROOT/serving/config.yaml"
    if (( $# )) && [[ "$1" != *=* ]]; then config="$1"; shift; fi
    [[ -f "$config" ]] || { echo "serve: no Serve config at $config (e.g. serving/config.yaml)" >&2; exit 2; }
    config="$(realpath "$config")"
    # KEY=VALUE go into a copy; so do, on this loopback-only cluster, http_options.host 127.0.0.1 where the config
    # has none (behind Serve's HAProxy ingress Ray's default host is every interface), and what the replicas run (a
    # fingerprint of the code, the versions the model aliases point at): a deploy after either changed rolls them over
    source="$config"
    multi || clone_defaults
    # (the aliases resolved against the store the replicas read: on several nodes, the cluster's MLflow server)
    ( if multi; then use_cluster_mlflow 2>/dev/null || true; fi
      python3 "$ROOT/cluster/serve_config.py" $(multi || echo --loopback) "$config" "$STATE/serve/$(basename "$config")" \
        "$@" ) || exit 2
    config="$STATE/serve/$(basename "$config")"
    running || multi || { echo "local Ray is not running: cluster/local.sh start first" >&2; exit 1; }
    cd "$ROOT"
    # the config's HTTP port taken by another process: said here, not by HAProxy's own line ~15 s into the deploy
    multi || python3 "$ROOT/cluster/dashboard.py" serve-port "$DASH_URL" "$config" "$source" || exit 1
    serve deploy "$config" --address "$DASH_URL"
    # wait on the dashboard's Serve REST API (what `serve status` reads, polled from one process instead of a
    # Python that imports Ray per look) until every application of the config is RUNNING with healthy
    # deployments, or one has failed
    python3 "$ROOT/cluster/dashboard.py" wait-serve "$DASH_URL" "$config"
    if multi; then ingress=proxy; else ingress="$(cat "$STATE/ingress" 2>/dev/null || echo proxy)"; fi
    case "$ingress" in
      haproxy) echo "ingress: Ray Serve's HAProxy (RAY_SERVE_ENABLE_HA_PROXY=0 at cluster start: Serve's Python proxy)" ;;
      *) echo "ingress: Ray Serve's Python proxy" ;;
    esac ;;
  *)
    echo "usage: $0 start | stop | release | status | env | job-env | submit -- COMMAND... | stop-job ID | serve [CONFIG] [KEY=VALUE...]" >&2
    exit 2 ;;
esac
