#!/usr/bin/env bash
# The compiled DFlash draft (worker/compiled_draft.py) against the eager one on the H200, and the
# engine's tests on CUDA (bench/h200/README.md, "Session 25"). Steps, in order, one device call
# each or several together:
#
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh prep      join the pieces, convert the 1.5B
#                                                             GGUF, unpack the cases
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh tests     the engine's tests (carry .stage/pydeps)
#   OUT=$OUT PROCS=2 FIRST=1 bash bench/h200/bench_compile_draft.sh dflash
#       PROCS processes of bench_dflash.py --fuse --compile --compile-draft --adaptive (the rows
#       with "compiled" or "comp+draft" in their name), numbered from FIRST: OUT/dflash_pK.txt
#       and the JSONs in OUT/runs_FIRST.tgz, then the MLX kernel cache to OUT.
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh pieces
#       bench_cycle_pieces.py: a cycle's pieces timed apart (ROWS, default "1 4 8"; MODES, default
#       "overlap pipelined split"; PIECE_ROUNDS, default 3; NO_KEEP0=1 leaves out "K keep0";
#       session 26, modes since session 27)
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh batched gain
#       bench_batched_verify.py (K candidate blocks in one verify: its cost, contexts 256 and 1024)
#       and bench_branch_gain.py (what they would add to tau: PROMPTS held-out prompts per corpus,
#       GAIN_TOKENS tokens, default 8 and 256)
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh gemm
#       bench_small_gemm.py: worker/small_gemm.py against cuBLAS (error, per call, forwards; session 28);
#       with SMALL_ATTN=1 the forwards on a third copy with worker/small_attention.py too
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh attn
#       bench_small_attention.py: worker/small_attention.py against MLX's attention (error, per
#       call, one block a query against key splits; sessions 29-30)
#   OUT=$OUT bash bench/h200/bench_compile_draft.sh long
#       bench_small_gemm.py --attention --split on the 1.5B's shape with random weights (no model
#       needed) at LONG_CONTEXT keys (4096): the verify with cuDNN's attention, one block a query,
#       key splits (session 30)
# Env for dflash: SMALL_GEMM=1 (bench_dflash.py --small-gemm: the compiled-draft and candidate-row
# methods again with their linears on worker.small_gemm, " sg" rows), SMALL_ATTN=1 (with SMALL_GEMM:
# --small-attention, every " sg" row again with worker.small_attention, " sg a" rows), ONLY (the --only names, default "compiled comp+draft"), BRANCHES (e.g. "4 8": the
# candidate-row methods too, bench_dflash.py --branches), BENCH_TIMEOUT (seconds a process, 280),
# WARM_ALL=1 (bench_dflash.py --warm-all: an untimed round over every prompt first), SERIAL=1
# (bench_dflash.py --serial: each compiled-draft method in the serial order too, " ser" rows).
# Env: DRAFT (default /root/drafts/Qwen2.5-Coder-1.5B-Instruct, else the shipped one), PROMPTS (4),
# ROUNDS (2), MAX_TOKENS (128). One process per run: the spread between processes on this
# machine is +-20% (session 20), so a gap counts only when it holds in every process.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${OUT:?set OUT}; M=/root/models/Qwen2.5-Coder-1.5B-Instruct; C=/root/cases
DRAFT=${DRAFT:-/root/drafts/Qwen2.5-Coder-1.5B-Instruct}
[ -d "$DRAFT" ] || DRAFT=$ROOT/flashfleet/drafts/Qwen2.5-Coder-1.5B-Instruct
export PYTHONUNBUFFERED=1
source .stage/join/join.sh 2>/dev/null || export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
[ -d /tmp/mlx ] || { [ -f /root/stage/mlx-kernels.tgz ] && tar xzf /root/stage/mlx-kernels.tgz -C /tmp; }
for step in "${@:?steps: prep tests dflash pieces gemm attn long batched gain}"; do case $step in
prep)
  [ -d $M ] || python3 bench/h200/convert.py Qwen2.5-Coder-1.5B-Instruct /root/stage/files/Qwen2.5-Coder-1.5B-Instruct.gguf $M
  mkdir -p $C && tar xzf /root/stage/files/.stage-cases.tgz -C $C && ls $M $C ;;
