# Sourced by .ci/run (bash): its stages' bookkeeping. Background jobs run in their own sessions (setsid),
# stopped if CI ends early; each is waited for (await), its log printed and its exit status checked. When
# CI ends early (a foreground stage failed, or a job awaited), the end of the log of every other
# background job that had already failed is printed first: a run once showed only the foreground's
# failure, and two lanes' exit statuses with no reason. Every stage's wall and CPU time (.ci/stage) goes
# into a table that ends the run, with the load average and the free disk.
export CI_STAGE_TIMES
CI_STAGE_TIMES=$(mktemp)
ci_start=$(date +%s)
bg_logs=$(mktemp -d)
bg_pids=()
bg_names=()
awaited=" "
free_gb() { df -Pk "$1" | awk 'NR == 2 {printf "%.1f", $4 / 1048576}'; }
disk_line() { echo "free disk: $(free_gb .) GB here ($(pwd)), $(free_gb "${TMPDIR:-/tmp}") GB in ${TMPDIR:-/tmp}"; }
stage_table() {
  echo "--- stage times (s; background stages overlap others; load average now $(cut -d' ' -f1-3 /proc/loadavg); $(disk_line)) ---"
  printf '%-16s %8s %8s %8s %s\n' stage wall user sys status
  while IFS=$'\t' read -r name wall user sys status; do
    printf '%-16s %8s %8s %8s %s\n' "$name" "$wall" "$user" "$sys" "$status"
  done <"$CI_STAGE_TIMES"
  echo "total: $(($(date +%s) - ci_start)) s wall"
}
ended() {  # ended PID: the job is gone, or a zombie not reaped yet
  local state
  state=$(ps -o stat= -p "$1" 2>/dev/null || true)
  [ -z "$state" ] || [ "${state:0:1}" = Z ]
}
failed_background() {  # on an early exit: the end of every log of a background job that failed and was not printed
  local i pid status
  for i in "${!bg_pids[@]}"; do
    pid=${bg_pids[$i]}
    case "$awaited" in *" ${bg_names[$i]} "*) continue ;; esac
    if ! ended "$pid"; then
      echo "--- background job ${bg_names[$i]}: still running, stopped ---"
      continue
    fi
    status=0
    wait "$pid" || status=$?
    if [ "$status" != 0 ]; then
      echo "--- background job ${bg_names[$i]} failed (exit status $status); the end of its log ---"
      tail -n 40 "$bg_logs/${bg_names[$i]}.log"
    fi
  done
}
stop_background() {
  local pid
  failed_background
  # the group; or, in the moment before setsid made one, the process itself
  for pid in "${bg_pids[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  stage_table
  rm -rf "$bg_logs" "$CI_STAGE_TIMES"
}
trap stop_background EXIT
background() {  # background NAME COMMAND...: .ci/stage NAME COMMAND in the background, output in $bg_logs/NAME.log
  local name=$1
  shift
  setsid .ci/stage "$name" "$@" >"$bg_logs/$name.log" 2>&1 </dev/null &
  bg_pids+=($!)
  bg_names+=("$name")
  eval "bg_pid_${name//-/_}=$!"
}
await() {  # await NAME: waits for the background job NAME, prints its log, fails CI if it failed
  local name=$1 var="bg_pid_${1//-/_}" status=0
  wait "${!var}" || status=$?
  awaited+="$name "
  echo "--- background job $name (exit status $status) ---"
  cat "$bg_logs/$name.log"
  if [ "$status" != 0 ]; then
    echo "FAILED: background job $name exited with status $status" >&2
    exit "$status"
  fi
}
ready() {  # ready NAME JOB: waits until the background job JOB has written $bg_logs/NAME.ready; fails CI if JOB ended first
  local name=$1 var="bg_pid_${2//-/_}"
  while [ ! -f "$bg_logs/$name.ready" ]; do
    if ended "${!var}" && [ ! -f "$bg_logs/$name.ready" ]; then
      await "$2"
      echo "FAILED: background job $2 ended without $name" >&2
      exit 1
    fi
    sleep 2
  done
}
