#!/usr/bin/env bash
# Trains the repository's DFlash draft for SmolLM2-135M-Instruct on the lent H200 (MLX's CUDA
# build) in about 8 minutes, then measures its acceptance length tau on held-out prompts.
#
#   bash bench/train_draft_h200.sh MODEL_DIR CASES_DIR OUT_DIR
#
#   MODEL_DIR  the real SmolLM2-135M-Instruct model directory (config.json, model.safetensors,
#              tokenizer files), e.g. converted on that machine from the staged GGUF
#   CASES_DIR  a copy of shared/cases: every *.jsonl in it is a prompt corpus (file stem = corpus;
#              code = humaneval, English = enwiki_en / lee_news_en / fortunes_en, Polish =
#              dataset_build_pl / fortunes_pl, ...)
#   OUT_DIR    gets config.json + model.safetensors (the draft, bfloat16, < 16 MiB),
#              training_card.json, TRAINING.md and train.log; $OUT works (5 files, all small)
#
# Budget (H200, wall clock): load ~0.3 min; the target answers ~1900 prompts x <= 256 tokens,
# batched 512 at a time (capped at GEN_MINUTES); taps of every sequence cached on the GPU (one
# pass); training for TRAIN_MINUTES (the cosine schedule runs on the time fraction); tau of the
# trained and of the untrained draft on the held-out prompts (8 per corpus, <= 128 new tokens,
# each capped at EVAL_MINUTES). Worst case about 0.3 + 1.5 + 0.2 + 4 + 2 x 0.75 = 7.5 min.
# Every knob below can be overridden from the environment; extra arguments after OUT_DIR go to
# `flashfleet draft train` unchanged (e.g. --steps 200 for a smoke test).
#
# Needs: python3 with MLX's CUDA build and mlx-lm on PYTHONPATH (shared/device/stage.sh), numpy,
# tqdm, transformers, jinja2 (all on that machine's image). Imports nothing of the flashfleet
# package except this command's own module (so gRPC stubs never load there).
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 MODEL_DIR CASES_DIR OUT_DIR [extra train flags...]" >&2; exit 2; }
MODEL=$1; CASES=$2; OUT=$3; shift 3
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-/tmp/flashfleet-dflash-work}
PER_FILE=${PER_FILE:-450}           # prompts per corpus file (~1900 over the 7 case files)
GEN_TOKENS=${GEN_TOKENS:-256}       # the target's answer length cap
GEN_BATCH=${GEN_BATCH:-512}         # sequences answered at once
GEN_MINUTES=${GEN_MINUTES:-1.5}     # generation stops here; answers so far are kept
GEN_SAMPLES=${GEN_SAMPLES:-1}       # answers per prompt: 1 greedy + (N-1) sampled at GEN_SAMPLE_T
GEN_SAMPLE_T=${GEN_SAMPLE_T:-0.8}
TRAIN_MINUTES=${TRAIN_MINUTES:-4}
BATCH=${BATCH:-32}                  # sequences per step
ANCHORS=${ANCHORS:-64}              # blocks per sequence per step (B = 16)
LR=${LR:-6e-4}                      # peak learning rate
EVAL_TOKENS=${EVAL_TOKENS:-128}
EVAL_MINUTES=${EVAL_MINUTES:-0.75}
EVAL_UNTRAINED=${EVAL_UNTRAINED:-1}  # 0: skip tau of the untrained draft
EVAL_UNQUANTIZED=${EVAL_UNQUANTIZED:-1}  # 0: with --quantize-bits, skip tau of the weights before quantizing
CACHE_TAPS_GIB=${CACHE_TAPS_GIB:-32}
NPROC=${NPROC:-1}                   # >1: data parallel, one process per GPU (mlx.launch)
DIST_BACKEND=${DIST_BACKEND:-nccl}  # mlx.launch backend for NPROC > 1 (ring: dry runs with mlx[cpu])
RETRIES=${RETRIES:-1}               # resume after a crash this many times (needs a checkpoint)
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-500}  # steps