tests)
  [ -d /tmp/pydeps/grpc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .stage/pydeps/*.whl
  FLASHFLEET_TEST_CASES=$C PYTHONPATH=$PYTHONPATH:/tmp/pydeps timeout 560 python3 -m pytest -q -p no:cacheprovider \
    tests/test_dflash.py tests/test_spec_draft.py tests/test_sampling.py tests/test_fusion.py \
    tests/test_compiled_forward.py tests/test_compiled_draft.py tests/test_engine_dflash.py tests/test_engine.py \
    tests/test_draft_vocab.py tests/test_grow.py tests/test_cost_model.py tests/test_uag.py tests/test_translation.py \
    tests/test_branches.py tests/test_overlap_draft.py tests/test_bench_cycle_pieces.py tests/test_small_gemm.py tests/test_small_attention.py \
    2>&1 | tail -40 | tee "$O/tests.txt" ;;
dflash)
  mkdir -p "$O/work"
  first=${FIRST:-1}
  for k in $(seq "$first" $((first + ${PROCS:-2} - 1))); do
    mkdir -p "$O/work/p$k"
    timeout "${BENCH_TIMEOUT:-280}" python3 bench/bench_dflash.py --target $M --dflash-draft "$DRAFT" --max-tokens "${MAX_TOKENS:-128}" \
      --prompts "${PROMPTS:-4}" --rounds "${ROUNDS:-2}" --cases $C --fuse --compile --compile-draft --adaptive \
      ${BRANCHES:+--branches $BRANCHES} ${WARM_ALL:+--warm-all} ${SERIAL:+--serial} ${SMALL_GEMM:+--small-gemm} ${SMALL_ATTN:+--small-attention} --only ${ONLY:-compiled comp+draft} --json-out "$O/work/p$k/dflash.json" \
      2>&1 | grep -v " done$" | tee "$O/dflash_p$k.txt"
  done
  (cd "$O/work" && tar czf "$O/runs_$first.tgz" .) && rm -rf "$O/work"
  ls -d /tmp/mlx/*/ptx >/dev/null 2>&1 && (cd /tmp && tar czf "$O/mlx-kernels.tgz" --exclude='*.cu' mlx/*/ptx) ;;
pieces)
  timeout 300 python3 bench/bench_cycle_pieces.py --target $M --dflash-draft "$DRAFT" --cases $C --rows ${ROWS:-1 4 8} \
    --modes ${MODES:-overlap pipelined split} ${NO_KEEP0:+--no-keep0} --cycles "${CYCLES:-48}" --rounds "${PIECE_ROUNDS:-3}" --contexts 0 1024 \
    --json-out "$O/pieces.json" 2>&1 | tee "$O/pieces.txt" ;;
gemm)
  timeout 300 python3 bench/bench_small_gemm.py --target $M --context 256 --reps "${GEMM_REPS:-30}" --rounds "${GEMM_ROUNDS:-5}" ${GEMM_SKIP:+--skip $GEMM_SKIP} \
    ${SMALL_ATTN:+--attention} --json-out "$O/gemm.json" 2>&1 | tee "$O/gemm.txt" ;;
attn)
  timeout 400 python3 bench/bench_small_attention.py --rounds "${GEMM_ROUNDS:-5}" --json-out "$O/attn.json" 2>&1 | tee "$O/attn.txt" ;;
long)
  timeout 300 python3 bench/bench_small_gemm.py --target bench/configs/Qwen2.5-Coder-1.5B-Instruct --random-weights \
    --context "${LONG_CONTEXT:-4096}" --reps "${GEMM_REPS:-20}" --rounds "${GEMM_ROUNDS:-3}" --skip error call \
    --attention --split --json-out "$O/long.json" 2>&1 | tee "$O/long.txt" ;;
batched)
  timeout 240 python3 bench/bench_batched_verify.py --target $M --ks 1 2 4 8 --block 16 --contexts 256 1024 \
    --reps 20 --rounds 3 --json-out "$O/batched.json" 2>&1 | tee "$O/batched.txt" ;;
gain)
  timeout 300 python3 bench/bench_branch_gain.py --target $M --dflash-draft "$DRAFT" --prompts "${PROMPTS:-8}" \
    --max-tokens "${GAIN_TOKENS:-256}" --cases $C --json-out "$O/gain.json" 2>&1 | tee "$O/gain.txt" ;;
*) echo "bench_compile_draft: unknown step $step"; exit 2 ;;
esac; done
ls -la "$O"
