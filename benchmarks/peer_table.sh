#!/usr/bin/env bash
# This trainer beside torchtitan 0.2.2 on one GPU, as a table with the ratios (tokens/s and peak reserved
# memory, ours over theirs). Needs the peer kit: `bash ../shared/peers/gpu/prepare.sh` on a machine with
# pip (it fills .gpu-kit/), then on the GPU machine, from the project's root:
#
#   bash benchmarks/peer_table.sh                       # 8B blocks bf16 + float8, 1B: about 7 minutes on an H200
#   ROWS="8b_sel 8b_full 8b_none 8b_rowwise moe" bash benchmarks/peer_table.sh
#
# Each run trains STEPS (20) steps, compiled; the figures are the median tokens/s of steps 11 on and the
# peak reserved GiB of the run, as the kit's gpu_run.sh prints them. Logs go to $OUT.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/gpu-kit-out} STEPS=${STEPS:-20}
ROWS=${ROWS:-8b_sel 8b_f8 1b_sel}
SEL_T="--compile.enable --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
F8_T="--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output"
OURS="training.compile=true model.tie_embeddings=false"
row() {  # name, shape (8b | 1b | moe), torchtitan flags, our overrides
  local name=$1 shape=$2 tt=$3 ours=$4 env
  case $shape in
    8b) env="SEQ=8192 BS=1 FLAVOR=8B_l8 MODEL=llama3_8b"; ours="$ours model.n_layers=8" ;;
    1b) env="SEQ=4096 BS=4 FLAVOR=1B MODEL=llama3_1b" ;;
    moe) env="SEQ=4096 BS=4 TT_MODEL=deepseek_v3 FLAVOR=16B_l4 MODEL=deepseek_v2_lite"; ours="$ours model.n_layers=4" ;;
  esac
  env $env bash .gpu-kit/gpu_run.sh sbs "titan $name $tt" "ours $name $OURS $ours" | tee -a $OUT/table_runs.txt
}
: > $OUT/table_runs.txt
for r in $ROWS; do
  case $r in
    8b_sel) row $r 8b "$SEL_T" "training.activation_checkpoint=selective" ;;
    8b_f8) row $r 8b "$SEL_T $F8_T" "training.activation_checkpoint=selective training.float8.enabled=true" ;;
    8b_rowwise) row $r 8b "$SEL_T $F8_T --quantize.linear.float8.recipe_name rowwise" \
      "training.activation_checkpoint=selective training.float8.enabled=true training.float8.recipe=rowwise" ;;
    8b_full) row $r 8b "--compile.enable --activation_checkpoint.mode full" "training.activation_checkpoint=full" ;;
    8b_none) row $r 8b "--compile.enable --activation_checkpoint.mode none" "training.activation_checkpoint=none" ;;
    1b_sel) row $r 1b "$SEL_T" "training.activation_checkpoint=selective" ;;
    moe) row $r moe "$SEL_T" "training.activation_checkpoint=selective" ;;
    *) echo "unknown row $r" ;;
  esac
done
python3 - $OUT/table_runs.txt <<'PY'
import re, sys
runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"(titan|ours) (\S+): .*median ([\d,]+) tok/s.*peak ([\d.]+) GiB", line)
    if m:
        runs[m[1], m[2]] = (int(m[3].replace(",", "")), float(m[4]))
print("| run | torchtitan 0.2.2 tok/s, GiB | this trainer tok/s, GiB | speed | memory |\n|---|---|---|---|---|")
for name in dict.fromkeys(n for _, n in runs):
    tt, us = runs.get(("titan", name)), runs.get(("ours", name))
    cell = lambda r: f"{r[0]:,}, {r[1]:.2f}" if r else "failed"
    ratio = lambda i: f"{us[i] / tt[i]:.2f}x" if tt and us else "-"
    print(f"| {name} | {cell(tt)} | {cell(us)} | {ratio(0)} | {ratio(1)} |")
PY
