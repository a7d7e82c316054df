#!/usr/bin/env bash
# CPU gloo smoke run of a recipe with the debug model: bash scripts/smoke_cpu.sh [RECIPE] [NPROC] [overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
recipe=${1:-llama_hsdp}
nproc=${2:-4}
shift $(( $# < 2 ? $# : 2 ))
# The debug model of the recipe's model family (llama_debug when the recipe keeps the default model).
model=$(sed -n 's|^ *- override /model: *||p' "recipes/$recipe.yaml")
family=$(sed -n 's|^family: *||p' "configs/model/${model:-llama_debug}.yaml")
OMP_NUM_THREADS=1 exec torchrun --standalone --nproc_per_node="$nproc" train.py +recipe="$recipe" \
    model="${family}_debug" +smoke=cpu "$@"
