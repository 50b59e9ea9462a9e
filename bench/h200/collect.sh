#!/usr/bin/env bash
# Packs each trained draft (config, weights, card, log) into OUT/draft-NAME.tgz (< 16 MiB each).
O=${OUT:-/root/out}; R=${RES:-/root/res}; mkdir -p "$O"
for d in "$R"/*/; do
  n=$(basename "$d"); [ -f "$d/config.json" ] || { echo "no draft in $d"; continue; }
  tar czf "$O/draft-$n.tgz" -C "$R" "$n" && ls -la "$O/draft-$n.tgz"
done
for f in "$R"/*.log; do [ -f "$f" ] && tail -c 200000 "$f" > "$O/$(basename "$f")"; done
