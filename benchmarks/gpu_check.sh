#!/usr/bin/env bash
# Correctness of merit's CUDA paths on one GPU node without internet, in at most 5 minutes
# (installs and compiles included). Where there is internet, once:
#
#   bash benchmarks/fetch_gpu_wheels.sh          # the wheels the node's image lacks -> .gpu-wheels/
#
# then copy the repository, .gpu-wheels/ included, to the node and run there, from its root:
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--budget SECONDS]
#   bash benchmarks/gpu_check.sh --dry-run       # on a CPU: every step shrunk (a few minutes)
#
# and read the table it prints last (also table.md in the --out folder; rows of every step in results.json,
# each step's output in logs/). Steps, in order of importance, each under the limit of the
# step table below (scaled to --budget, cut to the time left; a step that fails or is cut is
# named in the table and the next one runs):
#   wheels            .gpu-wheels/ installed into a folder on PYTHONPATH (reused by a second run)
#   merit-check       `merit check --json`: every MERIT backend on this GPU against a float64
#                     reference step, the state_dict round trip, one compiled training step
#                     (docs/CHECK.md; in a dry run its short form on the CPU)
#   pytest-gpu        `pytest -m gpu`: tests/gpu (training, the probe, eval on CUDA; the Triton
#                     backend against the reference at GPT-2 small and Llama-3.2-1B shapes, a
#                     tall matrix of many row-tile chunks, a tensor past 2**31 elements, the
#                     NaN/Inf table for every backend) and every other gpu-marked test
#   kernel-resources  registers, spills and occupancy of each Triton kernel at the warps the
#                     backend launches, as this GPU's Triton compiles it (kernel_resources.py)
#   train-*           20 bf16 steps of gpt2-small with MERIT, AdamW and LAMB, compile=auto, and of
#                     llama-130m with kernels=liger: tokens/s, loss, how it compiled, graphs,
#                     graph breaks and recompiles (TORCH_LOGS=recompiles)
#   eval-*            `merit eval` of the MERIT run's checkpoint on a local task in float32 and in
#                     bfloat16; the table says whether they agree
set -uo pipefail

KIT_NAME=gpu_check
# step=seconds on the GPU node:seconds in a dry run on a CPU (each column's sum + RESERVE <= its budget)
STEPS=(
    wheels=20:10
    merit-check=40:30
    pytest-gpu=75:70
    kernel-resources=20:20
    train-merit=35:45
    train-adamw=20:40
    train-lamb=20:40
    train-liger-llama=25:40
    eval-fp32=15:25
    eval-bf16=15:25
)
source "$(dirname "$0")/gpu_kit.sh"
kit_start "$@"

