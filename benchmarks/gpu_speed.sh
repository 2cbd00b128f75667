#!/usr/bin/env bash
# Speed of merit on one GPU node without internet, side by side in one run, in at most 5 minutes
# (installs and compiles included). Where there is internet, once:
#
#   bash benchmarks/fetch_gpu_wheels.sh          # the wheels the node's image lacks -> .gpu-wheels/
#
# then copy the repository, .gpu-wheels/ included, to the node and run there, from its root:
#
#   bash benchmarks/gpu_speed.sh [--out DIR] [--budget SECONDS]
#   bash benchmarks/gpu_speed.sh --dry-run       # on a CPU: every step shrunk (a few minutes)
#
# and read the table it prints last (also table.md in the --out folder; rows in results.json, each step's
# output in logs/). Run benchmarks/gpu_check.sh first: speed means little before the checks
# pass. Steps, each under the limit of the step table below (scaled to --budget, cut to the time
# left; a step that fails or is cut is named in the table):
#   wheels              .gpu-wheels/ installed into a folder on PYTHONPATH (reused by a second run)
#   optimizer-step      benchmarks/optimizer_step.py on GPT-2 small and Llama-3.2-1B shapes, fp32 and
#                       bf16: fused AdamW, every MERIT backend, and the Triton backend at its
#                       previous warps per program next to its current ones
#   throughput-gpt2     benchmarks/train_throughput.py, gpt2-small 64 x 1024 (micro-batch 16):
#                       plain HF compiled, merit default (MERIT), merit default (AdamW), merit eager
#                       (MERIT); tokens/s, ratio to plain compiled, MFU with attention FLOPs, peak
#                       memory; each row is kept as soon as it is measured
#   throughput-llama    the same for llama-1b 16 x 2048, only when its table time is left
# What it does not do: the paper's comparison of optimizers on loss (benchmarks/gpu_compare.sh).
set -uo pipefail

KIT_NAME=gpu_speed
# step=seconds on the GPU node:seconds in a dry run on a CPU (each column's sum + RESERVE <= its budget)
STEPS=(
    wheels=20:20
    optimizer-step=60:60
    throughput-gpt2=175:200
    throughput-llama=30:60
)
source "$(dirname "$0")/gpu_kit.sh"
kit_start "$@"

LOOPS="plain compiled (adamw),merit default (merit),merit default (adamw),merit eager (merit)"
if [ $DRY = 1 ]; then # shrunk: tiny models, one timed step; the plain compiled loop traces without inductor
    OPT=(--device cpu --models tiny --steps 2 --warmup 1)
    GPT2=(--device cpu --models gpt2-tiny --micro-batch-size 4 --rounds 1 --steps 1 --warmup 1 --compile-backend eager)
    LLAMA=(--device cpu --models llama-tiny --micro-batch-size 4 --rounds 1 --steps 1 --warmup 1 --compile-backend eager)
else
    OPT=(--device cuda --models gpt2-small,llama-3.2-1b)
    GPT2=(--device cuda --models gpt2-small --micro-batch-size 16)
    LLAMA=(--device cuda --models llama-1b --micro-batch-size 8)
fi

kit_wheels

optimizer_summary() { # MERIT()'s default and the Triton backend's previous warps, per model and dtype
    "$PY" - "$WORK/optimizer.json" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
keep = [r for r in rows if r["optimizer"] == "MERIT() default" or r["optimizer"].startswith("MERIT('triton') warps")]
print("; ".join(f"{r['model']} {r['dtype']} {r['optimizer']} {r['ms']:.2f} ms ({r['x_fused_adamw']:.2f}x fused AdamW)" for r in keep))
PYEOF
}
kit_step optimizer-step "$WORK/optimizer.json" optimizer_summary \
    "$PY" benchmarks/optimizer_step.py "${OPT[@]}" --json "$WORK/optimizer.json"

throughput_summary() {
    "$PY" - "$2" <<'PYEOF'
import json, sys
rows = json.load(open(sys.argv[1]))
f = lambda r: f"{r['loop']} {r['tokens_per_s']:,.0f} tok/s" + (f" ({r['vs_plain_compiled']:.2f}x)" if r.get("vs_plain_compiled") else "")
print("; ".join(f(r) if "error" not in r else f"{r['loop']} FAILED" for r in rows))
PYEOF
}
gpt2_summary() { throughput_summary "$1" "$WORK/throughput-gpt2.json"; }
llama_summary() { throughput_summary "$1" "$WORK/throughput-llama.json"; }
kit_step throughput-gpt2 "$WORK/throughput-gpt2.json" gpt2_summary \
    "$PY" benchmarks/train_throughput.py "${GPT2[@]}" --loops "$LOOPS" --json "$WORK/throughput-gpt2.json"
KIT_REST=1 kit_step throughput-llama "$WORK/throughput-llama.json" llama_summary \
    "$PY" benchmarks/train_throughput.py "${LLAMA[@]}" --loops "$LOOPS" --json "$WORK/throughput-llama.json"

kit_finish
