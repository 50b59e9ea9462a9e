#!/usr/bin/env bash
# Packs each trained draft (config, weights, card, log) into OUT/draft-NAME.tgz (split like the
# data when over 15 MiB: a grown draft's is about 20 MiB),
# MLX's CUDA kernel cache into OUT/mlx-kernels.tgz,
# and each job's generated data (WORK/data or WORK/data-rank*, train.jsonl gzip-compressed) into
# OUT/data-NAME-DIR.tar, so a later session can carry it back in and train on it again
# (`flashfleet draft train --extra-data DIR`) instead of generating it again. A tar over 15 MiB is
# split into OUT/data-NAME-DIR.tar.partaa, .partab, ... (files come back at most 16 MiB each;
# the kernel cache alike); join them with `cat data-NAME-DIR.tar.part* | tar x`.
O=${OUT:-/root/out}; R=${RES:-/root/res}; W=${WORK_ROOT:-/root/work}; mkdir -p "$O"
split_big() {  # FILE over 15 MiB -> FILE.partaa, FILE.partab, ... (the original removed)
  if [ "$(stat -c %s "$1")" -gt $((15 * 1024 * 1024)) ]; then split -b 15M "$1" "$1.part" && rm "$1"; fi
  ls -la "$1"*
}
for d in "$R"/*/; do
  n=$(basename "$d"); [ -f "$d/config.json" ] || { echo "no draft in $d"; continue; }
  tar czf "$O/draft-$n.tgz" -C "$R" "$n" && split_big "$O/draft-$n.tgz"
done
for f in "$R"/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$O/$(basename "$f")"; done
# MLX's CUDA kernel cache (NVRTC output; /tmp/mlx/VERSION/ptx, MLX's default): the next session
# stages OUT/mlx-kernels.tgz and start.sh unpacks it, so its kernels are not compiled again
# (the first training steps spent 104-108 s compiling in sessions 6 and 7). Sources left out.
if [ "${KERNELS:-1}" = 1 ]; then
  if ls -d /tmp/mlx/*/ptx >/dev/null 2>&1; then
    (cd /tmp && tar czf "$O/mlx-kernels.tgz" --exclude='*.cu' mlx/*/ptx) && split_big "$O/mlx-kernels.tgz"
  else
    echo "no MLX kernel cache in /tmp/mlx/*/ptx"
  fi
fi
[ "${DATA:-1}" = 1 ] || exit 0
for d in "$W"/*/data "$W"/*/data-rank*; do
  [ -f "$d/meta.json" ] && [ -f "$d/train.jsonl" ] || continue
  n=$(basename "$(dirname "$d")"); t=$(mktemp -d); c="$t/$n-$(basename "$d")"; mkdir -p "$c"
  f="$O/data-$n-$(basename "$d").tar"
  gzip -9 -c "$d/train.jsonl" > "$c/train.jsonl.gz" && cp "$d/heldout.jsonl" "$d/meta.json" "$c/" \
    && tar cf "$f" -C "$t" "$(basename "$c")" && split_big "$f"
  rm -rf "$t"
done
