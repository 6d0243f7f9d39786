#!/usr/bin/env bash
# Issue 21 on two H200s (device kind nvidia-h200-x2): P/D between the GPUs and real P/D goodput
# against two mixed workers. Not run yet: no two-GPU machine has been lent.
#   transfer  KV payload GB/s cuda:0 -> cuda:1, NIXL (UCX cuda_ipc/NVLink) vs CUDA IPC vs HTTP,
#             32 MiB-1 GiB (bench/transfer_payload.py, sender on cuda:0, decode worker on cuda:1)
#   calibrate a cost profile per GPU for the fast 8B worker (kvgate calibrate)
#   pd        1 prefill (cuda:0) + 1 decode (cuda:1) behind slo_goodput, `bench serve` sweep on the
#             mixed workload at TTFT/TPOT SLOs 1000/50 ms
#   mixed     the same sweep against 2 mixed workers (cuda:0, cuda:1) behind slo_goodput
#   simulate  the simulator's prediction for both fleets with the calibrated profile and the
#             measured NIXL link (compare within 15%)
# Prepare here as experiments/h200_nixl.sh says (.nixl from nixl_slim.py, .whl, .devcarry), then
# (device tool, repo root):  carry [".nixl", ".whl", ".devcarry"]
#   bash experiments/h200x2_pd.sh stage transfer calibrate      (first call)
#   bash experiments/h200x2_pd.sh pd mixed simulate             (second call, same warm machine)
# Results in $OUT: transfer_payload_h200x2.json, h200x2-llama8b.json (profile), serve-pd.json,
# serve-mixed.json, sim-pd.json, sim-mixed.json, run.log; copy them into bench/results/ and
# bench/profiles/, redraw the PNGs here (the device returns 8 files at most).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
ARGS=" $* "
want() { [[ "$ARGS" == *" $1 "* ]]; }
log() { tee -a "$OUT/run.log"; }
TOKEN=pd-bench-token
SLO="--slo-ttft-ms 1000 --slo-tpot-ms 50"
LOAD="--workload mixed --seed 21 --duration 30 --sweep 4,8,12,16,24,32"
if want stage; then
  rm -rf /tmp/nixl && cp -r .nixl /tmp/nixl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH=/tmp/nixl:/tmp/site:$PWD
[ -d /tmp/m8b ] || python3 -m bench.random_model --tokenizer-dir .devcarry --init-device cuda --layers 32 \
  --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 /tmp/m8b >/dev/null 2>&1

wait_up() {  # URL...
  python3 - "$@" <<'PY'
import sys, time, urllib.request as u
for url in sys.argv[1:]:
    for _ in range(300):
        try:
            u.urlopen(url + "/health", timeout=1)
            break
        except Exception:
            time.sleep(1)
PY
}
worker() {  # PORT DEVICE ROLE
  python3 -m gateway.cli worker --model /tmp/m8b --device "$2" --num-blocks 30000 --port "$1" --role "$3" \
    --internal-token $TOKEN --kv-transport nixl > "$OUT/worker-$1.log" 2>&1 &
}
gateway() {  # PORT URL...
  local port=$1; shift
  local ws=(); for u in "$@"; do ws+=(--worker "$u"); done
  python3 -m gateway.cli gateway --port "$port" --policy slo_goodput --internal-token $TOKEN $SLO \
    --model /tmp/m8b "${ws[@]}" > "$OUT/gateway-$port.log" 2>&1 &
}
stop_all() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }

if want transfer; then
  timeout 420 python3 -m bench.transfer_payload --tokenizer-dir .devcarry --device cuda:0 --decode-device cuda:1 \
    --kv-heads 8 --transports nixl,ipc,http --mib 32,128,512,1024 --repeats 3 \
    --out $OUT/transfer_payload_h200x2.json 2>&1 | grep -v "NIXL INFO" | log | tail -20
fi
if want calibrate; then
  worker 8201 cuda:0 mixed; wait_up http://127.0.0.1:8201
  timeout 300 python3 -m gateway.cli calibrate --url http://127.0.0.1:8201 --lengths 64,128,256,512,1024,2048,4096 \
    --batches 1,2,4,8,16,32,64,128,256 --decode-tokens 24 --rounds 2 --out $OUT/h200x2-llama8b.json 2>&1 | log | tail -3
  stop_all
fi
if want pd; then
  worker 8211 cuda:0 prefill; worker 8212 cuda:1 decode; wait_up http://127.0.0.1:8211 http://127.0.0.1:8212
  gateway 8210 http://127.0.0.1:8211 http://127.0.0.1:8212; wait_up http://127.0.0.1:8210
  timeout 280 python3 -m gateway.cli bench serve --url http://127.0.0.1:8210 $LOAD $SLO --out $OUT/serve-pd.json 2>&1 | log | tail -8
  stop_all
fi
if want mixed; then
  worker 8221 cuda:0 mixed; worker 8222 cuda:1 mixed; wait_up http://127.0.0.1:8221 http://127.0.0.1:8222
  gateway 8220 http://127.0.0.1:8221 http://127.0.0.1:8222; wait_up http://127.0.0.1:8220
  timeout 280 python3 -m gateway.cli bench serve --url http://127.0.0.1:8220 $LOAD $SLO --out $OUT/serve-mixed.json 2>&1 | log | tail -8
  stop_all
fi
if want simulate; then
  PROFILE=$OUT/h200x2-llama8b.json; [ -f "$PROFILE" ] || PROFILE=bench/profiles/h200-llama8b-kvgate.json
  LINK=""; [ -f $OUT/transfer_payload_h200x2.json ] && LINK="--transfer-profile $OUT/transfer_payload_h200x2.json"
  python3 -m gateway.cli simulate --workers 2 --roles prefill:1,decode:1 --policies slo_goodput $LOAD $SLO \
    --profile "$PROFILE" --kv-transport nixl $LINK --out $OUT/sim-pd.json 2>&1 | log | tail -4
  python3 -m gateway.cli simulate --workers 2 --policies slo_goodput $LOAD $SLO --profile "$PROFILE" \
    --out $OUT/sim-mixed.json 2>&1 | log | tail -4
fi
rm -f $OUT/*.png
