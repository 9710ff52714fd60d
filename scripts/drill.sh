#!/usr/bin/env bash
# Fault drills on the CPU demo, as an operator would run them: kill a training rank, stop and
# continue a rank, kill -9 and restart the gateway mid-update, flood the gateway with idle
# connections. Prints one line per drill: `held` or `FAILED`, with the evidence (exit codes,
# versions, reasons). Exits 0 only when every drill held.
#
#   scripts/drill.sh            # uses target/debug/awex-cli (cargo build -p awex-cli)
#   AWEX_CLI=path/to/awex-cli scripts/drill.sh
#
# The pair: qwen3-tiny, one Megatron training rank, two SGLang engines of one rank each, tcp;
# each drill connects its own pair on its own gateway (state under a temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
CLI=${AWEX_CLI:-target/debug/awex-cli}
[ -x "$CLI" ] || { echo "no $CLI: cargo build -p awex-cli first (or set AWEX_CLI)" >&2; exit 2; }
CLI=$(cd "$(dirname "$CLI")" && pwd)/$(basename "$CLI")
WORK=$(mktemp -d /tmp/awex-drill.XXXXXX)
MODEL=qwen3-tiny TRAIN=megatron:tp=1 INFER=sglang:tp=1,engines=2 TRANSPORT=tcp
PIDS=()
FAILED=0

cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

