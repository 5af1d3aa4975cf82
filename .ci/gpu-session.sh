#!/usr/bin/env bash
# How the committed GPU reports were made: run on an air-gapped GPU node from the repo root, with wheels in .whl/
# (`moe-lab wheelhouse -o .whl --python 3.12`) and the node's own CUDA torch. Usage: bash .ci/gpu-session.sh OUTDIR [STEPS]
# STEPS: comma list of probe,probe-det,report:NN[+NN...],pytest,bench (default: probe,probe-det,report:01,pytest).
# Other megatron-core releases for notebook 03 come from .whl/releases (wheels or sdists; see `moe-lab versions`).
set -uo pipefail
OUT=${1:?output dir}; STEPS=${2:-probe,probe-det,report:01,pytest}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH JUPYTER_PATH=/tmp/site/share/jupyter
fi
export MOE_LAB_CACHE=${MOE_LAB_CACHE:-/tmp/moe_lab_cache}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$OUT/env.txt"
python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'megatron-core', m.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
SEED="--seed-report --dispatcher allgather,alltoall --router-dtype none,fp32,fp64 --json --timeout 600"
has probe && { time python3 -m moe_lab.cli probe --device cuda $SEED > "$OUT/probe.jsonl" 2> "$OUT/probe.log"; tail -3 "$OUT/probe.log"; }
has probe-det && { time python3 -m moe_lab.cli probe --device cuda $SEED --deterministic > "$OUT/probe_det.jsonl" 2>> "$OUT/probe.log"; tail -3 "$OUT/probe.log"; }
for step in ${STEPS//,/ }; do
  if [[ $step == report:* ]]; then
    only=${step#report:}; only=${only//+/,}
    time python3 -m moe_lab.cli run --profile gpu --only "$only" --out "$OUT/report" -p wheels="$PWD/.whl/releases" 2>&1 \
      | grep -v "Warning\|warn" | tail -5
  fi
done
has bench && python3 -m moe_lab.bench --device cuda --seed-report --repeats "${BENCH_REPEATS:-3}" \
  --json "$OUT/bench_gpu.json" 2>&1 | grep -v "warnings.warn(\|Warning: " | tee "$OUT/bench_gpu.txt" | tail -30
has pytest && python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -s 2>&1 | grep -v "warnings.warn(\|Warning: " \
  | tee "$OUT/pytest_gpu.log" | tail -15
exit 0
