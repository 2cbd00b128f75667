#!/usr/bin/env bash
# The GPU check of issues 11 and 19, made to fit one 10-minute call of the device tool on one H200
# with no network (about 9 minutes with the machine's start-up). From the repository root:
#
#   bash benchmarks/fetch_gpu_wheels.sh     # here, once: wheels the GPU image lacks -> .gpu-wheels/
#   device tool: run(command="bash benchmarks/gpu_check.sh", carry=[".gpu-wheels"], timeout_s=600)
#   bash benchmarks/gpu_check.sh --dry-run  # on a CPU: the same steps, shrunk, CUDA-only parts skipped
#
# Steps, each under `timeout` (cut further to the time left of GPU_CHECK_BUDGET seconds, default
# 540), a failure logged and the next step run regardless, in order of importance:
#   1. install the carried wheels into a folder on PYTHONPATH (pip --no-index --no-deps --target);
#   2. `pytest -m gpu` (tests/gpu and any other test marked gpu);
#   3. benchmarks/train_throughput.py --device cuda: merit train's loop (default settings, and
#      eager) next to a minimal plain loop (eager, compiled) on gpt2-small 64 x 1024 and llama-1b
#      16 x 2048: tokens/s, ratio to the plain compiled loop, MFU (6N and 6N + attention), peak memory;
#   4. benchmarks/optimizer_step.py --device cuda (its failure is logged, not fatal), with the
#      Triton backend at its previous warps per program next to its current ones;
#   5. 100 steps of gpt2-small in bf16 at batch 64 x 1024 with MERIT on the built-in corpus (a BPE
#      trained offline on the standard library's docstrings): tokens/s, MFU, peak memory, final
#      loss, max attention logit, the micro-batch chosen;
#   6. `merit eval` of the MERIT run's checkpoint on a local task, in float32 and in bfloat16.
# It prints ONE table last (with the side-by-side rows). Logs and results go to $OUT (a temporary
# folder when unset), at most 8 files as the device tool returns them: gpu_check.log (everything,
# in order), pytest.log, throughput.log, optimizer.log, train.log, eval.log, results.json, table.md.
set -uo pipefail

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX")}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
BUDGET=${GPU_CHECK_BUDGET:-540}
START=$(date +%s)
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export HF_HOME=$WORK/hf HF_DATASETS_CACHE=$WORK/hf/datasets MERIT_CACHE_DIR=$WORK/cache
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

if [ $DRY = 1 ]; then # shrunk sizes: the same code paths, minutes on a CPU
    DEVICE=cpu MODEL=gpt2-tiny BATCH=4 SEQ=128 STEPS=2 EVAL_LIMIT=(--limit 3) PYTEST_LIMIT=240
    # the CPU's tiny model, one round, without the whole-model compile (minutes of C++ builds on a CPU)
    THROUGHPUT=(--device cpu --models gpt2-tiny --rounds 1 --steps 1 --warmup 1 --loops "merit default,merit eager,plain eager")
else
    DEVICE=cuda MODEL=gpt2-small BATCH=64 SEQ=1024 STEPS=100 EVAL_LIMIT=() PYTEST_LIMIT=120
    THROUGHPUT=(--device cuda)
fi

ROWS=() # "check|status|seconds|result"
say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }

# run NAME LIMIT LOGFILE CMD...: CMD under a time limit cut to the budget left (20 s kept for the
# table); sets STATUS (ok / failed (rc N) / timed out / skipped) and SECONDS_TAKEN; appends to LOGFILE.
run() {
    local name=$1 limit=$2 log=$3
    shift 3
    local left=$((BUDGET - $(elapsed) - 20))
    if [ $left -lt 15 ]; then
        STATUS="skipped (budget spent)" SECONDS_TAKEN=0
        say "=== $name: skipped, $(elapsed) s of the $BUDGET s budget used"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "=== $name (limit ${limit} s, at $(elapsed) s): $*"
    local t0
    t0=$(date +%s)
    echo "=== $name: $*" >>"$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log" >>"$LOG"
    local rc=${PIPESTATUS[0]}
    SECONDS_TAKEN=$(($(date +%s) - t0))
    case $rc in
    0) STATUS=ok ;;
    124 | 137) STATUS="timed out (${limit} s)" ;;
    *) STATUS="failed (rc $rc)" ;;
    esac
    say "=== $name: $STATUS after $SECONDS_TAKEN s"
}

row() { ROWS+=("$1|$2|$3|$4"); }

