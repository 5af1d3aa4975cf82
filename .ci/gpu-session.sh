#!/usr/bin/env bash
# How the GPU reports and logs are made: run on an air-gapped GPU node from the repo root, with wheels in .whl/
# (`moe-lab wheelhouse -o .whl --python 3.12`, minus what the node has, and minus debugpy and jedi — ipykernel and
# IPython import them only if present: 10 MB the 64 MiB working-tree limit needs) and the node's own CUDA torch.
# The device tool copies the whole working tree and refuses more than 64 MiB with the carry: since the committed
# reports passed ~60 MB (2026-12-02), move aside the report folders a call does not continue (e.g. all of reports/
# for pytest: `mv reports /tmp/r && mkdir reports`, back after) and carry only the wheels the node lacks (~11 MB).
# Usage: bash .ci/gpu-session.sh OUTDIR [STEPS]
# STEPS: comma list of pytest (-m gpu), pytest-multi (-m multigpu), probe, presets (every model preset),
#        report:NN[+NN...], bench, capture
#        (default: pytest,probe). Other megatron-core releases for notebook 03 come from .whl/releases.
# REPORT_DIR: where report steps write (default OUTDIR/report; a report folder of the tree continues it);
# it is packed into OUTDIR/report.tgz.0, .1, ... at the end. REPORT_TIMEOUT / REPORT_UNTIL: see the report step. MOE_LAB_COMMIT: the commit of the tree.
set -uo pipefail
OUT=${1:?output dir}; STEPS=${2:-pytest,probe}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH JUPYTER_PATH=/tmp/site/share/jupyter
fi
export MOE_LAB_CACHE=${MOE_LAB_CACHE:-/tmp/moe_lab_cache} MOE_LAB_RELEASES=$PWD/.whl/releases
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.txt"
# pip compiles what it installs; this node's torch ships no bytecode and PYTHONDONTWRITEBYTECODE is set, so every
# process compiled torch again (moe_lab/bytecode.py). Where the lab's bytecode tree applies, fill it here once, as a
# pip install would have: set-up, not the commands' time. BYTECODE_FILL=0 leaves it to the first command.
if [[ ${BYTECODE_FILL:-1} == 1 ]]; then
  python3 -c "from moe_lab import bytecode; f = bytecode.fill(); f and print(f'bytecode tree filled in {f[\"seconds\"]} s (set-up): {f[\"folder\"]}')" \
    2>&1 | tee -a "$OUT/env.txt"
fi
# After the fill, so that this import reads the tree's bytecode rather than compiling torch once more (~10 s there).
tree="$MOE_LAB_CACHE/bytecode"; [[ -d $tree ]] || tree=""
PYTHONPYCACHEPREFIX=${tree:-${PYTHONPYCACHEPREFIX:-}} python3 -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'megatron-core', m.__version__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
quiet() { grep -v "warnings.warn(\|Warning: \|UserWarning\|DeprecationWarning"; }
has pytest && { python3 -m pytest -m gpu ${PYTEST_FILES:-tests/gpu} -q -p no:cacheprovider -s --timeout=900 2>&1 | quiet \
  | tee "$OUT/pytest_gpu.log" | tail -25; }
has pytest-multi && { python3 -m pytest -m multigpu tests/gpu -q -p no:cacheprovider -s 2>&1 | quiet \
  | tee "$OUT/pytest_multigpu.log" | tail -15; }
REPORT_DIR=${REPORT_DIR:-$OUT/report}
SEED="--seed-report --dispatcher allgather,alltoall --router-dtype none,fp32,fp64 --json --timeout 600"
if has probe; then
  start=$EPOCHREALTIME
  python3 -m moe_lab.cli probe --device cuda ${PROBE_ARGS:---engines 4} $SEED > "$OUT/probe.jsonl" 2> "$OUT/probe.log"
  rc=$?
  awk "BEGIN {printf \"probe rc=$rc wall %.1f s (cluster start included)\n\", $EPOCHREALTIME - $start}" | tee -a "$OUT/probe.log"
  tail -3 "$OUT/probe.log"
fi
if has presets; then  # every model preset's layer (moe_lab/models.py), full size, one cluster, virtual EP=4
  MODELS=${MODELS:-mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b,deepseek-v3,moonlight-16b-a3b,gpt-oss-20b}
  for m in ${MODELS//,/ }; do python3 -m moe_lab.cli preflight --model $m --layout ep4 --gpus 1 --seq 1024 \
    --dispatcher allgather,alltoall --router-dtype none,fp32 --gpu-memory 139; done > "$OUT/preflight.txt" 2>&1
  start=$EPOCHREALTIME
  python3 -m moe_lab.cli probe --device cuda --engines 4 --model "$MODELS" --seq 1024 --dispatcher allgather,alltoall \
    --router-dtype none,fp32 --trials ${PRESET_TRIALS:-3} --json --timeout 600 > "$OUT/presets.jsonl" 2> "$OUT/presets.log"
  rc=$?
  awk "BEGIN {printf \"presets rc=$rc wall %.1f s (cluster start included)\n\", $EPOCHREALTIME - $start}" | tee -a "$OUT/presets.log"
  tail -3 "$OUT/presets.log"
fi
for step in ${STEPS//,/ }; do
  if [[ $step == report:* ]]; then
    only=${step#report:}; only=${only//+/,}
    start=$(date +%s)
    wheels=(); [[ -d .whl/releases ]] && wheels=(-p wheels="$PWD/.whl/releases")
    # REPORT_TIMEOUT: seconds before the run is interrupted as Ctrl-C would (it keeps what finished, and its index);
    # REPORT_UNTIL (epoch seconds) instead: interrupted then, whatever the set-up took.
    limit=${REPORT_TIMEOUT:-0}; [[ -n ${REPORT_UNTIL:-} ]] && limit=$(( REPORT_UNTIL - $(date +%s) ))
    timeout --signal=INT --kill-after=30 "$limit" python3 -m moe_lab.cli run --profile gpu --only "$only" \
      --out "$REPORT_DIR" "${wheels[@]}" ${REPORT_ARGS:-} 2>&1 | quiet > "$OUT/report-${only//,/-}.log"
    tail -8 "$OUT/report-${only//,/-}.log"
    echo "report $only: $(( $(date +%s) - start )) s" | tee -a "$OUT/report-${only//,/-}.log"
    python3 -m moe_lab.cli timing "$REPORT_DIR" > "$OUT/timing-${only//,/-}.md" 2>&1  # where its time went
  fi
done
has bench && python3 -m moe_lab.cli bench --device cuda --seed-report --engines 4 --repeats "${BENCH_REPEATS:-1}" \
  --json "$OUT/bench_gpu.json" 2>&1 | quiet | tee "$OUT/bench_gpu.txt" | tail -30
has capture && python3 -m moe_lab.cli bench --device cuda --seed-report --engines 4 --capture-only "${CAPTURE_ROUNDS:-40}" \
  --json "$OUT/capture_gpu.json" 2>&1 | quiet | tee "$OUT/capture_gpu.txt" | tail -8
# packed in parts of at most 15 MiB (the device tool brings back files of at most 16 MiB): cat report.tgz.* | tar xz
[[ -d $REPORT_DIR ]] && tar czf - -C "$(dirname "$REPORT_DIR")" "$(basename "$REPORT_DIR")" \
  | split -b 15M -d -a 1 - "$OUT/report.tgz."
exit 0
