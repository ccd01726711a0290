#!/bin/bash
# Every GPU measurement behind docs/benchmarks.md and docs/results.md, in one command, each step under its
# own time limit so one slow or failing step does not cost the others. Results and logs go to OUT.
#
# Usage (from the repository root, on a CUDA machine with torchrec, fbgemm-gpu and the kit installed: the
# package maps components/ and strategies/ into lightning_gem, so `pip install -e .` rather than PYTHONPATH=.):
#   OUT=gpu-results ML1M=PATH/TO/ml-1m bash examples/benchmarks/run_gpu_suite.sh [STEP ...]
# STEP: any of tests attention fp8_attention precision host encoder balance balance_wide e2e scaling ml1m
# ml1m_projection ml1m_reference ml1m_holdout (default: all, in that order).
# ML1M: the MovieLens-1M folder from https://grouplens.org/datasets/movielens/1m/ (the ml1m step needs it).
# PYTHON: the interpreter (default python3). The first process on a fresh machine compiles and tunes the Triton
# kernels (minutes): the limits allow it.
set -u
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests attention fp8_attention precision host encoder balance balance_wide e2e scaling ml1m
  ml1m_projection ml1m_reference ml1m_holdout)
gpus=$($PY -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L > "$OUT/gpus.txt" 2>&1

step() {  # name limit_s command...
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

ml1m_step() {  # name checkpoint-file-pattern config...: fit on MovieLens-1M (the configs composed in order), then
  # test that checkpoint
  local name=$1 pattern=$2 ckpt config configs=()
  shift 2
  for config in "$@"; do configs+=(--config "$config"); done
  if [ -z "${ML1M:-}" ]; then
    echo "$name: skipped (set ML1M to the ml-1m folder)" | tee -a "$OUT/summary.txt"
    return
  fi
  local data=(--data.init_args.source.init_args.path "$ML1M")
  step "${name}_fit" 900 $PY -m lightning_gem.cli fit "${configs[@]}" "${data[@]}" \
    --trainer.logger.init_args.save_dir "$OUT/$name"
  ckpt=$(ls "$OUT/$name"/*/version_*/checkpoints/$pattern 2> /dev/null | tail -1)
  [ -n "$ckpt" ] && step "${name}_test" 300 $PY -m lightning_gem.cli test "${configs[@]}" "${data[@]}" \
    --trainer.logger false --trainer.default_root_dir "$OUT/$name" --ckpt_path "$ckpt"
}

for s in "${steps[@]}"; do
  case $s in
    tests)  # a process a test file: a kernel fault leaves its process's CUDA context unusable, not the other files'
      for f in $(grep -rl "pytest.mark.gpu" tests --include="test_*.py" | sort); do
        name=$(basename "$f" .py)
        step "tests_${name#test_}" 600 $PY -m pytest -q -p no:cacheprovider -m gpu -s "$f"
      done ;;
    attention)  # every backend on 200 random jagged shapes per mode, then the shape grid against FA4 and the rest
      step attention_sweep 600 $PY examples/benchmarks/attention_check.py \
        sweep --modes grid --impls triton,flash,auto --dims 64,128,256 --out "$OUT/attention_sweep.json"
      for i in $(seq 1 12); do  # slices of about 8 minutes, each from where the last stopped, one grid in the end
        step "attention_grid_$i" 600 $PY examples/benchmarks/attention_grid.py --candidates reused --time-limit 480 \
          --resume "$OUT/attention_grid"
        grep -q "grid done" "$OUT/attention_grid_$i.log" && break
      done ;;
    fp8_attention)  # FP8 attention: forward and backward on 200 random shapes per mode against the emulation, then the
      # grid's head-dim-128 and 256 cells on FP8 codes beside their bf16 calls, end to end at NVIDIA's HSTU shapes
      step fp8_sweep 600 $PY examples/benchmarks/attention_check.py sweep --modes grid --impls triton,triton-fp8 \
        --dims 64,128,256 --out "$OUT/fp8_sweep.json"
      step fp8_grid 600 $PY examples/benchmarks/attention_grid.py --no-named --modes "softmax causal" "silu causal" \
        --heads 16 4 --dims 128 256 --lengths 4k-uniform 4k --long-tokens 0 --precision fp8 \
        --out-dir "$OUT/fp8_grid"
      step fp8_e2e 600 $PY examples/benchmarks/e2e.py --preset nvidia-hstu --stacks kit --kit-precision mxfp8-attention \
        --root "$OUT/fp8_e2e" --out "$OUT/fp8_e2e.json"
      # Saved activations in MXFP8 against the same stack without, the GEM example at width 2048: peak memory, step
      # time and the per-step loss gap on the same batches
      step fp8_saved 600 $PY examples/benchmarks/e2e.py --stacks kit,kit-fp8-saved --kit-precision mxfp8 \
        --model-dim 2048 --num-heads 16 --num-layers 8 --batch-size 32 --steps 10 --warmup 5 --root "$OUT/fp8_saved" \
        --out "$OUT/fp8_saved.json" ;;
    precision) step precision 600 $PY examples/benchmarks/precision.py --tokens 16384 65536 --rounds 3 \
      --quality-steps 150 --profile --host-profile --out "$OUT/precision.json" ;;
    host) step host_overhead 120 $PY examples/benchmarks/host_overhead.py ;;
    encoder)  # the fused pointwise kernels against PyTorch's unfused ops, each variant twice, interleaved
      step encoder_step 300 $PY examples/benchmarks/encoder_step.py --variants unfused kit-norm kit-norm unfused \
        --reps 20 --out "$OUT/encoder_step.json"
      step encoder_step_1024 300 $PY examples/benchmarks/encoder_step.py --dim 1024 --num-heads 4 \
        --variants unfused kit-norm kit-norm unfused --reps 15 --out "$OUT/encoder_step_1024.json" ;;
    balance)  # 64 and 32 users per simulated rank: the smaller shares are the more unequal ones
      step balance 300 $PY examples/benchmarks/balance_ranks.py --num-batches 4 --reps 3 \
        --out "$OUT/balance_ranks.json"
      step balance32 300 $PY examples/benchmarks/balance_ranks.py --num-batches 4 --reps 5 --batch-size 32 \
        --profile --out "$OUT/balance_ranks_32.json" ;;
    balance_wide)  # widths 1024 and 2048 (heads of 128): from 2048 a share's time follows its work
      step balance_1024 400 $PY examples/benchmarks/balance_ranks.py --num-batches 8 --reps 5 --batch-size 32 \
        --model-dim 1024 --num-heads 8 --out "$OUT/balance_ranks_1024.json"
      step balance_2048 580 $PY examples/benchmarks/balance_ranks.py --num-batches 40 --reps 3 --batch-size 32 \
        --model-dim 2048 --num-heads 16 --out "$OUT/balance_ranks_2048.json" ;;
    e2e) step e2e 600 $PY examples/benchmarks/e2e.py --stacks kit,plain --sync-debug --root "$OUT/e2e" \
      --out "$OUT/e2e.json"
      # Wider dense parts, the kit alone (the plain stack's padded scores do not fit at these head counts): from
      # width 2048 a step is device work
      for w in 1024 2048 4096; do
        step e2e_$w 300 $PY examples/benchmarks/e2e.py --stacks kit --model-dim $w --num-heads $((w / 128)) \
          --num-layers 8 --batch-size 32 --steps 10 --warmup 5 --root "$OUT/e2e_$w" --out "$OUT/e2e_$w.json"
      done
      # Host time at the default width (host-bound) and at NVIDIA's HSTU shapes, bf16: the kit as it is, then with
      # token counts padded to multiples of 1024 (GEMMs meet repeated row counts) and AdamW's fused kernel, then with
      # the encoder and interaction replayed from CUDA graphs too; the profile splits each step into kernel families
      # and host gaps
      for v in "" "--token-multiple 1024 --fused-optimizer" "--token-multiple 1024 --fused-optimizer --cuda-graphs"; do
        tag=$([ -n "$v" ] && echo padded || echo plain)
        [[ "$v" == *graphs* ]] && tag=graphs
        step e2e_host_$tag 400 $PY examples/benchmarks/e2e.py --stacks kit --kit-precision bf16 --warmup 30 \
          --steps 20 --profile-steps 3 $v --root "$OUT/e2e_host_$tag" --out "$OUT/e2e_host_$tag.json"
        step e2e_nvidia_$tag 500 $PY examples/benchmarks/e2e.py --preset nvidia-hstu --stacks kit --kit-precision bf16 \
          --warmup 50 --steps 30 --profile-steps 2 $v --root "$OUT/e2e_nvidia_$tag" --out "$OUT/e2e_nvidia_$tag.json"
      done
      # NVIDIA's HSTU shapes with the fused pointwise kernels around each layer's attention and without them
      step e2e_pointwise 500 $PY examples/benchmarks/e2e.py --preset nvidia-hstu --stacks kit,kit-unfused \
        --kit-precision bf16 --warmup 30 --steps 20 --profile-steps 2 --token-multiple 1024 --fused-optimizer \
        --root "$OUT/e2e_pointwise" --out "$OUT/e2e_pointwise.json"
      # The fast path's losses against the kit's plain eager path over 100 steps, same batches, with a second eager
      # run as the gap nondeterministic kernels alone make
      step e2e_losses 600 $PY examples/benchmarks/e2e.py --stacks kit,kit-eager,kit-eager-2 --kit-precision bf16 \
        --warmup 5 --steps 95 --token-multiple 1024 --fused-optimizer --cuda-graphs --root "$OUT/e2e_losses" \
        --out "$OUT/e2e_losses.json"
      # The kit with its HSTU layers compiled, at the default width (host-bound) and at 4096
      step e2e_compiled 600 $PY examples/benchmarks/e2e.py --stacks kit --compile-layers --root "$OUT/e2e_compiled" \
        --out "$OUT/e2e_compiled.json"
      step e2e_4096_compiled 300 $PY examples/benchmarks/e2e.py --stacks kit --compile-layers --model-dim 4096 \
        --num-heads 32 --num-layers 8 --batch-size 32 --steps 10 --warmup 5 --root "$OUT/e2e_4096_compiled" \
        --out "$OUT/e2e_4096_compiled.json"
      # Both stacks at width 4096: the plain one in 16 micro-batches of 2 users (gradient accumulation)
      step e2e_4096_both 600 $PY examples/benchmarks/e2e.py --stacks kit,plain --model-dim 4096 --num-heads 32 \
        --num-layers 8 --batch-size 32 --plain-micro-batches 16 --steps 10 --warmup 3 --root "$OUT/e2e_4096_both" \
        --out "$OUT/e2e_4096_both.json" ;;
    scaling)
      if [ "$gpus" -ge 2 ]; then
        step scaling 900 $PY examples/benchmarks/scaling.py --steps 20 --warmup 5 --batch-size 64 --timeout 240 \
          --headline replicated --sync-debug --profile-dir "$OUT/scaling_profiles" --root "$OUT/scaling" \
          --out "$OUT/scaling.json"
        for b in 128 256; do  # the headline layout at larger per-GPU batches, with fp32 and bf16 embedding comms
          for c in fp32 bf16; do
            step scaling${b}_$c 300 $PY examples/benchmarks/scaling.py --steps 20 --warmup 5 --batch-size $b \
              --timeout 240 --layouts "$gpus/replicated" --skip offs checkpoint --match-sharding --comm-precision $c \
              --root "$OUT/scaling${b}_$c" --out "$OUT/scaling${b}_$c.json"
          done
        done
      else
        echo "scaling: skipped ($gpus GPU)" | tee -a "$OUT/summary.txt"
      fi ;;
    # The ML-1M recipe (docs/results.md's top row); it trains on the validation item too, so its last checkpoint
    # is tested. The other steps compose overlays on it (examples/configs/ml1m_hstu_h200/).
    ml1m) ml1m_step ml1m last.ckpt examples/configs/ml1m_hstu_h200.yaml ;;
    # With the kit's input projection and final norm.
    ml1m_projection) ml1m_step ml1m_projection last.ckpt examples/configs/ml1m_hstu_h200.yaml \
      examples/configs/ml1m_hstu_h200/projection_and_norm.yaml ;;
    # The HSTU reference recipe as first run: the most recent window only, 100 epochs, constant learning rate.
    ml1m_reference) ml1m_step ml1m_reference last.ckpt examples/configs/ml1m_hstu_h200.yaml \
      examples/configs/ml1m_hstu_h200/projection_and_norm.yaml examples/configs/ml1m_hstu_h200/recent_window.yaml ;;
    # The same on the kit's split: the validation item held out, the best-on-validation checkpoint tested.
    ml1m_holdout) ml1m_step ml1m_holdout "epoch=*.ckpt" examples/configs/ml1m_hstu_h200.yaml \
      examples/configs/ml1m_hstu_h200/projection_and_norm.yaml examples/configs/ml1m_hstu_h200/recent_window.yaml \
      examples/configs/ml1m_hstu_h200/holdout.yaml ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
