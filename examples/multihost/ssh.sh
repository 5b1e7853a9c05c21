#!/bin/bash
# shardlm on plain hosts over ssh: one process per host, each using all its GPUs; the first host serves the
# coordinator. Run it from a machine that can ssh to every host. The run directory and the data must be on a
# filesystem every host mounts at the same path (shardlm stops with a one-line error if they are not).
#
#   HOSTS="gpu-a gpu-b" examples/multihost/ssh.sh model=gpt2-small data.path=/shared/data/tinystories mesh.data=2
#
# Ctrl-C here sends SIGTERM to the process on the first host: all processes stop after the same step, save it, and
# exit 0 (run the script again to resume). A host that dies stops the others within the heartbeat timeout (30 s).
set -euo pipefail
read -r -a hosts <<< "${HOSTS:?set HOSTS to the host names; the first one serves the coordinator}"
PORT=${PORT:-8476}
RUN_DIR=${RUN_DIR:-/shared/runs/ssh-run}
pids=()
for i in "${!hosts[@]}"; do
  ssh "${hosts[$i]}" shardlm train --run-dir "$RUN_DIR" --no-progress \
      --coordinator "${hosts[0]}:$PORT" --num-processes "${#hosts[@]}" --process-id "$i" "$@" \
      > "ssh-process-$i.log" 2>&1 &
  pids+=($!)
done
trap 'ssh "${hosts[0]}" pkill -TERM -f "shardlm train --run-dir $RUN_DIR"' INT TERM
status=0
for i in "${!pids[@]}"; do
  code=0
  wait "${pids[$i]}" || code=$?
  if [ "$code" -ne 0 ]; then
    echo "process $i (${hosts[$i]}) exited with $code; see ssh-process-$i.log"
    status=$code
  fi
done
exit $status
