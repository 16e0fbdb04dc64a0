#!/usr/bin/env bash
# The MFU benchmark on a bare accelerator machine (docs/performance.md, "MFU
# on an accelerator"): T5.1.1-Base, bfloat16, batch 32 of 512 / 32, MTL and
# the five conditioned models (both forms where a model has two), 3 untimed
# and 5 timed steps each; MTL's step is then traced and its device time
# broken down by XLA op and kernel ($OUT/profiles). Each model is compiled
# and timed before the next: on one H100 a Base step compiled in 83-118 s,
# so the ten rows take about 20 minutes; `--variants=...` and
# `--forms=auto` (or a list of forms) run a part.
#
#   tools/device_benchmark.sh [FLAG ...]
#
# Needs python3 with jax (with its accelerator plugin), flax, optax and
# numpy; the repository is put on PYTHONPATH (no install). TensorFlow, seqio
# and gin are not needed. Wheels in .whl/ beside the repository's files, if
# any, are installed first into /tmp/site (no index, no dependencies).
# Writes $OUT/mfu.json (rewritten after each variant) and $OUT/mfu.log ($OUT:
# ./mfu_out by default). FLAGs are added to the benchmark's and win (e.g.
# --peak_tflops=989, --variants=adapter, --model=t5_1_1_tiny).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$PWD/mfu_out}"
mkdir -p "$OUT_DIR"

if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site \
    "$ROOT"/.whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

echo "$(date +%H:%M:%S) device_benchmark: writing $OUT_DIR"
timeout "${MFU_TIMEOUT_S:-470}" python3 -m hyperprompt_jax.benchmark --mfu \
  --model=t5_1_1_base --dtype=bfloat16 --batch_size=32 --input_length=512 \
  --target_length=32 --warmup_steps=3 --steps=5 --forms=both --profile=mtl \
  --output_json="$OUT_DIR/mfu.json" "$@" 2>&1 | tee "$OUT_DIR/mfu.log"
