#!/usr/bin/env bash
# Builds accel and starts it on its embedded default model.
#
# accel-serve arrives with the server issue. Until then this runs the closest
# working thing: it makes a small Llama-family model with accel-make-model,
# shows what the loader reads from it with accel-inspect, and generates from a
# prompt with accel-generate (the model's weights are random: the text is too).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target accel-make-model accel-inspect accel-generate

model="build/demo-model"
if [ ! -f "$model/config.json" ]; then
  build/bin/accel-make-model "$model" --family llama --num_kv_heads 2 --num_layers 4 --hidden_size 128
fi
echo
echo "accel-serve is not built yet (it comes with the server issue); showing the model it will serve:"
echo
build/bin/accel-inspect "$model"
echo
echo "and generating from it (random weights, so random text) with accel-generate:"
echo
build/bin/accel-generate --model "$model" --prompt "Once upon a time" --max_new_tokens 24 \
  --temperature 0.8 --seed 1
