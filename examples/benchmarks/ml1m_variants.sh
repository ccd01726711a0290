#!/bin/bash
# MovieLens-1M variants of one config trained at once on one GPU, each fit under a time limit and then tested on
# its last checkpoint; a table of the test metrics at the end. Small models leave most of an H200 idle, so four
# or five runs share it at little cost each (with compiled layers, four runs of every window took 3.4-3.6 s an
# epoch against 2.2-2.3 s alone).
#
# Usage (from the repository root, with the kit installed, see run_gpu_suite.sh):
#   OUT=ml1m-variants ML1M=PATH/TO/ml-1m bash examples/benchmarks/ml1m_variants.sh [VARIANTS_FILE]
# VARIANTS_FILE: one variant a line, `name overrides...` (CLI overrides of CONFIG); default: the list below.
# CONFIG: the config (default examples/configs/ml1m_hstu_h200.yaml, which keeps last.ckpt); a variant's overrides may
# add an overlay, e.g. `proj --config examples/configs/ml1m_hstu_h200/projection_and_norm.yaml`.
# MAX_TIME: each fit's limit, DD:HH:MM:SS (default 00:00:08:00). The default list: the config with three seeds
# (run-to-run spread), and width 512 for 40 epochs in bf16 and under MXFP8Precision (on an H200 the FP8
# GEMMs need dims that are multiples of 512; narrower Linears stay in bf16, which would compare bf16 to bf16).
# PYTHON: the interpreter (default python3).
set -u
OUT=${OUT:-ml1m-variants}
PY=${PYTHON:-python3}
CONFIG=${CONFIG:-examples/configs/ml1m_hstu_h200.yaml}
MAX_TIME=${MAX_TIME:-00:00:08:00}
: "${ML1M:?set ML1M to the ml-1m folder (https://grouplens.org/datasets/movielens/1m/)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

default_variants() {
  cat << 'LIST'
as_configured
seed1 --seed_everything 1
seed2 --seed_everything 2
width512 --model.init_args.embedding_dim 512 --model.init_args.num_heads 4 --trainer.max_epochs 40 --trainer.check_val_every_n_epoch 20
width512_fp8 --model.init_args.embedding_dim 512 --model.init_args.num_heads 4 --trainer.max_epochs 40 --trainer.check_val_every_n_epoch 20 --trainer.precision null --trainer.plugins lightning_gem.precision.MXFP8Precision
LIST
}

run() {  # name overrides...: fit, then test the last checkpoint with the same overrides
  local name=$1 start=$SECONDS ckpt
  shift
  local common=(--config "$CONFIG" --data.init_args.source.init_args.path "$ML1M" "$@")
  $PY -m lightning_gem.cli fit "${common[@]}" --trainer.max_time "$MAX_TIME" \
    --trainer.logger.init_args.save_dir "$OUT/$name" > "$OUT/$name.fit.log" 2>&1
  echo "$name fit: exit $? after $((SECONDS - start)) s" >> "$OUT/summary.txt"
  ckpt=$(ls "$OUT/$name"/*/version_*/checkpoints/last.ckpt 2> /dev/null | tail -1)
  [ -n "$ckpt" ] || return
  $PY -m lightning_gem.cli test "${common[@]}" --trainer.logger false --trainer.default_root_dir "$OUT/$name" \
    --ckpt_path "$ckpt" > "$OUT/$name.test.log" 2>&1
  echo "$name test: exit $? at $((SECONDS - start)) s" >> "$OUT/summary.txt"
}

if [ $# -ge 1 ]; then variants=$(cat "$1"); else variants=$(default_variants); fi
while read -r name overrides; do
  [ -z "$name" ] && continue
  # shellcheck disable=SC2086  # the overrides are separate words
  run "$name" $overrides &
done <<< "$variants"
wait

printf '| variant | epochs | test HR@10 | NDCG@10 | HR@50 | HR@200 | NDCG@200 |\n| --- | --- | --- | --- | --- | --- | --- |\n' \
  > "$OUT/table.md"
while read -r name _; do
  [ -z "$name" ] && continue
  log=$OUT/$name.test.log
  metric() { grep -Eo "test/$1=[0-9.]+" "$log" 2> /dev/null | head -1 | cut -d= -f2; }
  last=$(grep -aEo 'Epoch [0-9]+' "$OUT/$name.fit.log" 2> /dev/null | tail -1 | grep -Eo '[0-9]+')
  echo "| $name | $((${last:--1} + 1)) | $(metric hr@10) | $(metric ndcg@10) | $(metric hr@50) |" \
    "$(metric hr@200) | $(metric ndcg@200) |" >> "$OUT/table.md"
done <<< "$variants"
cat "$OUT/summary.txt" "$OUT/table.md"
