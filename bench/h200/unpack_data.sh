#!/usr/bin/env bash
# Here, after a session: unpacks the data caches collect.sh brought back (data-NAME-DIR.tar, or
# its .partaa/.partab/... pieces; one tar per training process) into DEST/NAME-DIR/, each checked
# (meta.json, heldout.jsonl, train.jsonl.gz readable to the end). DEST must not exist yet, so an
# earlier session's data is replaced only after the new data has been checked:
#
#   bash bench/h200/unpack_data.sh .stage/data.new /work/.device/NN \
#     && rm -rf .stage/data && mv .stage/data.new .stage/data
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
  echo "unpack_data: $d $(zcat "$d/train.jsonl.gz" | wc -l) sequences"
done
