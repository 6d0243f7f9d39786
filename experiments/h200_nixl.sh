#!/usr/bin/env bash
# Issue 20 on one H200: KV payload GB/s for NIXL vs HTTP vs CUDA IPC, 32 MiB to 1 GiB, two
# processes sharing the GPU (a decode worker on cuda:0 and bench/transfer_payload.py's sender on
# cuda:0), plus the NIXL agent tests. Not run yet: the session that wrote it had no device time.
#
# Prepare here, once (repo root; these folders stay out of git):
#   printf '/.nixl/\n/.whl/\n/.devcarry/\n' >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d /tmp/nixlwhl nixl-cu12==1.5.1
#   python3 experiments/nixl_slim.py /tmp/nixlwhl/nixl_cu12-*.whl .nixl   # 68 MB wheel -> ~30 MiB
#   # UCX's CUDA memory hooks (libucm_cuda) dlopen libcudart.so.12, which the cu130 image lacks;
#   # without it UCX takes VRAM for host memory and registration fails (NIXL_ERR_BACKEND):
#   python3 -m pip download --no-deps --only-binary=:all: --platform manylinux2014_x86_64 -d /tmp/rt \
#       "nvidia-cuda-runtime-cu12==12.8.*" && unzip -j /tmp/rt/*.whl '*/libcudart.so.12' -d .nixl/nixl_cu12.libs
#   mkdir -p .devcarry && cp ~/.cache/kvgate/smollm2-135m/tokenizer* .devcarry/
#   .whl: kvgate's pure-Python needs the image lacks (starlette, uvicorn, httpx, httpcore, h11, anyio,
#   prometheus-client, opentelemetry-api/-sdk/-semantic-conventions, redis, msgpack, pyzmq ...),
#   downloaded as device/README.md says.
# libuct_cuda links only the driver (libcuda, libnvidia-ml), so the cu12 wheel runs beside the
# image's cu130 torch.
#
# Or compress it (7.4 MB; then one call carries it with the rest):
#   mkdir -p .nixlx && tar -C .nixl -cJf .nixlx/nixl.tar.xz . && echo /.nixlx/ >> .git/info/exclude
#   carry [".nixlx", ".whl", ".devcarry"]   bash experiments/h200_nixl.sh stage run
# Run (device tool, repo root). One call when `du -shc .nixl .whl .devcarry` plus the tracked tree
# stays under 64 MiB:    carry [".nixl", ".whl", ".devcarry"]   bash experiments/h200_nixl.sh stage run
# else two calls on the same warm machine (what a call stages under /tmp stays until it goes back):
#   carry [".nixl"]               bash experiments/h200_nixl.sh stage
#   carry [".whl", ".devcarry"]   bash experiments/h200_nixl.sh run
# Results: $OUT/transfer_payload_h200.{json,png}, $OUT/nixl_tests.log, $OUT/run.log; copy the JSON
# and PNG into bench/results/ and fit the simulator's links from it (bench/transfer_model.py).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
ARGS=" $* "
want() { [[ "$ARGS" == *" $1 "* ]]; }
if want stage; then
  rm -rf /tmp/nixl && mkdir -p /tmp/nixl
  if [ -f .nixlx/nixl.tar.xz ]; then tar -C /tmp/nixl -xJf .nixlx/nixl.tar.xz; else cp -r .nixl/. /tmp/nixl; fi
  du -sh /tmp/nixl
fi
if want run; then
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/nixl:/tmp/site:$PWD LD_LIBRARY_PATH=/tmp/nixl/nixl_cu12.libs:${LD_LIBRARY_PATH:-}
  python3 -c "import nixl_cu12, torch; print('nixl', nixl_cu12.__file__, 'torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee $OUT/run.log
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_nixl_agent.py > $OUT/nixl_tests.log 2>&1
  tail -3 $OUT/nixl_tests.log
  timeout 420 python3 -m bench.transfer_payload --tokenizer-dir .devcarry --device cuda --kv-heads 8 \
      --transports nixl,http,ipc --mib 32,128,512,1024 --repeats 3 --out $OUT/transfer_payload_h200.json \
      2>&1 | grep -v "NIXL INFO" | tee -a $OUT/run.log | tail -30
fi
