#!/usr/bin/env bash
# Every measurement of one H200 session, once the drafts are trained (bench/h200/README.md).
# Writes tables (and JSON) to OUT; each step runs even if an earlier one failed. Env: MAX_TOKENS,
# PROMPTS (per corpus), PACKAGES (registry packages for q15; empty skips), EXTRA_DRAFTS (more
# DFlash draft dirs for q15).
#
#   OUT=$OUT bash bench/h200/bench_all.sh [STEP...]     steps: q15 small uag bucket (default: all)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
M=/root/models; R=${RES:-/root/res}; W=/root/work; O=${OUT:-/root/out}; C=${CASES:-/root/cases}
Q15=$M/Qwen2.5-Coder-1.5B-Instruct; Q05=$M/Qwen2.5-Coder-0.5B-Instruct; S=$M/SmolLM2-135M-Instruct
mkdir -p "$O" /work/shared && ln -sfn "$C" /work/shared/cases  # bench_uag.py reads /work/shared/cases
export PYTHONUNBUFFERED=1
STEPS=${*:-q15 small uag bucket}
MT=${MAX_TOKENS:-128}; NP=${PROMPTS:-4}  # per generation / per corpus (smaller for a CPU dry run)
run() {  # NAME CMD...: log the command line, tee its output to OUT/NAME.txt
  local name=$1; shift
  echo "+ $* ($(date -u +%T))" | tee "$O/$name.txt"
  "$@" 2>&1 | grep -v " done$" | tee -a "$O/$name.txt"
}
have() { [ -f "$1/config.json" ]; }
for step in $STEPS; do case $step in
q15)  # the default code target: plain / mlx-lm draft spec / ours draft / DFlash (shipped and unquantized)
  drafts=(); for d in "$R/Qwen2.5-Coder-1.5B-Instruct" "$W/Qwen2.5-Coder-1.5B-Instruct/unquantized"; do
    have "$d" && drafts+=("$d"); done
  for d in ${EXTRA_DRAFTS:-}; do have "$d" && drafts+=("$d"); done  # e.g. an earlier draft, to compare
  extra=(); have "$Q05" && extra=(--draft "$Q05")
  pk=(); [ -n "${PACKAGES-zlab dflash-mlx}" ] && pk=(--packages ${PACKAGES-zlab dflash-mlx})  # PACKAGES= skips them
  run dflash_q15 python3 bench/bench_dflash.py --target "$Q15" "${extra[@]}" --dflash-draft "${drafts[@]}" \
    --max-tokens "$MT" --prompts "$NP" --cases "$C" --json-out "$O/dflash_q15.json" "${pk[@]}" --adaptive ;;
bucket)  # the cycle with 4096-position KV buckets (fewer attention compiles, more masked keys)
  run dflash_q15_bucket4096 python3 bench/bench_dflash.py --target "$Q15" --dflash-draft "$R/Qwen2.5-Coder-1.5B-Instruct" \
    --max-tokens "$MT" --prompts "$NP" --kv-bucket 4096 --cases "$C" ;;
small)  # the smaller catalog targets with their drafts
  have "$R/SmolLM2-135M-Instruct" && run dflash_smol python3 bench/bench_dflash.py --target "$S" \
    --dflash-draft "$R/SmolLM2-135M-Instruct" --max-tokens "$MT" --prompts "$NP" --cases "$C"
  have "$R/Qwen2.5-Coder-0.5B-Instruct" && run dflash_q05 python3 bench/bench_dflash.py --target "$Q05" \
    --dflash-draft "$R/Qwen2.5-Coder-0.5B-Instruct" --max-tokens "$MT" --prompts "$NP" --cases "$C" ;;
uag)  # SmolLM2 drafting for the 1.5B target through cross-tokenizer translation
  run uag_q15 python3 bench/bench_uag.py --target "$Q15" --drafts "$S" --prompts "$NP" --max-tokens $((MT / 2)) -k 3 5 ;;
esac; done
ls -la "$O"
