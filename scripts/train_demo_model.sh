#!/usr/bin/env bash
# Rebuilds models/demo, the small language model accel-serve serves when it is
# started without --model: a Llama-family model trained by accel's own
# training library (train/, examples/accel-train-lm) with 2 processes through
# accel-launch, gradient accumulation and periodic save_state, on the English
# text of Debian's `fortunes` package (fortune-mod's data files, BSD licence;
# models/demo/README.md has the notice). The tokenizer (byte-level BPE) is
# learned from the same text by accel's own trainer.
#
#   bash scripts/train_demo_model.sh          # about 20 minutes on 2 cores
#
# It prints the held-out perplexity next to a unigram model's and writes
# models/demo/: config.json, generation_config.json, model.safetensors,
# tokenizer.json, tokenizer_config.json (its chat template), heldout.txt (held-out text for the test), metrics.json.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/setup.sh
if ! dpkg-query -W -f='${Status}' fortunes 2>/dev/null | grep -q 'install ok installed'; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends fortunes >/dev/null
fi
cmake --preset default >/dev/null
cmake --build --preset default --target accel-launch accel-train-lm

work=build/demo
rm -rf "$work"
mkdir -p "$work"
# Every fortune file but the ASCII-art ones, with the `%` separators as blank lines.
# LC_ALL=C: the glob's order, and so which text ends up held out, must not
# depend on the locale.
export LC_ALL=C
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat | *.u8 | */art | */ascii-art) continue ;; esac
  [ -f "$f" ] && cat "$f"
done | sed 's/^%$//' >"$work/corpus.txt"

start=$(date +%s)
build/bin/accel-launch --num_processes 2 --main_process_port 0 build/bin/accel-train-lm \
  --text "$work/corpus.txt" --out "$work/model" --project_dir "$work/project" \
  --vocab_size 2048 --hidden_size 256 --num_layers 4 --num_heads 4 --seq_len 128 \
  --batch_size 16 --grad_accum 2 --max_steps 400 --lr 2e-3 --warmup 20 --save_every 100 \
  --log_every 10 --seed 0 | tee "$work/train.log"
echo "trained in $(($(date +%s) - start)) s"

out=models/demo
mkdir -p "$out"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json; do
  cp "$work/model/$f" "$out/$f"
done
grep '"heldout_perplexity"' "$work/train.log" | tail -1 >"$out/metrics.json"
# accel-train-lm holds out the last 10% of the text (from a line start); the
# last 24 KB of it (about 1%, from a line start) lie well inside that, for the test.
tail -c 24000 "$work/corpus.txt" | tail -n +2 >"$out/heldout.txt"
echo "wrote $out"