if [ $DRY = 1 ]; then # shrunk: the same code paths, minutes on a CPU
    MODEL=gpt2-tiny LLAMA=llama-tiny BATCH=4 LLAMA_BATCH=4 SEQ=64 STEPS_N=2 VOCAB=1024 DTYPE=float32 EVAL_LIMIT=(--limit 3)
    CHECK=(--quick)
    KERNELS=(--chosen-only --arch 90 --limit 2)
    cat "$ROOT"/docs/*.md "$ROOT"/README.md >"$WORK/text.txt" # a small corpus: its BPE trains in seconds
    DATA=(--data "$WORK/text.txt")
else
    MODEL=gpt2-small LLAMA=llama-130m BATCH=32 LLAMA_BATCH=32 SEQ=1024 STEPS_N=20 VOCAB=50257 DTYPE=bfloat16 EVAL_LIMIT=()
    CHECK=()
    KERNELS=(--chosen-only --arch device)
    DATA=() # the built-in corpus
fi

kit_wheels

check_summary() { # the verdict line of the report: all rows ok, or the one line to report
    "$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); print(r['failure'] or f\"all {len(r['rows'])} rows ok in {r['seconds']:.0f} s on {r['device']}\")" \
        "$WORK/check.json" 2>/dev/null || tail -1 "$1"
}
kit_step merit-check "$WORK/check.json" check_summary \
    bash -c '"$1" -m merit_cli check --device "$2" --json "${@:4}" >"$3"' _ "$PY" $DEVICE "$WORK/check.json" "${CHECK[@]}"

pytest_summary() { grep -E "[0-9]+ (passed|failed|skipped|error)" "$1" | tail -1 | tr -d '='; }
kit_step pytest-gpu "$WORK/pytest.json" pytest_summary \
    bash -c '"$1" -m pytest -q -m gpu -rfEs -p no:cacheprovider --junitxml="$2" tests; rc=$?;
             "$1" benchmarks/gpu_kit.py junit "$2" "$3"; exit $rc' _ "$PY" "$WORK/pytest.xml" "$WORK/pytest.json"

kernels_summary() { grep -c "^  pass\|^  finalize" "$1" | xargs -I{} echo "{} kernels compiled; spills (local/stack bytes) in the rows below"; }
kit_step kernel-resources "$WORK/kernels.json" kernels_summary \
    "$PY" benchmarks/kernel_resources.py "${KERNELS[@]}" --json "$WORK/kernels.json"

train_summary() {
    local recompiles
    recompiles=$(grep -c "Recompiling function" "$1")
    "$PY" - "$OUTDIR/train/$(basename "${1%.log}").json" "$recompiles" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda v, spec: "-" if v is None else format(v, spec)
print(f"{r['model']} {r['n_params'] / 1e6:.0f}M {r['optimizer']} {r['batch']} (micro {r['micro_batch_size']}) {r['dtype']}: "
      f"{f(r['tokens_per_s'], ',.0f')} tok/s, loss {f(r['final_loss'], '.3f')}, {r['compile']}, kernels={r['kernels']}, "
      f"{r['graphs']} graphs, {r['graph_breaks']} graph breaks, {sys.argv[2]} recompiles")
EOF
}
mkdir -p "$OUTDIR/train"
train() { # train STEP MODEL OPTIMIZER BATCH KERNELS
    export TORCH_LOGS=recompiles # each recompilation logged with its reason: counted in the summary
    kit_step "$1" "$OUTDIR/train/$1.json" train_summary \
        "$PY" benchmarks/gpu_check_train.py --optimizer "$3" --model "$2" --batch-size "$4" --seq-len $SEQ \
        --steps $STEPS_N --log-every 5 --vocab-size $VOCAB --device $DEVICE --dtype $DTYPE --compile auto \
        --kernels "$5" "${DATA[@]}" --out "$WORK/run-$1" --json "$OUTDIR/train/$1.json"
    unset TORCH_LOGS
}
train train-merit $MODEL merit $BATCH auto
train train-adamw $MODEL adamw $BATCH auto
train train-lamb $MODEL lamb $BATCH auto
if [ $DRY = 1 ]; then # Liger's kernels are Triton kernels for CUDA: on a CPU the same run without them
    train train-liger-llama $LLAMA merit $LLAMA_BATCH none
else
    train train-liger-llama $LLAMA merit $LLAMA_BATCH liger
fi

"$PY" benchmarks/gpu_kit.py local-tasks "$WORK/tasks" >>"$LOG" 2>&1
CKPT=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['checkpoint'] or '')" "$OUTDIR/train/train-merit.json" 2>/dev/null)
eval_summary() {
    "$PY" - "$WORK" <<'EOF'
import json, sys
from pathlib import Path
got = {}
for dtype in ("float32", "bfloat16"):
    path = Path(sys.argv[1]) / f"eval-{dtype}.json"
    if path.is_file():
        r = json.loads(path.read_text())["checkpoints"][0]["results"]
        got[dtype] = (r["harbour_wiki"]["bits_per_byte,none"], r["harbour_lambada"]["perplexity,none"])
line = ", ".join(f"{d}: wiki bits/byte {b:.4f}, lambada ppl {p:.4g}" for d, (b, p) in got.items())
if len(got) == 2:
    (b32, p32), (b16, p16) = got["float32"], got["bfloat16"]
    rel = max(abs(b16 - b32) / b32, abs(p16 - p32) / p32)
    line += f"; bf16 vs fp32 {rel:.2%} apart: " + ("agree (within 2%)" if rel <= 0.02 else "DIFFER (over 2%)")
print(line)
EOF
}
for pair in eval-fp32:float32 eval-bf16:bfloat16; do
    step=${pair%:*} dtype=${pair#*:}
    if [ -z "$CKPT" ]; then
        kit_record "$step" "skipped (no checkpoint)" 0 "$(kit_limit "$step")" "" "the MERIT run left no checkpoint"
        continue
    fi
    kit_step "$step" - eval_summary "$PY" -m merit_cli eval "$CKPT" --tasks harbour_lambada,harbour_wiki \
        --include-path "$WORK/tasks" --trust-task-code --device $DEVICE --dtype $dtype --bootstrap-iters 0 "${EVAL_LIMIT[@]}" \
        -o "$WORK/eval-$dtype.json"
done

kit_finish
