#!/usr/bin/env bash
# The compiled target forward (worker/compiled_forward.py) against the uncompiled one on the H200
# (bench/h200/README.md, "Session 17"). Steps, in order, as many as one device call fits:
#
#   OUT=$OUT bash bench/h200/bench_compiled.sh prep ablation   join the pieces, convert the 1.5B
#                                                               GGUF, unpack the cases; the verify
#                                                               ablation at contexts 256 and 1024
#   OUT=$OUT bash bench/h200/bench_compiled.sh dflash          bench_dflash.py --fuse --compile,
#                                                               then the MLX kernel cache to OUT
# Env: DRAFT (the DFlash draft, default the shipped one), PROMPTS (4), ROUNDS (2), MAX_TOKENS
# (128), DFLASH_FLAGS (more bench_dflash.py flags, default --queue-taps; e.g. --adaptive).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${OUT:?set OUT}; M=/root/models/Qwen2.5-Coder-1.5B-Instruct; C=/root/cases
DRAFT=${DRAFT:-$ROOT/flashfleet/drafts/Qwen2.5-Coder-1.5B-Instruct}
export PYTHONUNBUFFERED=1
source .stage/join/join.sh
[ -d /tmp/mlx ] || { [ -f /root/stage/mlx-kernels.tgz ] && tar xzf /root/stage/mlx-kernels.tgz -C /tmp; }
for step in "${@:?steps: prep ablation dflash}"; do case $step in
prep)
  python3 bench/h200/convert.py Qwen2.5-Coder-1.5B-Instruct /root/stage/files/Qwen2.5-Coder-1.5B-Instruct.gguf $M
  mkdir -p $C && tar xzf /root/stage/files/.stage-cases.tgz -C $C ;;
ablation)
  for ctx in 256 1024; do
    python3 bench/bench_verify_ablation.py --target $M --context $ctx --rounds 3 \
      --variants full taps compiled compiled-taps --json-out "$O/ablation_$ctx.json" 2>&1 | tee "$O/ablation_$ctx.txt"
  done ;;
dflash)
  timeout 540 python3 bench/bench_dflash.py --target $M --dflash-draft "$DRAFT" --max-tokens "${MAX_TOKENS:-128}" \
    --prompts "${PROMPTS:-4}" --rounds "${ROUNDS:-2}" --cases $C --fuse --compile ${DFLASH_FLAGS---queue-taps} \
    --json-out "$O/dflash.json" 2>&1 | grep -v " done$" | tee "$O/dflash.txt"
  ls -d /tmp/mlx/*/ptx >/dev/null 2>&1 && (cd /tmp && tar czf "$O/mlx-kernels.tgz" --exclude='*.cu' mlx/*/ptx) ;;
*) echo "bench_compiled: unknown step $step"; exit 2 ;;
esac; done
ls -la "$O"
