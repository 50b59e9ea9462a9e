#!/usr/bin/env bash
# One draft-training job on the GPU machine: GGUF -> bf16 model dir, extra code prompts, then
# bench/train_draft_h200.sh (data, training, tau). Meant to run detached (setsid) while further
# staging runs go on; everything it writes is under RES/NAME and /root/models, /root/work.
#
#   bash bench/h200/job_train.sh NAME GGUF CASES RES [flashfleet draft train flags...]
#
# NAME is a catalog model name (flashfleet/models/catalog.py). Knobs of train_draft_h200.sh
# (GEN_MINUTES, TRAIN_MINUTES, BATCH, ...) pass through the environment.
set -uo pipefail
NAME=$1; GGUF=$2; CASES=$3; RES=$4; shift 4
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
mkdir -p "$RES/$NAME" /root/models /root/work
echo "job $NAME start $(date -u +%T)"
python3 bench/h200/convert.py "$NAME" "$GGUF" "/root/models/$NAME" || { echo "JOB FAILED $NAME convert"; exit 1; }
P=/root/work/prompts-$NAME; mkdir -p "$P"
cp "$CASES"/*.jsonl "$P"/
python3 bench/make_code_tasks.py "$CASES" "$P"
WORK=/root/work/$NAME bash bench/train_draft_h200.sh "/root/models/$NAME" "$P" "$RES/$NAME" "$@"
rc=$?
echo "JOB DONE $NAME rc=$rc $(date -u +%T)"
