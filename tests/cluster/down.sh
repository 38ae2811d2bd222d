#!/usr/bin/env bash
# Stops what up.sh started in RUN_DIR, by the PIDs it recorded, and removes RUN_DIR.
set -u
run=${1:?usage: tests/cluster/down.sh RUN_DIR}
for component in kube-scheduler kube-controller-manager kube-apiserver etcd; do
  pidfile=$run/$component.pid
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
done
rm -rf "$run"
