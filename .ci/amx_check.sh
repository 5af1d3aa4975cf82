#!/usr/bin/env bash
# The CPU suite's tests that depend on the CPU's bf16 GEMM, for a host whose CPU has AMX (Xeon with amx_bf16): there
# oneDNN's bf16 GEMM is batch variant and these tests take their other branch (tests/README.md, "CPUs with AMX").
# CPU engines only. Usage, from the repository root:  .ci/amx_check.sh [extra pytest args]
#   PYTHON=/path/to/python  the interpreter with moe_lab installed (default: .venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_VISIBLE_DEVICES=""
PY="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"

echo "== $(hostname): $(nproc) cores; $("$PY" -c 'import sys, torch; print(f"python {sys.version.split()[0]}, torch {torch.__version__}")')"
"$PY" - <<'EOF'
import json
from moe_lab import provenance
c = provenance.cpu_info()
print("== cpu:", json.dumps(c))
if not any(f.startswith("amx") for f in c["isa"]):
    print("== NOTE: this CPU has no AMX flags: the tests below take the batch-invariant branch here")
EOF
SHAPES=(--shape 256,512 --shape 512,256 --ms 128,192,256,320,384,512,1024 --threads 1)  # the cpu profile's experts
echo "== bf16 GEMM batch variance, default:                  $("$PY" -m moe_lab.engine.kernels "${SHAPES[@]}")"
echo "== bf16 GEMM batch variance, ONEDNN_MAX_CPU_ISA pinned: $(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "$PY" -m moe_lab.engine.kernels "${SHAPES[@]}")"

exec "$PY" -m pytest -q -p no:cacheprovider -rA --timeout=1200 \
    tests/unit/test_kernels_unit.py \
    tests/unit/test_truncation_story_unit.py \
    tests/unit/test_provenance_unit.py \
    tests/unit/test_truncation_unit.py \
    tests/cluster/test_truncation.py \
    "tests/cluster/test_cluster.py::test_allgather_bf16_diverges_across_ranks_and_router_fp32_removes_it" \
    tests/cluster/test_compound.py \
    tests/cluster/test_scale.py \
    "tests/notebooks/test_notebooks.py::test_04_truncation_reproduced_explained_and_fixed_under_emulation" \
    "$@"
