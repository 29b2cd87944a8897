#!/usr/bin/env bash
# The submission check's GPU run, in one command, on an H200 machine with python3, torch (CUDA), triton, pytest and no
# network:
#
#     bash scripts/gpu/submission-check.sh        # writes to $OUT (else /tmp/hicache-submission-check)
#
#   1. install hicache and its plugins editable (--no-deps --no-build-isolation)
#   2. on CUDA: direct's unit tests (the worker's order under a held-back stream), and the kit's stream
#      cases (the new per-layer-event consumer case among them) for direct, kernel and jit
#   3. scripts/gpu/submission_check.py: the 32-layer x 128-page prefix load's host time per submission
#      setting (byte-checked), a CUDA graph of it, MLA loads at 4096/32768 tokens per batch setting,
#      64-token host times through the pool (kernel, jit, direct)
#   4. hicache bench --overlap, SGLang's order, both layouts, llama-8b and DeepSeek-V3 in both regimes,
#      auto with the committed H200 profile (auto) and without one (auto-rule)
# Files in $OUT: submission-check.log, submission-check.json, overlap-sglang.json/.png.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/steps.sh
begin_check submission-check "${HICACHE_CHECK_BUDGET:-420}"

step install 60 "$PY" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check \
  -e . -e plugins/direct -e plugins/kernel -e plugins/jit -e plugins/portable
# The kit through direct's worker for every call (its cases are small: under the default span they stay on the
# caller's thread), then the kit's stream cases for every implementation at the defaults.
step kit-worker 90 env HICACHE_TEST_DEVICE=cuda HICACHE_DIRECT_THREAD=1 HICACHE_DIRECT_THREAD_MIN=1 HICACHE_DIRECT_THREAD_MAX=0 \
  "$PY" -m pytest -q -p no:cacheprovider -n 8 plugins/direct/tests -k "submitter or layer_events or beside_compute or round_trip"
step tests 120 env HICACHE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider -n 8 \
  plugins/direct/tests plugins/kernel/tests/test_kernel_conformance.py plugins/jit/tests/test_jit_conformance.py \
  -k "submitter or descriptors or layer_events or beside_compute"
step submission 150 "$PY" scripts/gpu/submission_check.py --out "$OUT"
step overlap 240 env HICACHE_PROFILE="$PWD/benchmarks/results/calibrate-profile-h200.json" \
  "$PY" -m hicache_core.cli bench --overlap --quick --overlap-mode sglang \
  --layouts page_first_direct,layer_first --only direct.copy_engine,kernel.triton_uva,jit.one_layer \
  --out "$OUT" --name overlap-sglang
echo "================ summary ================" | tee -a "$LOG"
grep -E "^(prefix|graph|mla|64-token|\| )" "$LOG" | tail -n 80
printf '%s\n' "${results[@]}"
