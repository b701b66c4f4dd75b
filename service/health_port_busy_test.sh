#!/usr/bin/env bash
# A worker given a --health_address whose port is taken must exit non-zero naming that flag and
# address (it named --grpc_address's, which was free). Usage: health_port_busy_test.sh BINARY ARGS...
# A loopback port is held by a python listener for the run.
set -u
bin="$1"
shift
dir="$(mktemp -d)"
trap 'kill "$holder" 2>/dev/null; rm -rf "$dir"' EXIT
python3 -c '
import socket, sys, time
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(1)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
time.sleep(120)
' "$dir/port" &
holder=$!
for _ in $(seq 100); do [ -s "$dir/port" ] && break; sleep 0.1; done
port="$(cat "$dir/port")"
[ -n "$port" ] || { echo "FAIL: no busy port"; exit 1; }
"$bin" "$@" --health_address="127.0.0.1:$port" >"$dir/out" 2>&1
rc=$?
cat "$dir/out"
if [ "$rc" -eq 0 ]; then echo "FAIL: exited 0 with a busy health port"; exit 1; fi
if ! grep -qF -- "--health_address 127.0.0.1:$port: cannot listen" "$dir/out"; then
  echo "FAIL: the message does not name --health_address 127.0.0.1:$port"
  exit 1
fi
echo "PASS (exit $rc)"
