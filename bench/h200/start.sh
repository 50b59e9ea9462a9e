#!/usr/bin/env bash
# On the GPU machine, from a call's working tree: joins the staged pieces, unpacks the corpora to
# /root/cases, copies this tree to /root/ff and starts one draft-training job there, detached
# (setsid), so it outlives the call. Its log is /root/res/NAME.log.
#
#   bash bench/h200/start.sh NAME [flashfleet draft train flags...]
#
# The knobs of bench/train_draft_h200.sh (GEN_MINUTES, TRAIN_MINUTES, BATCH, ...) pass through
# the environment (NPROC=2: data parallel over two GPUs; BENCH_AFTER=1: bench_after_train.sh
# benchmarks the saved draft on GPU 1 while rank 0 evaluates, or on GPU 0 after the job on a
# one-GPU machine). Wait for it with
# `pgrep -f "[j]ob_train.sh"` (a plain pattern would match the waiting call's own command line).
set -uo pipefail
NAME=${1:?usage: start.sh NAME [train flags...]}; shift
source .stage/join/join.sh
GGUF=/root/stage/files/$NAME.gguf
[ -f "$GGUF.ok" ] || { echo "start: $GGUF has not arrived"; exit 3; }
mkdir -p /root/cases /root/res
[ -f /root/cases/humaneval.jsonl ] || tar xzf /root/stage/files/.stage-cases.tgz -C /root/cases
# MLX's CUDA kernel cache from an earlier session (collect.sh packs it; carried and copied to
# /root/stage like the data): kernels found there skip NVRTC, so a fresh machine starts faster.
# Merged into whatever this machine compiled already (files are named by kernel).
if [ -f /root/stage/mlx-kernels.tgz ]; then
  tar xzf /root/stage/mlx-kernels.tgz -C /tmp && echo "start: MLX kernel cache, $(find /tmp/mlx -name '*.txt' | wc -l) modules"
fi
rm -rf /root/ff && mkdir -p /root/ff && tar cf - --exclude=./.stage . | tar xf - -C /root/ff
cd /root/ff
: > "/root/res/$NAME.log"  # before either job starts: the bench waiter must not read an old log
(setsid nohup bash bench/h200/job_train.sh "$NAME" "$GGUF" /root/cases /root/res "$@" \
  > "/root/res/$NAME.log" 2>&1 < /dev/null &)
if [ "${BENCH_AFTER:-0}" = 1 ]; then  # two GPUs: benchmark the saved draft on GPU 1 while GPU 0 evaluates
  if [ "$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)" -le 1 ]; then
    : "${BENCH_GPU:=0}" "${WAIT_FOR:=JOB DONE}"  # one GPU: after the whole job, on it
    export BENCH_GPU WAIT_FOR
  fi
  (setsid nohup bash bench/h200/bench_after_train.sh "/root/res/$NAME.log" "/root/models/$NAME" "/root/res/$NAME" \
    > /root/res/bench_after.log 2>&1 < /dev/null &)
fi
sleep 2
echo "start: $NAME job running (pid $(pgrep -f "[j]ob_train.sh $NAME" | head -1)), log /root/res/$NAME.log"
