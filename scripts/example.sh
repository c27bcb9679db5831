#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main example: FP16 gradients clipped in a training loop,
# beside what naive FP16 clipping would have done.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
gradclip_install_missing "${GRADCLIP_BASE_PACKAGES[@]}"
cmake --preset default >/dev/null
cmake --build --preset default --target fp16_training -j "$(nproc)" >/dev/null
./build/default/examples/fp16_training
