# Shared by the scripts that check a live local cluster (tests/e2e/run_e2e.sh,
# deploy/checks/obs_live.sh). Source it after setting CHECKS_NAME (the log prefix), DEADLINE
# (end of the run's time budget, in $SECONDS), ROOT, WORK, RUN_DIR, KEEP, PROM_PID, RESULTS=()
# and FAILED=0. It installs the EXIT/INT/TERM traps.

budget() {  # budget N: N seconds, or what is left of the run's budget if less (at least 1)
  local left=$((DEADLINE - SECONDS))
  [ $left -lt 1 ] && left=1
  if [ "$1" -lt $left ]; then echo "$1"; else echo $left; fi
}

stop_pid() {  # stops one process this script started: TERM, up to 10 s, then KILL
  local pid=$1
  kill -0 "$pid" 2>/dev/null || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

# On exit: stops what the script started (Prometheus, the cluster), prints the summary, shows
# the logs on failure, removes the work folder on success unless --keep.
checks_cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$PROM_PID" ]; then stop_pid "$PROM_PID"; PROM_PID=""; fi
  if [ -f "$RUN_DIR/pids" ]; then
    RUN_DIR="$RUN_DIR" timeout 60 bash "$ROOT/tools/cluster.sh" stop >/dev/null 2>&1 ||
      echo "$CHECKS_NAME: WARNING: tools/cluster.sh stop failed; PIDs in $RUN_DIR/pids" >&2
  fi
  if [ ${#RESULTS[@]} -gt 0 ]; then
    echo "$CHECKS_NAME: summary"
    printf '  %s\n' "${RESULTS[@]}"
  fi
  if [ $rc -ne 0 ] || [ $FAILED -ne 0 ]; then
    for f in "$RUN_DIR"/*.log "$WORK/prometheus.log"; do
      [ -s "$f" ] || continue
      echo "---- last lines of $f ----"
      tail -n 25 "$f"
    done
    echo "$CHECKS_NAME: FAILED ($FAILED check(s) failed, exit $([ $rc -ne 0 ] && echo $rc || echo 1)); logs kept in $WORK" >&2
    [ $rc -ne 0 ] || rc=1
  elif [ "$KEEP" -eq 1 ]; then
    echo "$CHECKS_NAME: PASSED; kept $WORK"
  else
    rm -rf "$WORK"
    echo "$CHECKS_NAME: PASSED"
  fi
  exit $rc
}
trap checks_cleanup EXIT
trap 'echo "$CHECKS_NAME: interrupted" >&2; exit 130' INT TERM

# Runs one named check (a command or shell function); records ok/FAIL; never aborts the script.
run_check() {
  local name=$1; shift
  echo "$CHECKS_NAME: ---- $name"
  if [ $SECONDS -ge $DEADLINE ]; then
    RESULTS+=("FAIL  $name (not run: the run's time budget is spent)")
    FAILED=$((FAILED + 1))
    return
  fi
  if "$@"; then
    RESULTS+=("ok    $name")
  else
    RESULTS+=("FAIL  $name")
    FAILED=$((FAILED + 1))
    echo "$CHECKS_NAME: FAIL: $name" >&2
  fi
}
