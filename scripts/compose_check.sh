#!/usr/bin/env bash
# `docker compose up` on one box, for real: build relayrl's images, bring up deploy/compose with
# the manual's commands (docs/compose.md), train the example experiment through the coordinator, and check what a
# user expects of it:
#   - every health check passes;
#   - held-out accuracy rises;
#   - Prometheus scrapes every service's metrics endpoint;
#   - the run folder and the learner's checkpoints land on the volumes;
#   - a generator container killed mid-run and started again loses no prompt (every step scores
#     all its groups) and comes back into rotation at the learner's weights;
#   - `docker compose down` leaves no container, network or process behind.
# Then it prints the figures a user wants before trying: image sizes, build times, time from `up`
# to healthy and to the first step.
#
#   bash scripts/compose_check.sh
#
# Needs Docker with compose (`docker compose` or `docker-compose`) and openssl. Exit status: 0
# passed, 1 failed, 77 skipped (no Docker engine and none could be started; the reason is printed).
# Report, logs and figures: runs/compose-check/ (RELAYRL_CHECK_DIR).
#
# It runs under its own compose project (relayrl-check), so it never touches a stack or volumes of
# yours, and removes its volumes at the end (KEEP=1 keeps them, and a Docker engine it started).
#
# Where the manual's defaults cannot be had, it says so and does this instead:
#   - Docker engine not running: as root, starts `dockerd --iptables=false` (the check never
#     rewrites this machine's firewall; containers reach each other on the compose network) and
#     stops it at the end.
#   - python:3.11-slim cannot be pulled: makes a Debian base with debootstrap (root) from the
#     mirror apt uses, trusting this machine's CA bundle (HTTPS through an inspecting proxy).
#   - torch: as scripts/install.sh finds it. A local wheel folder in PIP_FIND_LINKS is served to
#     the build on 127.0.0.1 with torch pinned to it; otherwise PyTorch's CPU index (the
#     Dockerfile's PIP_EXTRA_INDEX_URL, or yours).
#   - prom/prometheus cannot be pulled: an image of Debian's prometheus package
#     (deploy/docker/prometheus-debian.Dockerfile), through PROMETHEUS_IMAGE.
#   - grafana/grafana cannot be pulled: Grafana is not started (Debian packages none); said so.
# Builds run on the host network (`docker build --network host`): with no iptables rules, that is
# how a build reaches the package indexes. Containers talk only to each other and to 127.0.0.1.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
compose_dir="$here/deploy/compose"
out="${RELAYRL_CHECK_DIR:-$here/runs/compose-check}"
mkdir -p "$out"
: >"$out/check.log"
export COMPOSE_PROJECT_NAME=relayrl-check
VERSION=0.1.0
IMAGES=(reward:relayrl/reward:$VERSION coordinator:relayrl/coordinator:$VERSION
        learner:relayrl/learner:$VERSION-cpu generator-cpu:relayrl/generator:$VERSION-cpu)

