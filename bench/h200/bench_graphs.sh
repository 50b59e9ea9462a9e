#!/usr/bin/env bash
# MLX's CUDA-graph settings against decode speed on the H200 (bench/bench_cuda_graphs.py;
# bench/h200/README.md, "Session 20"). Steps, in order, as many as one device call fits:
#
#   OUT=$OUT bash bench/h200/bench_graphs.sh prep      join the pieces, convert the 1.5B GGUF, unpack the cases
#   OUT=$OUT PASS=1 bash bench/h200/bench_graphs.sh graphs   every setting once (its own process each),
#                                                      the table to OUT/graphs_PASS.txt; the kernel cache to OUT
# Env: SETTINGS (default ops100 ops200 nographs), PROMPTS (3), MAX_TOKENS (128), DRAFT (the shipped one).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${OUT:?set OUT}; M=/root/models/Qwen2.5-Coder-1.5B-Instruct; C=/root/cases
DRAFT=${DRAFT:-$ROOT/flashfleet/drafts/Qwen2.5-Coder-1.5B-Instruct}
export PYTHONUNBUFFERED=1
source .stage/join/join.sh
[ -d /tmp/mlx ] || { [ -f /root/stage/mlx-kernels.tgz ] && tar xzf /root/stage/mlx-kernels.tgz -C /tmp; }
for step in "${@:?steps: prep graphs}"; do case $step in
prep)
  OUT=$O bash bench/h200/bench_compiled.sh prep ;;
graphs)
  P=${PASS:-1}
  timeout 570 python3 bench/bench_cuda_graphs.py --target $M --dflash-draft "$DRAFT" --cases $C \
    --settings ${SETTINGS:-default ops100 ops200 nographs} --prompts "${PROMPTS:-3}" \
    --max-tokens "${MAX_TOKENS:-128}" --timeout 200 --out-dir "$O/runs_$P" 2>&1 | tee "$O/graphs_$P.txt"
  (cd "$O" && tar czf "runs_$P.tgz" "runs_$P" && rm -rf "runs_$P")
  ls -d /tmp/mlx/*/ptx >/dev/null 2>&1 && (cd /tmp && tar czf "$O/mlx-kernels.tgz" --exclude='*.cu' mlx/*/ptx) ;;
*) echo "bench_graphs: unknown step $step"; exit 2 ;;
esac; done
ls -la "$O"
