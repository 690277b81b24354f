#!/usr/bin/env bash
# Render the diagrams of docs/architecture.md from their graphviz sources (apt-get install graphviz).
set -euo pipefail
cd "$(dirname "$0")"
for source in layers training_step checkpoint_save; do
  dot -Tsvg "$source.dot" -o "$source.svg"
  dot -Tpng -Gdpi=110 "$source.dot" -o "$source.png"
done
