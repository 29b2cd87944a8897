#!/usr/bin/env bash
# The kernel plugins' GPU run, in one command, on an H200 machine with python3, torch (CUDA), triton, ninja and
# nvcc, and no network:
#
#     bash scripts/gpu/kernel-check.sh            # writes to $OUT (else /tmp/hicache-kernel-check)
#
#   1. install hicache and its plugins editable (--no-deps --no-build-isolation)
#   2. build SGLang's transfer.cu (carried in .anchor-src/, see benchmarks/sgl_anchor) as the anchor
#   3. the kernel and jit plugins' tests and the bench helpers' tests on CUDA (the launch path changed)
#   4. hicache bench on MLA and llama-8b, layer_first and page_first, 64/4096/32768 tokens, for kernel,
#      jit and direct, with SGLang's kernels beside them, both clocks, and the copy and SM ceilings
#   5. a compact table (scripts/gpu/kernel_table.py)
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/steps.sh
begin_check kernel-check 540

step install 60 "$PY" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check \
  -e . -e plugins/direct -e plugins/kernel -e plugins/jit
anchor_env=()
if [[ -f .anchor-src/transfer.cu ]]; then
  step anchor-build 240 "$PY" benchmarks/sgl_anchor/build.py --src .anchor-src --out /tmp/sgl_anchor
  [[ "${results[-1]}" == "anchor-build: ok"* ]] && anchor_env=(PYTHONPATH=/tmp/sgl_anchor HICACHE_BENCH_ANCHOR=sgl_transfer_anchor)
else
  results+=("anchor-build: skipped (no .anchor-src/transfer.cu carried)")
fi
step tests 150 env HICACHE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -x -n 8 \
  tests/test_bench_ceilings.py tests/test_trust.py tests/test_bad_input.py plugins/kernel/tests plugins/jit/tests
step bench 330 env "${anchor_env[@]}" "$PY" -m hicache_core.cli bench --shapes deepseek-mla,llama-8b \
  --tokens 64,4096,32768 --layouts layer_first,page_first \
  --only kernel.triton_uva,jit.one_layer,direct.copy_engine --out "$OUT" --name kernel-bench
"$PY" scripts/gpu/kernel_table.py "$OUT/kernel-bench.json" 2>&1 | tee -a "$LOG" | tail -n 60
printf '%s\n' "${results[@]}"