say() { # verdict drill evidence...
  local v=$1 d=$2; shift 2
  printf '%-6s %-34s %s\n' "$v" "$d" "$*"
  [ "$v" = held ] || FAILED=1
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# gateway PORT STATE_DIR LOG: starts `awex-cli serve` with a 1,024 descriptor limit; sets GW_PID
gateway() {
  ( ulimit -n 1024; exec "$CLI" serve --bind "127.0.0.1:$1" --state-dir "$2" ) >>"$3" 2>&1 &
  GW_PID=$!
  PIDS+=("$GW_PID")
  for _ in $(seq 100); do
    curl -sf -m 1 "http://127.0.0.1:$1/healthz" >/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# workers URL PAIR DIR: one training and two inference worker processes; sets W_PIDS
workers() {
  W_PIDS=()
  local common=(--gateway "$1" --pair "$2" --model "$MODEL" --train "$TRAIN" --infer "$INFER"
    --transport "$TRANSPORT" --bucket-mib 1)
  "$CLI" worker "${common[@]}" --side train --rank 0 >"$3/train0.log" 2>&1 &
  W_PIDS+=($!)
  for e in 0 1; do
    "$CLI" worker "${common[@]}" --side infer --engine "$e" --rank 0 >"$3/infer$e.log" 2>&1 &
    W_PIDS+=($!)
  done
  PIDS+=("${W_PIDS[@]}")
}

pair() { "$CLI" pair --gateway "$URL" "$@"; }

connect() { # NAME UPDATE_DEADLINE_S
  pair connect --name "$1" --model "$MODEL" --train "$TRAIN" --infer "$INFER" \
    --transport "$TRANSPORT" --bucket-mib 1 --update-deadline-s "$2" --join-deadline-s 60 >/dev/null
}

wait_ready() { # NAME
  for _ in $(seq 300); do
    [ "$(pair status --name "$1" --json 2>/dev/null | jq -r .state 2>/dev/null)" = ready ] && return 0
    sleep 0.2
  done
  return 1
}

update() { # NAME VERSION -> prints the update's state (committed/failed/...)
  pair update --name "$1" --version "$2" --wait --timeout-s 60 --json 2>/dev/null | jq -r .state
}

update_error() { # NAME VERSION
  curl -s -m 5 "$URL/v1/pairs/$1/updates/$2?ranks=none" | jq -r '.error // ""'
}

# finish NAME: disconnects the pair and collects the workers' exit codes into CODES
finish() {
  pair disconnect --name "$1" >/dev/null 2>&1
  CODES=""
  for p in "${W_PIDS[@]}"; do
    local c=124
    for _ in $(seq 150); do
      if ! kill -0 "$p" 2>/dev/null; then wait "$p"; c=$?; break; fi
      sleep 0.2
    done
    [ "$c" = 124 ] && kill -9 "$p" 2>/dev/null
    CODES="$CODES$c "
  done
  CODES=${CODES% }
}

setup() { # DRILL UPDATE_DEADLINE_S: a gateway, a pair, its workers, ready
  D=$WORK/$1
  mkdir -p "$D"
  PORT=$(free_port)
  URL=http://127.0.0.1:$PORT
  gateway "$PORT" "$D/state" "$D/gw.log" || { say FAILED "$1" "the gateway did not start: $(tail -2 "$D/gw.log")"; return 1; }
  connect "$1" "$2" || { say FAILED "$1" "connect failed"; return 1; }
  workers "$URL" "$1" "$D"
  wait_ready "$1" || { say FAILED "$1" "the ranks did not join"; return 1; }
}

command -v jq >/dev/null || { echo "drill.sh needs jq" >&2; exit 2; }
START=$(date +%s)

# 1. kill a training rank during an update: the demo SIGKILLs it, the version fails, the rank
#    is restarted and the retry commits
D=$WORK/kill-rank; mkdir -p "$D"
"$CLI" demo --model "$MODEL" --train megatron:tp=2 --infer sglang:tp=1,engines=2 --transport tcp \
  --bucket-mib 1 --fault-kill-train-rank 1 --fault-version 2 --deadline-s 5 --json \
  >"$D/demo.json" 2>"$D/demo.log"
code=$?
ev=$(jq -c '[.updates[] | "v\(.version)/\(.attempts // 1):\(if .verified then "ok" else "failed" end)"]' "$D/demo.json" 2>/dev/null)
if [ "$code" = 0 ] && [ "$(jq -r .verified "$D/demo.json" 2>/dev/null)" = true ]; then
  say held kill-training-rank "demo exit 0, updates $ev"
else
  say FAILED kill-training-rank "demo exit $code, updates ${ev:-none}: $(tail -2 "$D/demo.log")"
fi

# 2. SIGSTOP an inference rank, start an update, SIGCONT it after the deadline: the version
#    fails naming the stopped rank, the rank catches up without running the dead attempt, and
#    the retry commits
if setup stop-cont 4; then
  s1=$(update stop-cont 1)
  kill -STOP "${W_PIDS[1]}"
  s2=$(update stop-cont 2)
  why=$(update_error stop-cont 2)
  kill -CONT "${W_PIDS[1]}"
  s3=$(update stop-cont 2)
  finish stop-cont
  if [ "$s1/$s2/$s3" = committed/failed/committed ] && [ "$CODES" = "0 0 0" ] && [[ $why == *"inference rank 0/0"* ]]; then
    say held sigstop-sigcont-rank "v1 $s1, v2 $s2 (${why:0:90}...), v2 retry $s3; worker exits $CODES"
  else
    say FAILED sigstop-sigcont-rank "v1 $s1, v2 $s2 ($why), v2 retry $s3; worker exits $CODES"
  fi
fi

# 3. kill -9 the gateway mid-update (a rank stopped so that the update stays in flight) and
#    start it again on its state directory: the version fails with the restart as its reason,
#    the ranks retry and re-attach, the retry commits, the committed version is kept
if setup gateway-restart 20; then
  s1=$(update gateway-restart 1)
  kill -STOP "${W_PIDS[2]}"
  pair update --name gateway-restart --version 2 >/dev/null 2>&1
  sleep 0.5
  kill -9 "$GW_PID"; wait "$GW_PID" 2>/dev/null
  sleep 2
  gateway "$PORT" "$D/state" "$D/gw.log"
  kill -CONT "${W_PIDS[2]}"
  st=$(curl -s -m 5 "$URL/v1/pairs/gateway-restart/updates/2?ranks=none" | jq -r .state)
  why=$(update_error gateway-restart 2)
  serving=$(pair status --name gateway-restart --json 2>/dev/null | jq -r .serving_version)
  s3=$(update gateway-restart 2)
  retries=$(cat "$D"/train0.log "$D"/infer*.log | grep -c "retrying in")
  finish gateway-restart
  if [ "$s1/$st/$s3" = committed/failed/committed ] && [ "$serving" = 1 ] && [ "$CODES" = "0 0 0" ] \
    && [ "$why" = "version 2 attempt 1 failed: gateway restarted during update 2" ]; then
    say held kill-9-restart-gateway "v1 $s1; after restart v2 $st (\"$why\"), serving 1; v2 retry $s3; $retries rank retries logged; worker exits $CODES"
  else
    say FAILED kill-9-restart-gateway "v1 $s1; after restart v2 $st ($why), serving $serving; v2 retry $s3; worker exits $CODES"
  fi
fi

# 4. flood the gateway with 1,100 idle connections (its descriptor limit is 1,024): health
#    and the API answer again within the header timeout, and an update commits
if setup flood 20; then
  s1=$(update flood 1)
  python3 - "$PORT" >"$D/flood.log" 2>&1 <<'EOF' &
import socket, sys, time
socks = []
for _ in range(1100):
    try:
        socks.append(socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2))
    except OSError as e:
        print("connect failed:", e)
        break
print("open:", len(socks), flush=True)
time.sleep(30)
EOF
  FLOOD=$!
  PIDS+=("$FLOOD")
  sleep 2
  t0=$(date +%s.%N)
  health=000
  for _ in $(seq 30); do
    health=$(curl -s -o /dev/null -w '%{http_code}' -m 2 "$URL/healthz")
    [ "$health" = 200 ] && break
    sleep 0.5
  done
  took=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
  s2=$(update flood 2)
  kill "$FLOOD" 2>/dev/null; wait "$FLOOD" 2>/dev/null
  opened=$(grep -o 'open: [0-9]*' "$D/flood.log" | cut -d' ' -f2)
  finish flood
  if [ "$health" = 200 ] && [ "$s1/$s2" = committed/committed ] && [ "$CODES" = "0 0 0" ]; then
    say held idle-connection-flood "${opened:-?} idle connections; /healthz 200 after ${took} s; v1 $s1, v2 $s2 during the flood; worker exits $CODES"
  else
    say FAILED idle-connection-flood "${opened:-?} idle connections; /healthz $health after ${took} s; v1 $s1, v2 $s2; worker exits $CODES"
  fi
fi

echo "drills done in $(( $(date +%s) - START )) s"
exit "$FAILED"
