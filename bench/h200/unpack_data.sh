#!/usr/bin/env bash
# Here, after a session: unpacks the data caches collect.sh brought back (data-NAME-DIR.tar, or
# its .partaa/.partab/... pieces; one tar per training process) into DEST/NAME-DIR/, each checked
# (meta.json, heldout.jsonl, train.jsonl.gz readable to the end), then recompresses train.jsonl as
# xz (-9e: 38% smaller than collect.sh's gzip -9 on the twelfth session's data; 4 minutes on two
# cores; the loader reads either). DEST must not exist yet, so an earlier session's data is
# replaced only after the new data has been checked:
#
#   bash bench/h200/unpack_data.sh /tmp/data.new /work/.device/NN \
#     && rm -rf bench/h200/data/NAME-data && mv /tmp/data.new/NAME-data bench/h200/data/
set -euo pipefail
DEST=${1:?usage: unpack_data.sh DEST FROM_DIR}; FROM=${2:?usage: unpack_data.sh DEST FROM_DIR}
[ ! -e "$DEST" ] || { echo "unpack_data: $DEST exists; give a new directory" >&2; exit 2; }
shopt -s nullglob
names=()
for f in "$FROM"/data-*.tar "$FROM"/data-*.tar.partaa; do names+=("${f%.partaa}"); done
[ ${#names[@]} -gt 0 ] || { echo "unpack_data: no data-*.tar or data-*.tar.partaa in $FROM" >&2; exit 2; }
mkdir -p "$DEST"
for t in "${names[@]}"; do
  if [ -f "$t" ]; then tar xf "$t" -C "$DEST"; else cat "$t".part?? | tar xf - -C "$DEST"; fi
done
for d in "$DEST"/*/; do
  for f in meta.json heldout.jsonl train.jsonl.gz; do
    [ -f "$d/$f" ] || { echo "unpack_data: $d has no $f" >&2; exit 1; }
  done
  gzip -t "$d/train.jsonl.gz"
  n=$(zcat "$d/train.jsonl.gz" | wc -l)
  zcat "$d/train.jsonl.gz" | xz -9e -T0 > "$d/train.jsonl.xz"
  [ "$(xz -dc "$d/train.jsonl.xz" | sha256sum)" = "$(zcat "$d/train.jsonl.gz" | sha256sum)" ] \
    || { echo "unpack_data: $d: the xz copy differs from the gzip one" >&2; exit 1; }
  rm "$d/train.jsonl.gz"
  echo "unpack_data: $d $n sequences ($(du -h "$d/train.jsonl.xz" | cut -f1) as xz)"
done
