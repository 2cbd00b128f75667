# Shared by benchmarks/gpu_check.sh and benchmarks/gpu_speed.sh (sourced, not run): their options,
# environment, wheel install, time-limited steps and final table.
#
# The sourcing script sets KIT_NAME (gpu_check, gpu_speed) and STEPS, its step table:
# "name=GPU:DRY" in the order the steps run, each step's limit in seconds on the GPU node at the
# default budget and in a dry run on a CPU at the dry-run budget (tests/cli/test_gpu_kit.py checks
# that each column and RESERVE add up to at most BUDGET_DEFAULT and DRY_BUDGET), then sources this
# file and calls kit_start "$@". Options:
#   --out DIR        results folder (default: a new NAME-<UTC time> folder in the working directory);
#                    it must be new or empty: nothing of the user's is overwritten
#   --budget SECONDS the whole script's time (default BUDGET_DEFAULT, DRY_BUDGET with --dry-run);
#                    each step's limit scales with it and is cut to what is left
#   --dry-run        on a CPU: every step shrunk, CUDA-only parts skipped by the tests themselves
# Outputs in the --out folder: results.json (rewritten after every step: what finished survives a cut-off),
# table.md (the final table, naming the steps cut), NAME.log (the steps' headers and statuses)
# and logs/STEP.log (each step's own output).

BUDGET_DEFAULT=300 # seconds for a whole script on the GPU node, installs and compiles included
RESERVE=15         # seconds kept out of the steps: start-up before the first one and the final table
DRY_BUDGET=360     # the default budget of --dry-run on a CPU

kit_usage() {
    sed -n '2,/^set -/p' "$KIT_SCRIPT" | sed '$d' | sed 's/^# \{0,1\}//'
}

kit_start() {
    KIT_SCRIPT=${BASH_SOURCE[1]}
    ROOT=$(cd "$(dirname "$KIT_SCRIPT")/.." && pwd)
    DRY=0
    OUTDIR=
    BUDGET=
    while [ $# -gt 0 ]; do
        case $1 in
        --out) OUTDIR=${2:?--out needs a folder}; shift 2 ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift 2 ;;
        --dry-run) DRY=1; shift ;;
        -h | --help) kit_usage; exit 0 ;;
        *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        esac
    done
    BUDGET=${BUDGET:-$([ $DRY = 1 ] && echo "$DRY_BUDGET" || echo "$BUDGET_DEFAULT")}
    case $BUDGET in '' | *[!0-9]*) echo "error: --budget takes whole seconds, got '$BUDGET'" >&2; exit 2 ;; esac
    if [ -z "$OUTDIR" ]; then
        OUTDIR=$(mktemp -d "$PWD/$KIT_NAME-$(date -u +%Y%m%dT%H%M%SZ)-XXXX") || exit 2
    elif [ -L "$OUTDIR" ] || { [ -e "$OUTDIR" ] && [ -n "$(ls -A "$OUTDIR" 2>/dev/null)" ]; }; then
        echo "error: --out $OUTDIR exists and is not an empty folder; name a new one" >&2
        exit 2
    fi
    mkdir -p "$OUTDIR/logs" || exit 2
    OUTDIR=$(cd "$OUTDIR" && pwd)
    cd "$ROOT" || exit 2
    START=$(date +%s)
    PY=${PYTHON:-python3}
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/$KIT_NAME.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
    RESULTS=$OUTDIR/results.json
    LOG=$OUTDIR/$KIT_NAME.log
    : >"$LOG"
    export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
    export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 MPLBACKEND=Agg
    export HF_HOME=$WORK/hf HF_DATASETS_CACHE=$WORK/hf/datasets MERIT_CACHE_DIR=$WORK/cache
    export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor TRITON_CACHE_DIR=$WORK/triton
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
    if [ $DRY = 1 ]; then
        MODE="DRY RUN on CPU (every step shrunk; CUDA-only tests skip)"
        DEVICE=cpu
    else
        MODE="GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
        DEVICE=cuda
    fi
    "$PY" benchmarks/gpu_kit.py start "$RESULTS" --script "$KIT_NAME" --mode "$MODE" --budget "$BUDGET"
    kit_say "$KIT_NAME: $MODE, $(date -u +%FT%TZ), budget $BUDGET s, results in $OUTDIR"
    "$PY" - >>"$LOG" 2>&1 <<'EOF'
import importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("torch", "triton", "transformers", "liger-kernel", "lm-eval", "datasets", "pytorch-optimizer", "tomli-w"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
EOF
}

kit_say() { echo "$*" | tee -a "$LOG"; }
kit_elapsed() { echo $(($(date +%s) - START)); }

