#!/usr/bin/env bash
# CPU gloo smoke run of a recipe with the debug model: bash scripts/smoke_cpu.sh [RECIPE] [NPROC] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:-llama_hsdp}
nproc=${2:-4}
shift $(( $# < 2 ? $# : 2 ))
family=${recipe%%_*}
OMP_NUM_THREADS=1 exec torchrun --standalone --nproc_per_node="$nproc" train.py +recipe="$recipe" \
    model="${family}_debug" +smoke=cpu "$@"
