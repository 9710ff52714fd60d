# tcp delta threads on the device machine's 16 cores: the same binary, AWEX_TCP_DELTA_THREADS 4 then 8
set -u
nproc; uptime; date -u
for th in ${THREADS:-4 8}; do
  echo "== threads $th"; t0=$SECONDS
  AWEX_TCP_DELTA_THREADS=$th timeout 280 .gpu/awex-cli bench delta --model qwen3-0.6b --transport tcp --updates 3 --json > $OUT/th$th.json 2> $OUT/th$th.err
  echo "exit $? after $((SECONDS-t0)) s"
  python3 - $OUT/th$th.json <<'PY'
import json,sys
try: d=json.load(open(sys.argv[1]))
except Exception as e: print("unreadable", e); sys.exit()
print({k:d[k] for k in ("dense_bytes","time_ratio","bytes_ratio","floor_ms","verified")})
for m in d["modes"]: print(json.dumps({k:m[k] for k in ("deltas","update_ms","median_ms","received_bytes","density","training_part_ms","inference_part_ms")}))
PY
done
date -u
