#!/bin/bash
# The body of finetune.sbatch and finetune-cpu.sbatch, run in the job's batch shell (they exec it, so the signals
# Slurm sends that shell arrive here): srun starts one torchrun on each node of the job, and each torchrun starts
# NPROC_PER_NODE processes of `python -m helpers.finetune` with this script's arguments; they meet at a rendezvous on
# the job's first node.
#
# Stopping. Slurm asks before it kills. When it preempts or requeues the job (`scontrol requeue`), it sends SIGTERM
# to every process of the job, SIGKILL after a grace period (KillWait, 30 s by default), and puts the job back in
# the queue itself. With `#SBATCH --signal=B:USR1@120` it sends USR1 to this shell 120 s before the time limit; this
# script passes SIGTERM on to the processes (`scancel --signal=TERM`: srun itself would kill them) and requeues the
# job once they have stopped. (Without `B:`, USR1 goes to torchrun too, which does not handle it and dies.) Either
# way every process of helpers.finetune saves its next step into CHECKPOINT_DIR and exits with status 75
# (helpers.preemption); torchrun, which gives its workers 30 s after a SIGTERM, exits 1. A requeued job
# (SLURM_RESTART_COUNT > 0) runs the same command with --resume and continues from that checkpoint.
#
# From the environment: CHECKPOINT_DIR (default checkpoints/$SLURM_JOB_NAME: on storage every node sees),
# NPROC_PER_NODE (default: the node's GPUs, SLURM_GPUS_ON_NODE), RDZV_PORT (default 29500 + the job id mod 1000),
# PYTHON (default .venv/bin/python, relative to the folder the job runs in: the repository's, on shared storage).
set -euo pipefail

checkpoint_dir=${CHECKPOINT_DIR:-checkpoints/$SLURM_JOB_NAME}
nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:?"no GPU on this node: ask for some (--gpus-per-node) or set NPROC_PER_NODE"}}
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")  # one per line (no pipe into head: pipefail, SIGPIPE)
head_node=${nodes%%$'\n'*}
resume=()
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume); fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # torchrun's own default, set here so that it does not warn

command=(srun --ntasks-per-node=1 --kill-on-bad-exit=1
         "${PYTHON:-.venv/bin/python}" -m torch.distributed.run
         --nnodes="$SLURM_NNODES" --nproc_per_node="$nproc" --rdzv-backend=c10d
         --rdzv-endpoint="$head_node:${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}" --rdzv-id="$SLURM_JOB_ID"
         -m helpers.finetune --checkpoint-dir "$checkpoint_dir" "${resume[@]}" "$@")
echo "$(date '+%F %T') job $SLURM_JOB_ID, run $((${SLURM_RESTART_COUNT:-0} + 1)), on $SLURM_JOB_NODELIST: ${command[*]}"

stop= woke=
on_signal() {
  stop=$1 woke=1
  echo "$(date '+%F %T') $1: every process saves its next step into $checkpoint_dir and stops"
  if [ "$1" = USR1 ]; then scancel --signal=TERM "$SLURM_JOB_ID"; fi  # on TERM, Slurm signals them itself
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM
"${command[@]}" &
step=$!
# wait returns early, with 128 + the signal's number, when a trapped signal arrives; the step's own status is read
# by the next wait, whether it still runs or has ended meanwhile (127: ended as a signal came, its status read).
status= last=
while [ -z "$status" ]; do
  woke=
  wait "$step" && code=0 || code=$?
  if [ "$code" -eq 127 ] && [ -n "$last" ]; then code=$last; fi
  if [ -z "$woke" ]; then status=$code; fi
  last=$code
done
if [ "$stop" = USR1 ] && [ "$status" -ne 0 ]; then
  echo "$(date '+%F %T') requeued: the next run continues from $checkpoint_dir with --resume"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