log() { printf '[compose-check %s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "$out/check.log" >&2; }
fail() { log "FAILED: $*"; exit 1; }
skip() { log "SKIPPED: $*"; exit 77; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.0f}')" "$1" "$(now)"; }
figures=()
figure() { figures+=("$1|$2"); log "$1: $2"; }

# -- cleanup: whatever this script started, it stops ----------------------------------------------
engine_pid="" http_pid="" run_pid="" stack_up=0
cleanup() {
    local rc=$?
    set +e
    trap - ERR
    [ -n "$run_pid" ] && kill "$run_pid" 2>/dev/null
    if [ "$stack_up" = 1 ] && [ "$rc" != 0 ]; then  # before down: the services' side of a failure
        compose logs --no-color >"$out/services.log" 2>&1 && log "service logs: $out/services.log"
    fi
    if [ "$stack_up" = 1 ] && [ "${KEEP:-0}" != 1 ]; then
        compose down --volumes --remove-orphans >>"$out/compose.log" 2>&1
    fi
    [ -n "$http_pid" ] && kill "$http_pid" 2>/dev/null
    if [ -n "$engine_pid" ] && [ "${KEEP:-0}" != 1 ]; then
        kill "$engine_pid" 2>/dev/null && wait "$engine_pid" 2>/dev/null
    fi
    exit "$rc"
}
trap cleanup EXIT
trap "exit 130" INT TERM
set -E  # an unexpected failure anywhere says where, instead of ending the check silently
trap 'log "FAILED: line $LINENO: $BASH_COMMAND (exit status $?)"' ERR

# -- a Docker engine and compose ------------------------------------------------------------------
command -v docker >/dev/null 2>&1 || skip "no docker client on PATH"
if ! docker info >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v dockerd >/dev/null 2>&1; then
        skip "no Docker engine answers, and this user cannot start one (dockerd, as root)"
    fi
    log "starting dockerd --iptables=false (log: $out/dockerd.log)"
    dockerd --iptables=false >"$out/dockerd.log" 2>&1 &
    engine_pid=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null 2>&1 || skip "dockerd did not come up (see $out/dockerd.log)"
fi
if docker compose version >/dev/null 2>&1; then
    compose() { (cd "$compose_dir" && docker compose "$@"); }
elif command -v docker-compose >/dev/null 2>&1; then
    compose() { (cd "$compose_dir" && docker-compose "$@"); }
else
    skip "neither 'docker compose' (v2 plugin) nor 'docker-compose' is installed"
fi
command -v openssl >/dev/null 2>&1 || skip "openssl is needed for deploy/make-secrets.sh"
log "docker engine $(docker version -f '{{.Server.Version}}'), $(compose version --short 2>/dev/null || compose version | head -1)"
if [ -n "$(compose ps -q 2>/dev/null)" ]; then
    fail "compose project $COMPOSE_PROJECT_NAME is up already: 'COMPOSE_PROJECT_NAME=$COMPOSE_PROJECT_NAME docker compose down -v' in deploy/compose first"
fi

# Room for the builds: the generator's install stage alone writes ~4 GB twice (its layer and the
# image's copy), and a rebuild leaves the replaced layers behind as dangling images.
root_dir=$(docker info -f '{{.DockerRootDir}}')
free_gb=$(df -P -BG "$root_dir" | awk 'NR == 2 {sub("G", "", $4); print $4}')
[ "$free_gb" -ge 16 ] || fail "only $free_gb GB free under $root_dir; the images need ~16 GB (old builds: docker image prune)"

have_image() { docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1; }

# -- the base image --------------------------------------------------------------------------------
base=python:3.11-slim
if ! have_image "$base"; then
    base=relayrl-local/python:3.11-bookworm
    if ! docker image inspect "$base" >/dev/null 2>&1; then
        [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null 2>&1 ||
            fail "python:3.11-slim cannot be pulled, and making a local base needs debootstrap as root"
        mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
        [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
        mirror=${mirror:-http://deb.debian.org/debian}
        log "python:3.11-slim cannot be pulled: making $base with debootstrap from $mirror"
        root=$(mktemp -d)
        t0=$(now)
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" \
            >"$out/debootstrap.log" 2>&1 || fail "debootstrap failed (see $out/debootstrap.log)"
        # This machine's CA bundle, so that builds trust what the host trusts (an inspecting proxy).
        cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" -c . | docker import -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
            -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' -c 'CMD ["/bin/bash"]' - "$base" >/dev/null
        rm -rf "$root"
        figure "local base image (debootstrap) s" "$(since "$t0")"
    fi
fi

# -- where torch comes from -----------------------------------------------------------------------
torch_args=()
torch_wheel=""
if [ -z "${PIP_EXTRA_INDEX_URL:-}" ] && [ -d "${PIP_FIND_LINKS:-/nonexistent}" ]; then
    torch_wheel=$(find "$PIP_FIND_LINKS" -maxdepth 1 -name 'torch-*+cpu-*.whl' | sort | tail -1)
fi
if [ -n "$torch_wheel" ]; then
    served=$(mktemp -d)
    ln -s "$PIP_FIND_LINKS"/*.whl "$served"/
    version=$(basename "$torch_wheel" | cut -d- -f2)
    echo "torch==$version" >"$served/constraints.txt"
    # A fixed port while it is free: the URL is a build argument, and a new one each run would
    # miss Docker's cache for every pip install.
    port=$(python3 -c 'import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 47711))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
    python3 -m http.server --bind 127.0.0.1 --directory "$served" "$port" >"$out/wheels-http.log" 2>&1 &
    http_pid=$!
    torch_args=(--build-arg PIP_EXTRA_INDEX_URL= --build-arg "PIP_FIND_LINKS=http://127.0.0.1:$port/"
                --build-arg "PIP_CONSTRAINT=http://127.0.0.1:$port/constraints.txt")
    log "torch $version from $PIP_FIND_LINKS (served to the build on 127.0.0.1:$port)"
elif [ -n "${PIP_EXTRA_INDEX_URL:-}" ]; then
    torch_args=(--build-arg "PIP_EXTRA_INDEX_URL=$PIP_EXTRA_INDEX_URL")
fi

# -- images ----------------------------------------------------------------------------------------
for item in "${IMAGES[@]}"; do
    target=${item%%:*} tag=${item#*:}
    log "building $tag (target $target; log: $out/build-$target.log)"
    t0=$(now)
    docker build --network host -f "$here/deploy/docker/Dockerfile" --target "$target" -t "$tag" \
        --build-arg "BASE_IMAGE=$base" "${torch_args[@]}" "$here" >"$out/build-$target.log" 2>&1 ||
        fail "building $tag failed (see $out/build-$target.log)"
    figure "build $target s" "$(since "$t0")"
done
export PROMETHEUS_IMAGE=prom/prometheus:v3.1.0
if ! have_image "$PROMETHEUS_IMAGE"; then
    PROMETHEUS_IMAGE=relayrl-local/prometheus:debian
    log "prom/prometheus cannot be pulled: building $PROMETHEUS_IMAGE from Debian's package"
    docker build --network host -f "$here/deploy/docker/prometheus-debian.Dockerfile" -t "$PROMETHEUS_IMAGE" \
        --build-arg "BASE_IMAGE=$base" "$here/deploy/docker" >"$out/build-prometheus.log" 2>&1 ||
        fail "building $PROMETHEUS_IMAGE failed (see $out/build-prometheus.log)"
fi
for item in "${IMAGES[@]}"; do
    tag=${item#*:}
    figure "image ${item%%:*} MB" "$(( $(docker image inspect -f '{{.Size}}' "$tag") / 1000000 ))"
done
# The reward and coordinator images must hold neither torch nor vLLM.
for tag in relayrl/reward:$VERSION relayrl/coordinator:$VERSION; do
    docker run --rm --network none --entrypoint python "$tag" -c \
        'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ("torch", "vllm", "deepspeed")))' ||
        fail "$tag holds torch, vLLM or DeepSpeed"
done

# -- secrets, as the manual makes them -------------------------------------------------------------
if [ ! -f "$compose_dir/secrets/token" ]; then
    (cd "$compose_dir" && ../make-secrets.sh secrets) >>"$out/check.log"
fi

# -- up, and every health check ---------------------------------------------------------------------
services=(reward generator learner coordinator prometheus)
if have_image grafana/grafana:11.4.0; then
    services+=(grafana)
else
    log "grafana/grafana:11.4.0 cannot be pulled here and Debian packages no Grafana: not started"
fi
t_up=$(now)
stack_up=1
compose up -d "${services[@]}" >>"$out/compose.log" 2>&1 || fail "docker compose up failed (see $out/compose.log)"
containers() {  # this project's containers, of one service or all (running or not; any compose version)
    docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" \
        ${1:+--filter "label=com.docker.compose.service=$1"}
}
healthy() {  # every started service healthy (init: exited 0); fails on an unhealthy or dead one
    local deadline=$(( $(date +%s) + $1 )) waiting
    while :; do
        waiting=""
        for svc in init "${services[@]}"; do
            id=$(containers "$svc")
            [ -n "$id" ] || fail "service $svc has no container"
            state=$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}}' "$id")
            case "$svc $state" in
                "init exited 0 "*) ;;
                "init "*) [ "${state%% *}" = exited ] && fail "init exited: $state (compose logs init)"; waiting+=" $svc" ;;
                *" running 0 healthy"|*" running 0 none") ;;
                *unhealthy) fail "$svc is unhealthy (its log: $out/services.log)" ;;
                *" exited "*) fail "$svc exited: $state" ;;
                *) waiting+=" $svc" ;;
            esac
        done
        [ -z "$waiting" ] && return 0
        [ "$(date +%s)" -lt "$deadline" ] || fail "not healthy after $1 s:$waiting"
        sleep 2
    done
}
healthy 900
figure "up -> all healthy s" "$(since "$t_up")"
compose ps >>"$out/check.log" 2>&1

# -- the example experiment, through the coordinator ------------------------------------------------
in_coordinator() { compose exec -T coordinator "$@"; }
records() { in_coordinator cat "$run_dir/metrics.jsonl" 2>/dev/null || true; }
last_step() {  # the last trained step in metrics.jsonl, 0 before the first
    records | python3 -c 'import json, sys; print(max([json.loads(l)["step"] for l in sys.stdin if "reward_mean" in l] or [0]))'
}
t_run=$(now)
log "running /experiments/experiment.yaml (log: $out/run.log)"
# -T: no terminal here; the README's command is the same without it.
compose run -T --rm --name relayrl-run coordinator relayrl run /experiments/experiment.yaml \
    </dev/null >"$out/run.log" 2>&1 &
run_pid=$!
run_dir=""
for _ in $(seq 300); do
    run_dir=$(sed -n 's/^run folder: \([^ ]*\).*/\1/p' "$out/run.log" | head -1)
    [ -n "$run_dir" ] && break
    kill -0 "$run_pid" 2>/dev/null || fail "relayrl run ended before naming its run folder: $(tail -5 "$out/run.log")"
    sleep 1
done
[ -n "$run_dir" ] || fail "relayrl run named no run folder in 300 s"
log "run folder $run_dir"
until [ "$(last_step)" -ge 1 ]; do
    kill -0 "$run_pid" 2>/dev/null || fail "the run ended before its first step: $(tail -5 "$out/run.log")"
    sleep 1
done
figure "up -> first step s" "$(since "$t_up")"
figure "relayrl run -> first step s" "$(since "$t_run")"

# Prometheus scrapes every service, and the run's own endpoint while it runs.
sleep 12  # two scrape intervals after the first step
python3 - <<'PY' | tee -a "$out/check.log" || fail "Prometheus does not scrape every service (above)"
import json, sys, urllib.parse, urllib.request
def get(path):
    with urllib.request.urlopen("http://127.0.0.1:9090" + path, timeout=10) as r:
        return json.load(r)["data"]
targets = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in get("/api/v1/targets")["activeTargets"]}
want = ["generator:9464", "learner:9466", "reward:9465", "coordinator:9467", "relayrl-run:9468"]
up = {inst: h for (job, inst), h in targets.items()}
q = urllib.parse.quote('count by (job) ({__name__=~"relayrl_.+"})')
series = {r["metric"]["job"]: int(r["value"][1]) for r in get("/api/v1/query?query=" + q)["result"]}
problems = [f"{t}: {up.get(t, 'not a target')}" for t in want if up.get(t) != "up"]
problems += [f"no relayrl_* series from job {j}" for j in ("generator", "learner", "reward", "coordinator") if not series.get(j)]
print("Prometheus targets up: " + ", ".join(t for t in want if up.get(t) == "up") + f"; relayrl_* series per job: {series}")
for p in problems:
    print("problem:", p)
sys.exit(1 if problems else 0)
PY

# A generator killed mid-run, then started again, as a crash and a restart would.
kill_after=${KILL_AFTER_STEP:-12}
until [ "$(last_step)" -ge "$kill_after" ]; do
    kill -0 "$run_pid" 2>/dev/null || fail "the run ended before step $kill_after: $(tail -5 "$out/run.log")"
    sleep 1
done
killed_at=$(last_step)
log "step $killed_at done: killing the generator (SIGKILL), then starting it again"
compose kill -s SIGKILL generator >>"$out/compose.log" 2>&1
compose start generator >>"$out/compose.log" 2>&1
wait "$run_pid" || { run_pid=""; fail "relayrl run failed: $(tail -5 "$out/run.log")"; }
run_pid=""
figure "experiment wall s (incl. the generator restart)" "$(since "$t_run")"
tail -3 "$out/run.log" | tee -a "$out/check.log"

# -- what the run left and what it showed ---------------------------------------------------------
records >"$out/metrics.jsonl"
python3 - "$out/metrics.jsonl" "$killed_at" <<'PY' | tee -a "$out/check.log" || fail "the run's records say no (above)"
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
killed_at = int(sys.argv[2])
steps = [r for r in recs if "reward_mean" in r]
evals = [r["eval_accuracy"] for r in recs if "eval_accuracy" in r]
problems = []
if len(steps) != max(r["step"] for r in steps):
    problems.append(f"{len(steps)} step records for {max(r['step'] for r in steps)} steps")
lost = [(r["step"], r["groups"]) for r in steps if r["groups"] != 16]
if lost:
    problems.append(f"steps that lost prompts (step, groups scored of 16): {lost}")
stale = [r["step"] for r in steps if r["dropped_stale_groups"]]
if stale:
    problems.append(f"steps with groups dropped as stale (a replica sampling with old weights): {stale}")
after = [r for r in steps if r["step"] > killed_at + 1]
if not after or after[-1]["healthy_generators"] != 1 or after[-1]["synced_replicas"] != 1:
    problems.append("the restarted generator is not back in rotation at the learner's weights")
if len(evals) < 2 or evals[-1] < evals[0] + 0.10:
    problems.append(f"held-out accuracy did not rise by 0.10: {evals}")
print(f"held-out greedy accuracy {evals[0]:.3f} -> {evals[-1]:.3f} over {len(steps)} steps; "
      f"generator killed after step {killed_at}; every step scored 16 of 16 groups" if not problems else "")
for p in problems:
    print("problem:", p)
sys.exit(1 if problems else 0)
PY
# The learner writes under its --checkpoint-dir /runs, at the path the coordinator names: the run
# folder's checkpoints/ (one DeepSpeed tag folder per checkpoint), beside coordinator.json.
ckpt=$(in_coordinator sh -c "ls -d $run_dir/checkpoints/step*/ 2>/dev/null" | tr '\n' ' ' || true)
[ -n "$ckpt" ] || fail "no learner checkpoint under $run_dir/checkpoints on the runs volume"
in_coordinator test -s "$run_dir/checkpoints/coordinator.json" || fail "no coordinator.json in $run_dir/checkpoints"
in_coordinator test -s "$run_dir/reward_curve.png" || fail "no reward curve in $run_dir"
log "on the runs volume: $run_dir (metrics.jsonl, reward_curve.png, checkpoints: $ckpt)"

# -- down: no container, network or process left ------------------------------------------------
pids=""
for id in $(docker ps -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"); do
    pids+=" $(docker top "$id" -eo pid | tail -n +2 | tr '\n' ' ')"
done
[ -n "${pids// /}" ] || fail "found no container processes to follow through down"
t0=$(now)
compose down >>"$out/compose.log" 2>&1 || fail "docker compose down failed (see $out/compose.log)"
figure "down s" "$(since "$t0")"
label=com.docker.compose.project=$COMPOSE_PROJECT_NAME
left_containers=$(docker ps -aq --filter "label=$label")
left_networks=$(docker network ls -q --filter "label=$label")
left_pids=""
for pid in $pids; do [ -d "/proc/$pid" ] && left_pids+=" $pid"; done  # kill -0 says no to others' PIDs
[ -z "$left_containers$left_networks$left_pids" ] ||
    fail "left behind by down: containers [$left_containers] networks [$left_networks] processes [$left_pids]"
log "down left no container, network or process ($(echo $pids | wc -w) container processes gone); the volumes stay: $(docker volume ls -q --filter "label=$label" | tr '\n' ' ')"

# -- figures -----------------------------------------------------------------------------------------
{
    echo "| figure (this machine: $(nproc) cores, $(python3 -c 'import os; print(round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30))') GiB) | value |"
    echo "|---|---|"
    for f in "${figures[@]}"; do echo "| ${f%%|*} | ${f#*|} |"; done
} | tee "$out/figures.md"
log "PASSED (report: $out)"