# The step's limit: its STEPS entry (GPU or dry-run column) scaled by the budget over its default.
kit_limit() {
    local entry seconds base
    for entry in "${STEPS[@]}"; do
        if [ "${entry%%=*}" = "$1" ]; then
            seconds=${entry#*=}
            if [ $DRY = 1 ]; then seconds=${seconds#*:} base=$DRY_BUDGET; else seconds=${seconds%:*} base=$BUDGET_DEFAULT; fi
            echo $(((seconds * BUDGET + base - 1) / base))
            return
        fi
    done
    echo "kit_limit: no step '$1' in STEPS" >&2
    exit 3
}

# kit_record STEP STATUS SECONDS LIMIT ROWS_FILE SUMMARY
kit_record() {
    "$PY" benchmarks/gpu_kit.py record "$RESULTS" "$1" "$2" "$3" "$4" ${5:+--rows "$5"} --summary "$6" >>"$LOG" 2>&1
}

# kit_step NAME ROWS_FILE SUMMARY_FUNCTION CMD...: CMD under the step's limit, cut to the budget
# left (RESERVE kept for the table); output to logs/NAME.log; then records the step with its rows
# (ROWS_FILE, '-' for none) and the line SUMMARY_FUNCTION prints ('-' for none; it gets the log).
# With KIT_REST=1 the step is one that runs only if time is left: it starts only when its table
# limit is left, and then may use all that is left. Sets STATUS.
kit_step() {
    local name=$1 rows=$2 summarize=$3
    shift 3
    [ "$rows" = - ] && rows=
    local limit left t0 rc taken summary=
    limit=$(kit_limit "$name")
    left=$((BUDGET - RESERVE - $(kit_elapsed)))
    if [ "${KIT_REST:-0}" = 1 ] && [ "$left" -ge "$limit" ]; then
        limit=$left
    elif [ "${KIT_REST:-0}" = 1 ] || [ "$left" -lt 5 ]; then
        STATUS="skipped (budget spent)"
        kit_say "=== $name: skipped, $(kit_elapsed) s of the $BUDGET s budget used"
        kit_record "$name" "$STATUS" 0 "$limit" "" "not run: the budget was spent"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local cmd="$*"
    kit_say "=== $name (limit $limit s, at $(kit_elapsed) s): ${cmd:0:200}"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$OUTDIR/logs/$name.log" 2>&1
    rc=$?
    taken=$(($(date +%s) - t0))
    case $rc in
    0) STATUS=ok ;;
    124 | 137) STATUS="timed out (limit $limit s)" ;;
    *) STATUS="failed (rc $rc)" ;;
    esac
    [ "$summarize" != - ] && summary=$("$summarize" "$OUTDIR/logs/$name.log" 2>/dev/null | head -1)
    [ -z "$summary" ] && [ "$STATUS" != ok ] && summary="see logs/$name.log: $(grep -v '^\s*$' "$OUTDIR/logs/$name.log" | tail -1 | cut -c1-160)"
    kit_say "=== $name: $STATUS after $taken s${summary:+: $summary}"
    kit_record "$name" "$STATUS" "$taken" "$limit" "$rows" "$summary"
}

# The wheels of .gpu-wheels/ into a folder on PYTHONPATH (pip --no-index --no-deps --target), once
# per wheel set: fetch_gpu_wheels.sh already unpacks them into .gpu-wheels/site-cpXY, and a run
# with the same wheels reuses that folder. A dry run checks the same folder for CPython 3.12 (the
# node's Python) but keeps its own environment.
kit_wheels() {
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        STATUS="failed (no wheels)"
        kit_say "=== wheels: none in $WHEELS: run benchmarks/fetch_gpu_wheels.sh where there is internet"
        kit_record wheels "$STATUS" 0 "$(kit_limit wheels)" "" "no $WHEELS/*.whl: run benchmarks/fetch_gpu_wheels.sh first"
        return
    fi
    local target=(--python-version 3.12 --implementation cp --only-binary=:all:) tag=cp312
    if [ $DRY = 0 ]; then
        target=()
        tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    fi
    SITE=$WHEELS/site-$tag
    local stamp
    stamp=$(cd "$WHEELS" && ls *.whl | sha256sum | cut -c1-16) # as fetch_gpu_wheels.sh writes it
    if [ "$(cat "$SITE/.installed" 2>/dev/null)" = "$stamp" ]; then
        kit_say "=== wheels: installed before in $SITE (same wheels)"
        kit_record wheels ok 0 "$(kit_limit wheels)" "" "$(ls "$WHEELS"/*.whl | wc -l) wheels, installed before in $SITE"
    else
        rm -rf "$SITE"
        kit_step wheels - - "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "${target[@]}" \
            --target "$SITE" "$WHEELS"/*.whl
        [ "$STATUS" = ok ] && echo "$stamp" >"$SITE/.installed"
    fi
    # On the node the wheels complete the image; a dry run keeps its environment (its Python may differ).
    [ $DRY = 0 ] && export PYTHONPATH=$PYTHONPATH:$SITE
}

kit_finish() {
    "$PY" benchmarks/gpu_kit.py table "$RESULTS" >"$OUTDIR/table.md" 2>>"$LOG"
    echo >>"$LOG"
    tee -a "$LOG" <"$OUTDIR/table.md"
    kit_say "$KIT_NAME: $(kit_elapsed) s in all (budget $BUDGET s); results in $OUTDIR"
}
