#!/usr/bin/env bash
# The direct plugin's GPU check, in one command, for an H200 machine with python3,
# torch (CUDA), triton, numpy and matplotlib installed and no network:
#
#     bash scripts/gpu/direct-check.sh            # writes to $OUT (else /tmp/hicache-direct-check)
#
# Steps, each under its own time limit and all under one deadline (HICACHE_CHECK_DEADLINE, default
# 345 s), so the whole run ends inside 6 minutes; a step that fails or runs out of time is logged and
# the next one runs:
#   1. install hicache and its plugins editable (--no-deps --no-build-isolation)
#   2. the conformance kit and direct's unit tests on CUDA (HICACHE_TEST_DEVICE=cuda)
#   3. byte-exact checks of the batched path, every layout direct claims, plain/sharded/draft pools,
#      kv_split 2-D copies, every submission setting, side/legacy/behind-a-producer streams
#   4. compute-sanitizer memcheck over a short direct check, then kv_split's 2-D copies as one
#      cudaMemcpy3DBatchAsync (new, so in a process of its own; benched only if byte-exact)
#   5. hicache bench rows for direct, kernel and jit (llama-8b, deepseek-mla; 64, 4096, 32768 tokens)
#   6. hicache bench --overlap --quick (auto by the static rule, as on a machine with no profile)
#   7. hicache calibrate --quick, the profile auto reads, written to $OUT/profile.json
# then a compact table. Files in $OUT (at most 8): direct-check.log, direct-check.json,
# direct-bench.json/.png, overlap.json/.png, profile.json.
set -u
cd "$(dirname "$0")/../.."
source scripts/gpu/steps.sh
begin_check direct-check 345

step install 60 "$PY" -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check \
  -e . -e plugins/direct -e plugins/kernel -e plugins/jit
"$PY" -c "import torch, hicache_direct; from hicache_direct.memcpy import CudaCopier; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); \
print('direct submits with:', CudaCopier(torch.device('cuda')).path)" 2>&1 | tee -a "$LOG"
step conformance 60 env HICACHE_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  plugins/direct/tests tests/test_autoselect.py
step batched 60 "$PY" scripts/gpu/direct_check.py --out "$OUT"
if command -v compute-sanitizer >/dev/null 2>&1; then
  step memcheck 45 compute-sanitizer --tool memcheck --error-exitcode 9 "$PY" scripts/gpu/direct_check.py --memcheck
else
  results+=("memcheck: skipped (no compute-sanitizer on PATH)")
fi
# 2-D copies as one cudaMemcpy3DBatchAsync (off by default until this passes): in a process of its own.
step batched-2d 30 "$PY" scripts/gpu/direct_check.py --only-2d --out "$OUT"
bench_2d=0
[[ "${results[-1]}" == "batched-2d: ok"* ]] && bench_2d=1
step bench 80 env HICACHE_BENCH_BATCH_2D=$bench_2d "$PY" -m hicache_core.cli bench --quick --shapes llama-8b,deepseek-mla --tokens 64,4096,32768 \
  --layouts page_first_direct,layer_first,page_first_kv_split --only direct.copy_engine,kernel.triton_uva,jit.one_layer \
  --out "$OUT" --name direct-bench
# auto in the overlap run follows the static rule (no profile yet on a fresh machine): the bar is on the rule.
step overlap 80 "$PY" -m hicache_core.cli bench --overlap --quick --out "$OUT" --name overlap
step calibrate 50 "$PY" -m hicache_core.cli calibrate --quick --shapes llama-8b,deepseek-mla \
  --layouts page_first_direct,layer_first --tokens 64,4096,32768 --out "$OUT/profile.json"
rm -f "$OUT"/*.tmp

echo
echo "================ hicache direct check: summary ================" | tee -a "$LOG"
"$PY" scripts/gpu/direct_check.py --summary "$OUT" 2>&1 | tee -a "$LOG"
for r in "${results[@]}"; do echo "step $r"; done | tee -a "$LOG"
