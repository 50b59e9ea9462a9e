#!/usr/bin/env bash
# On a two-GPU machine, while rank 0 of a data-parallel training job evaluates tau, GPU 1 is free:
# this waits for the job's log to show the saved draft, then benchmarks it on that GPU against
# plain decoding (and the drafts in EXTRA_DRAFTS) with bench/bench_dflash.py (with --fuse: ours
# again on a target with fused projections, worker/fusion.py; FUSE=0 leaves it out; with --compile,
# COMPILE=0 leaves it out: the fused rows again through the compiled forward, and "adapt compiled",
# the worker's default path; ONLY="A B" passes --only A B). Output:
# RES/bench/dflash_q15.txt and .json. Meant to run detached (start.sh BENCH_AFTER=1, which on a
# one-GPU machine sets BENCH_GPU=0 WAIT_FOR="JOB DONE": the benchmark then waits for the whole job,
# so it does not share the GPU with the evaluation).
#
#   bash bench/h200/bench_after_train.sh LOG TARGET_DIR DRAFT_DIR
set -uo pipefail
LOG=$1; TARGET=$2; DRAFT=$3
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${RES:-/root/res}/bench; mkdir -p "$O"
# Run by hand from a later call, join.sh's PYTHONPATH is not set: the staged wheels are in /tmp/site.
[ -d /tmp/site/mlx ] && case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH};; esac
# GPU 1 on a two-GPU machine (GPU 0 evaluates), else the only one.
[ -n "${BENCH_GPU:-}" ] || { [ "$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)" -ge 2 ] && BENCH_GPU=1 || BENCH_GPU=0; }
WAIT_FOR=${WAIT_FOR:-saved: }
# Waiting for the whole job has no deadline: it must never overlap the job's evaluation.
[ "$WAIT_FOR" = "JOB DONE" ] && WAIT_S=${WAIT_S:-1000000}
deadline=$((SECONDS + ${WAIT_S:-3600}))
until grep -q "$WAIT_FOR" "$LOG" 2>/dev/null; do
  if grep -q "JOB DONE\|JOB FAILED" "$LOG" 2>/dev/null || ! pgrep -f "[j]ob_train.sh" >/dev/null \
     || [ $SECONDS -ge $deadline ]; then
    break
  fi
  sleep 5
done
if ! grep -q "saved: " "$LOG" 2>/dev/null; then
  echo "bench: the job ended (or WAIT_S passed) without a saved draft" > "$O/dflash_q15.txt"; exit 1
fi
drafts=("$DRAFT"); for d in ${EXTRA_DRAFTS:-}; do [ -f "$d/config.json" ] && drafts+=("$d"); done
echo "+ bench on GPU $BENCH_GPU from $(date -u +%T)" > "$O/dflash_q15.txt"
CUDA_VISIBLE_DEVICES=$BENCH_GPU PYTHONUNBUFFERED=1 timeout "${BENCH_S:-420}" python3 bench/bench_dflash.py \
  --target "$TARGET" --dflash-draft "${drafts[@]}" --max-tokens "${MAX_TOKENS:-128}" --prompts "${PROMPTS:-2}" \
  --cases "${CASES:-/root/cases}" --rounds "${ROUNDS:-1}" --json-out "$O/dflash_q15.json" --adaptive ${POLICY:+--policy $POLICY} $( [ "${FUSE:-1}" = 1 ] && echo --fuse ) \
  $( [ "${FUSE:-1}" = 1 ] && [ "${COMPILE:-1}" = 1 ] && echo --compile ) ${ONLY:+--only $ONLY} 2>&1 | grep -v " done$" >> "$O/dflash_q15.txt"
rc=${PIPESTATUS[0]}
# What a verify's masks and taps cost, side by side (forward_queue.txt; FORWARD_QUEUE=0 skips it):
# the cycle's verify runs over the padded cache with an additive mask; padded-bool is the boolean
# mask before it, mlx mlx-lm's own cache.
if [ "${FORWARD_QUEUE:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=$BENCH_GPU timeout "${FORWARD_QUEUE_S:-120}" python3 bench/bench_forward_queue.py \
    --target "$TARGET" --blocks 1 16 --caches mlx padded padded-bool --taps "${TAPS:-4}" --rounds 3 \
    --json-out "$O/forward_queue.json" > "$O/forward_queue.txt" 2>&1
  # The same verify with MLX's cuDNN attention off (its fallback: matmul, softmax, matmul), right
  # after (NOCUDNN=1; sessions 12 and 13 found no difference their noise resolved).
  [ "${NOCUDNN:-0}" = 1 ] && CUDA_VISIBLE_DEVICES=$BENCH_GPU MLX_CUDA_USE_CUDNN_SDPA=0 timeout "${FORWARD_QUEUE_S:-120}" python3 \
    bench/bench_forward_queue.py --target "$TARGET" --blocks 16 --caches padded padded-bool \
    --taps "${TAPS:-4}" --rounds 3 --json-out "$O/forward_queue_nocudnn.json" > "$O/forward_queue_nocudnn.txt" 2>&1
  # The operations a cycle's pieces put in the graph on this device (graph_ops.txt, a few seconds).
  CUDA_VISIBLE_DEVICES=$BENCH_GPU timeout 60 python3 bench/count_graph_ops.py --target "$TARGET" \
    --taps "${TAPS:-4}" --json-out "$O/graph_ops.json" > "$O/graph_ops.txt" 2>&1
fi
# Each operation of a decoder layer and the head alone, B = 1 against B = 16 (layer_ops.txt, under
# a minute; LAYER_OPS=0 skips it): which pieces make a verify cost more than a plain step that
# launches as many kernels (bench/bench_layer_ops.py).
if [ "${LAYER_OPS:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=$BENCH_GPU timeout "${LAYER_OPS_S:-150}" python3 bench/bench_layer_ops.py --target "$TARGET" \
    --block 16 --rounds 5 --json-out "$O/layer_ops.json" > "$O/layer_ops.txt" 2>&1
fi
# A cycle's cost per block size against a plain step, fused as the worker runs it, at two
# contexts (block_cost.txt, about 30 s; BLOCK_COST=0 skips it): the curve the worker's cost model
# measures for itself, here without a session's noise in it (bench/bench_block_cost.py).
if [ "${BLOCK_COST:-1}" = 1 ]; then
  for ctx in 256 1024; do
    CUDA_VISIBLE_DEVICES=$BENCH_GPU timeout "${BLOCK_COST_S:-90}" python3 bench/bench_block_cost.py --target "$TARGET" \
      --dflash-draft "$DRAFT" --blocks 1 2 4 6 8 12 16 --context $ctx --reps 20 --rounds 3 \
      --json-out "$O/block_cost_$ctx.json" >> "$O/block_cost.txt" 2>&1
  done
fi
echo "bench end $(date -u +%T) rc=$rc" >> "$O/dflash_q15.txt"
