#!/usr/bin/env bash
# The reference engine and the vLLM connector's transfer path on a GPU: the bfloat16 KV, tensor-KV and
# paged-transfer tests on the device, a stored 16k-token prefix into device memory stage by stage
# (benchmarks/store_to_device.py), the connector's save / load of a 16k-token prompt between paged GPU
# caches (benchmarks/integrations_transfer.py --device cuda), then cold / store / local TTFT of a random-weight model of a real shape (benchmarks/random_model.py; no weights are
# downloaded) served by two engines that share a store directory (benchmarks/engine_store_ttft.py).
#
#   benchmarks/engine_gpu.sh OUT_DIR        (writes OUT_DIR/{store_to_device,connector_transfer,engine_gpu}.json)
#   DEVICE=cuda SHAPE=llama-3.1-8b LENGTHS=2048,8192,16384 TRIALS=3 are the defaults.
set -euo pipefail
out=${1:?usage: engine_gpu.sh OUT_DIR}
device=${DEVICE:-cuda}
shape=${SHAPE:-llama-3.1-8b}
lengths=${LENGTHS:-2048,8192,16384}
trials=${TRIALS:-3}
python=${PYTHON:-python3}
# Room in the store's write queue for several of the longest prompts' KV (a 16k-token prompt of an
# 8B model is 2 GiB), so no write-back is dropped while an earlier one is still being written.
export KVMESH_WRITE_QUEUE_MB=${KVMESH_WRITE_QUEUE_MB:-8192}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
# A failing test is reported (exit status) but does not stop the measurements after it.
tests_status=0
KVMESH_TEST_DEVICE=$device KVMESH_CACHE_DIR="$work/cache" "$python" -m pytest -q -p no:cacheprovider -c /dev/null --rootdir "$PWD" -o asyncio_mode=auto \
    tests/engine_model/test_engine_model_bf16.py tests/engine_model/test_engine_model_tensor_kv.py \
    tests/integrations/test_integrations_transfer.py || tests_status=$?
"$python" benchmarks/random_model.py --shape "$shape" --out "$work/$shape-random" --device "$device" \
    --max-model-len 32768
# The shared store directory goes to RAM (/dev/shm) when it has room for every trial's KV.
shared=/dev/shm
if [ "$(df --output=avail -k /dev/shm | tail -1)" -lt 40000000 ]; then shared=$work; fi
echo "shared store under $shared"
"$python" benchmarks/store_to_device.py --shape "$shape" --device "$device" --tokens 16384 --dir "$shared" \
    --json | tee "$out/store_to_device.json"
TMPDIR="$shared" KVMESH_CACHE_DIR="$work/cache" "$python" benchmarks/integrations_transfer.py --tokens 16384 --store shared \
    --device "$device" --trials 3 --json | tee "$out/connector_transfer.json"
"$python" benchmarks/engine_store_ttft.py --model "$work/$shape-random" --device "$device" --dtype bfloat16 \
    --prefix-len "$lengths" --trials "$trials" --shared-dir "$shared" --json | tee "$out/engine_gpu.json"
exit "$tests_status"