# -- 0. the machine -------------------------------------------------------------------------
say "gpu_check: $( [ $DRY = 1 ] && echo "DRY RUN on CPU" || echo "GPU run" ), $(date -u +%FT%TZ), budget $BUDGET s"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } >>"$LOG" 2>&1
"$PY" - >>"$LOG" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "triton", "transformers", "tokenizers", "accelerate", "pyarrow", "fsspec", "huggingface_hub",
             "numpy", "pandas", "lm_eval", "datasets", "pytorch_optimizer"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
EOF

# -- 1. wheels ------------------------------------------------------------------------------
SITE=$WORK/site
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    # The same command on the device and in a dry run: the target is Python 3.12 either way.
    run "install wheels" 60 /dev/null "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --only-binary=:all: --python-version 3.12 --implementation cp --target "$SITE" "$WHEELS"/*.whl
    row "install $(ls "$WHEELS"/*.whl | wc -l) wheels" "$STATUS" "$SECONDS_TAKEN" "$(du -sh "$WHEELS" | cut -f1) from $(basename "$WHEELS")"
    if [ $DRY = 0 ]; then # a dry run keeps its own environment (Python 3.11 here): the install is the check
        export PYTHONPATH=$PYTHONPATH:$SITE
    fi
else
    row "install wheels" "skipped" 0 "no $WHEELS/*.whl: run benchmarks/fetch_gpu_wheels.sh first"
fi

# -- 2. GPU tests ---------------------------------------------------------------------------
run "pytest -m gpu" $PYTEST_LIMIT "$OUT/pytest.log" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider \
    --continue-on-collection-errors tests
counts=$(grep -E "(passed|failed|skipped|deselected|error).* in [0-9.]+s" "$OUT/pytest.log" | tail -1 | tr -d '=')
row "pytest -m gpu" "$STATUS" "$SECONDS_TAKEN" "${counts:-no summary line (see pytest.log)}"

# -- 3. merit train's loop next to a plain loop ----------------------------------------------
run "train_throughput.py ${THROUGHPUT[*]}" 300 "$OUT/throughput.log" "$PY" benchmarks/train_throughput.py \
    "${THROUGHPUT[@]}" --json "$WORK/throughput.json"
row "side-by-side throughput" "$STATUS" "$SECONDS_TAKEN" "rows below this table (throughput.log: the printed table)"

# -- 4. optimizer step benchmark ------------------------------------------------------------
if [ $DRY = 1 ]; then
    run "optimizer_step.py --models tiny" 120 "$OUT/optimizer.log" "$PY" benchmarks/optimizer_step.py --models tiny --steps 2 --warmup 1
else
    run "optimizer_step.py --device cuda" 120 "$OUT/optimizer.log" "$PY" benchmarks/optimizer_step.py --device cuda
fi
# the default MERIT's line of the first model and dtype: ms/step, x fused AdamW, launches, floor, % floor
bench=$(grep -E "^ *MERIT\(\) default" "$OUT/optimizer.log" | head -1 | tr -s ' ' | cut -c1-140)
row "optimizer step benchmark" "$STATUS" "$SECONDS_TAKEN" "${bench:-see optimizer.log}"
# the Triton backend at its previous warps per program, timed in the same run (see benchmarks/README.md)
previous=$(grep -E "^ *MERIT\('triton'\) warps" "$OUT/optimizer.log" | head -1 | tr -s ' ' | cut -c1-140)
[ $DRY = 1 ] || row "Triton, previous warps" "$STATUS" 0 "${previous:-see optimizer.log}"

# -- 5. training (AdamW's loop speed is in the side-by-side rows) ----------------------------
for opt in merit; do
    run "train $MODEL $opt" 90 "$OUT/train.log" "$PY" benchmarks/gpu_check_train.py --optimizer $opt \
        --model $MODEL --batch-size $BATCH --seq-len $SEQ --steps $STEPS --device $DEVICE \
        --out "$WORK/run-$opt" --json "$WORK/train-$opt.json"
    summary=$("$PY" - "$WORK/train-$opt.json" <<'EOF' 2>/dev/null
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda v, spec: "-" if v is None else format(v, spec)
print(f"{r['n_params'] / 1e6:.1f}M params, {r['batch']} (micro {r['micro_batch_size']}), {r['dtype']}: "
      f"{f(r['tokens_per_s'], ',.0f')} tok/s, MFU {'-' if r['mfu'] is None else format(r['mfu'], '.1%')}, "
      f"peak {f(r['peak_memory_gib'], '.1f')} GiB, loss {f(r['final_loss'], '.3f')}, "
      f"max logit {f(r['max_attention_logit'], '.2f')}")
EOF
    )
    row "train $MODEL $opt x$STEPS" "$STATUS" "$SECONDS_TAKEN" "${summary:-see train.log}"
