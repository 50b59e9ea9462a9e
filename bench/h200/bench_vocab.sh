#!/usr/bin/env bash
# The draft vocabulary (bench/bench_draft_vocab.py) on the H200 (bench/h200/README.md, "Session 18").
# Steps, in order, as many as one device call fits:
#
#   OUT=$OUT bash bench/h200/bench_vocab.sh prep vocab   join the pieces, convert the 1.5B GGUF,
#                                                        unpack the cases; coverage, draft ms, train
#                                                        step ms and held-out tau per vocabulary size
#   OUT=$OUT bash bench/h200/bench_vocab.sh dflash       bench_dflash.py --fuse --compile --adaptive,
#                                                        the shipped draft and it with a K-token
#                                                        vocabulary side by side; the kernel cache to OUT
# Env: SIZES (0 65536 32768 16384), K (32768), PER_CORPUS (8), PROMPTS (4), ROUNDS (2), MAX_TOKENS (128).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${OUT:?set OUT}; M=/root/models/Qwen2.5-Coder-1.5B-Instruct; C=/root/cases
DRAFT=$ROOT/flashfleet/drafts/Qwen2.5-Coder-1.5B-Instruct
DATA=$ROOT/bench/h200/data/Qwen2.5-Coder-1.5B-Instruct-data
export PYTHONUNBUFFERED=1
source .stage/join/join.sh
[ -d /tmp/mlx ] || { [ -f /root/stage/mlx-kernels.tgz ] && tar xzf /root/stage/mlx-kernels.tgz -C /tmp; }
for step in "${@:?steps: prep vocab dflash}"; do case $step in
prep)  # the same preparation as the compiled-forward benchmark's
  OUT=$O bash bench/h200/bench_compiled.sh prep ;;
vocab)
  timeout 420 python3 bench/bench_draft_vocab.py --target $M --draft "$DRAFT" --data $DATA/train.jsonl.xz \
    --heldout $DATA/heldout.jsonl --sizes ${SIZES:-0 65536 32768 16384} --per-corpus "${PER_CORPUS:-8}" \
    --train-sequences 128 --train-steps 8 --json-out "$O/vocab.json" 2>&1 | tee "$O/vocab.txt" ;;
dflash)
  V=/root/q15-vocab${K:-32768}
  # Not `python3 -m flashfleet.cli.draft_cmd vocab`: the flashfleet package imports the gRPC
  # client, whose generated code needs a newer grpcio than the staged one (session 18).
  python3 - "$M" "$DRAFT" "$DATA/train.jsonl.xz" "${K:-32768}" "$V" <<'PY' 2>&1 | tee "$O/vocab_draft.txt"
import json, lzma, sys
from pathlib import Path
sys.path.insert(0, ".")
from worker.models.dflash_checkpoint import load_dflash_draft, save_dflash_draft
from worker.training.defaults import choose_draft_vocab, label_token_counts
from worker.training.train import load_target, resolve_dtype
m, d, data, k, out = sys.argv[1:]
target, tok = load_target(Path(m), resolve_dtype("auto"))
draft = load_dflash_draft(d, target)
with lzma.open(data, "rt") as f:
    answers = [json.loads(line)["response_ids"] for line in f]
ids, coverage = choose_draft_vocab(label_token_counts(answers, draft.args.vocab_size), int(k), tok.eos_token_ids)
save_dflash_draft(draft.set_vocab(ids), out)
print(f"{out}: {ids.size} tokens, covering {100 * coverage:.2f}% of the answer tokens")
PY
  timeout 480 python3 bench/bench_dflash.py --target $M --dflash-draft "$DRAFT" $V --max-tokens "${MAX_TOKENS:-128}" \
    --prompts "${PROMPTS:-4}" --rounds "${ROUNDS:-2}" --cases $C --fuse --compile --adaptive \
    --json-out "$O/dflash.json" 2>&1 | grep -v " done$" | tee "$O/dflash.txt"
  ls -d /tmp/mlx/*/ptx >/dev/null 2>&1 && (cd /tmp && tar czf "$O/mlx-kernels.tgz" --exclude='*.cu' mlx/*/ptx) ;;
*) echo "bench_vocab: unknown step $step"; exit 2 ;;
esac; done
ls -la "$O"