shopt -s nullglob
PROMPTS=("$CASES"/*.jsonl)
[ ${#PROMPTS[@]} -gt 0 ] || { echo "no *.jsonl prompt files in $CASES" >&2; exit 2; }
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import mlx.core as mx, mlx_lm; print("mlx", mx.__version__, "mlx-lm", mlx_lm.__version__, mx.default_device())'

# `flashfleet draft train`, loaded from its file so the flashfleet package (gRPC stubs) is not imported.
MAIN="$WORK.main.py"; mkdir -p "$(dirname "$MAIN")"
cat > "$MAIN" <<EOF
import importlib.util, os, sys
import mlx.core as mx
if os.environ.get("MLX_CACHE_GIB"):  # several trainings share one GPU: keep each one's buffer cache small
    mx.set_cache_limit(int(float(os.environ["MLX_CACHE_GIB"]) * 2**30))
spec = importlib.util.spec_from_file_location("draft_cmd", "$ROOT/flashfleet/cli/draft_cmd.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.exit(mod.main(sys.argv[1:]))
EOF
LAUNCH="import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; main()"
RUN=(python3 "$MAIN")
if [ "$NPROC" -gt 1 ]; then
  # The backend must come up first; else the session's GPU time goes to one process, not to nothing.
  export NCCL_NVLS_ENABLE=0  # the lent machines' rule: no NVLink multicast
  # mlx.launch exits 0 even when a rank fails: count the ranks that report success instead.
  ok=$(timeout 180 python3 -c "$LAUNCH" -n "$NPROC" --backend "$DIST_BACKEND" -- python3 -c \
      'import mlx.core as mx; from worker.training.distributed import world; g = world(); x = mx.distributed.all_sum(mx.ones(4), group=g); assert x[0].item() == g.size() > 1; print("all_sum ok on rank", g.rank(), "of", g.size(), mx.default_device())' \
      2>&1 | tee /dev/stderr | grep -c "all_sum ok on rank")
  if [ "$ok" = "$NPROC" ]; then
    RUN=(python3 -c "$LAUNCH" -n "$NPROC" --backend "$DIST_BACKEND" -- python3 "$MAIN")
  else
    echo "$DIST_BACKEND check failed: training in one process"
  fi
fi
set +e
: > "$OUT/train.log"
for attempt in $(seq 0 "$RETRIES"); do
  from=$(($(wc -l < "$OUT/train.log") + 1)); touch "$WORK.attempt"
  "${RUN[@]}" train --target "$MODEL" --prompts "${PROMPTS[@]}" --out "$OUT" --work-dir "$WORK" \
    --max-prompts-per-file "$PER_FILE" --max-prompt-tokens 256 --max-new-tokens "$GEN_TOKENS" \
    --gen-batch-size "$GEN_BATCH" --gen-max-minutes "$GEN_MINUTES" \
    --gen-samples "$GEN_SAMPLES" --gen-sample-temperature "$GEN_SAMPLE_T" \
    --heldout-per-corpus 8 --heldout-fraction 0.1 \
    --draft-layers 2 --num-taps 5 --block-size 16 --max-draft-mib 15 --save-dtype bfloat16 \
    --batch-size "$BATCH" --anchors "$ANCHORS" --lr "$LR" --warmup 0.04 --grad-clip 1.0 \
    --epochs 1000 --max-minutes "$TRAIN_MINUTES" --cache-taps-gib "$CACHE_TAPS_GIB" \
    --checkpoint-every "$CHECKPOINT_EVERY" \
    --eval-max-new-tokens "$EVAL_TOKENS" --eval-max-minutes "$EVAL_MINUTES" \
    $([ "$EVAL_UNTRAINED" = 1 ] && echo --eval-untrained) $([ "$EVAL_UNQUANTIZED" = 1 ] || echo --no-eval-unquantized) \
    "$@" < /dev/null 2>&1 | tee -a "$OUT/train.log"
  status=${PIPESTATUS[0]}
  [ "$status" = 2 ] && break  # a usage error (one process): retrying cannot help
  # mlx.launch exits 0 even when a rank failed; its log says so.
  tail -n +"$from" "$OUT/train.log" | grep -Eq "Node with rank [0-9]+ (exited with code|was killed)" && status=1
  [ "$status" = 0 ] && break
  # A crash after this attempt wrote a checkpoint (a rank out of memory, say) resumes it: the
  # data is cached, the kernels compiled, and --max-minutes counts the time already trained.
  # Not after the draft was saved (evaluation; GPU 1 may be benchmarking), nor on a usage error.
  tail -n +"$from" "$OUT/train.log" | grep -Eq "saved: |exited with code 2" && break
  [ "$WORK/resume/state.json" -nt "$WORK.attempt" ] || break
  [ "$attempt" -lt "$RETRIES" ] && echo "attempt $((attempt + 1)) failed: resuming from $(grep -o '"step": [0-9]*' "$WORK/resume/state.json" | head -1)"
done
set -e
ls -la "$OUT"
[ -f "$OUT/TRAINING.md" ] && cat "$OUT/TRAINING.md"
exit "$status"