done

# -- 6. merit eval of the MERIT checkpoint on a local task ----------------------------------
TASKS=$WORK/tasks
"$PY" - "$TASKS" >>"$LOG" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
from tests.eval.test_eval import LAMBADA_LINES, WIKI_PAGES, lambada_yaml, wiki_yaml
root = Path(sys.argv[1]); root.mkdir(parents=True, exist_ok=True)
(root / "harbour_lambada.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in LAMBADA_LINES))
(root / "harbour_wiki.jsonl").write_text("".join(json.dumps({"page": p}) + "\n" for p in WIKI_PAGES))
(root / "harbour_lambada.yaml").write_text(lambada_yaml("harbour_lambada", root / "harbour_lambada.jsonl"))
(root / "harbour_wiki.yaml").write_text(wiki_yaml("harbour_wiki", root / "harbour_wiki.jsonl"))
print("local tasks in", root)
EOF
CKPT=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['checkpoint'] or '')" "$WORK/train-merit.json" 2>/dev/null)
for dtype in float32 bfloat16; do
    if [ -z "$CKPT" ]; then
        row "merit eval $dtype" "skipped" 0 "no checkpoint from the MERIT run"
        continue
    fi
    run "merit eval $dtype" 60 "$OUT/eval.log" "$PY" -m merit_cli eval "$CKPT" --tasks harbour_lambada,harbour_wiki \
        --include-path "$TASKS" --device $DEVICE --dtype $dtype --bootstrap-iters 0 "${EVAL_LIMIT[@]}" \
        -o "$WORK/eval-$dtype.json"
    scores=$("$PY" - "$WORK/eval-$dtype.json" <<'EOF' 2>/dev/null
import json, sys
c = json.load(open(sys.argv[1]))["checkpoints"][0]
r = c["results"]
print(f"meta dtype {c['meta']['eval']['dtype']}: wiki bits/byte {r['harbour_wiki']['bits_per_byte,none']:.4f}, "
      f"lambada ppl {r['harbour_lambada']['perplexity,none']:.4g} acc {r['harbour_lambada']['acc,none']:.2f}")
EOF
    )
    row "merit eval $dtype" "$STATUS" "$SECONDS_TAKEN" "${scores:-see eval.log}"
done

# -- results --------------------------------------------------------------------------------
"$PY" - "$WORK" "$OUT/results.json" >>"$LOG" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
out = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("*.json"))}
Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
EOF
{
    echo "| check | status | s | result |"
    echo "|---|---|---:|---|"
    for r in "${ROWS[@]}"; do
        IFS='|' read -r a b c d <<<"$r"
        echo "| $a | $b | $c | $d |"
    done
    echo
    "$PY" - "$WORK/throughput.json" <<'EOF' 2>/dev/null
import json, sys
rows = json.load(open(sys.argv[1]))
pct = lambda v: "-" if v is None else f"{v:.1%}"
print("| model | loop | tokens/s | vs plain compiled | MFU (6N+attn) | MFU (6N) | peak GiB | cold s | micro |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    if "error" in r:
        print(f"| {r['model']} | {r['loop']} | {r['error']} | | | | | | |")
        continue
    base = next((b["tokens_per_s"] for b in rows if b["model"] == r["model"] and b["loop"] == "plain compiled" and "error" not in b), None)
    loop = r["loop"] + (f" (compile={r['compile']}, kernels={r['kernels']})" if "compile" in r else "")
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
    print(f"| {r['model']} ({r['n_params'] / 1e6:.1f}M, {r['batch']}) | {loop} | {r['tokens_per_s']:,.0f} | {ratio} | "
          f"{pct(r['mfu'])} | {pct(r['mfu_6n'])} | {r['peak_memory_gib']:.1f} | {r['cold_s']:.0f} | {r['micro']} |")
EOF
    echo
    echo "total $(elapsed) s of a $BUDGET s budget; $( [ $DRY = 1 ] && echo "DRY RUN on CPU (shrunk sizes, no CUDA)" || echo "device: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" ); logs in $OUT"
} >"$OUT/table.md"
echo >>"$LOG"
cat "$OUT/table.md" | tee -a "$LOG"
rm -rf "$WORK"
