# shellcheck shell=bash
# The step runner of the GPU check scripts (sourced from the repository root): each step under its own
# time limit and all under one deadline ($deadline, epoch seconds), logged to $LOG, its outcome appended
# to the array results.

begin_check() {  # begin_check NAME DEFAULT_DEADLINE_S: $OUT (default /tmp/hicache-NAME), $LOG, $PY, $deadline
  OUT=${OUT:-/tmp/hicache-$1}
  mkdir -p "$OUT"
  LOG="$OUT/$1.log"
  : >"$LOG"
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  PY=${PYTHON:-python3}
  local asked  # HICACHE_CHECK_DEADLINE, read through hicache's settings (a bad value ends the check, named)
  asked=$("$PY" -m hicache_core.settings.registry HICACHE_CHECK_DEADLINE) || exit 1
  deadline=$(( $(date +%s) + ${asked:-$2} ))
  results=()
}

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  local left=$(( deadline - $(date +%s) ))
  if (( left < 10 )); then
    results+=("$name: skipped (deadline)")
    echo "=== $name: skipped, the deadline is near" | tee -a "$LOG"
    return
  fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  local t0=$(date +%s)
  timeout --signal=TERM --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t0 ))
  local what="rc $rc"
  (( rc == 124 || rc == 137 )) && what="TIMED OUT"
  (( rc == 0 )) && what="ok"
  results+=("$name: $what (${took}s)")
  echo "=== $name: $what in ${took}s" | tee -a "$LOG"
  tail -n 6 "$LOG" | sed 's/^/    /'
}

