#!/usr/bin/env bash
# The paper's experiment on one H200 node without internet, in about 10 minutes: the shipped
# comparison `compare-h200` (configs/compare-h200.toml: AdamW, LAMB and MERIT on the
# GPT-2 small shape and the built-in corpus, batch 16 and 128 x 1024, a 3-point lr grid around the
# measured defaults, compile on, max logit over steps, Hessians of the best runs). Where there is
# internet, once:
#
#   bash benchmarks/fetch_gpu_wheels.sh      # wheels the node's image lacks (LAMB's
#                                            # pytorch-optimizer, lm-eval, ...) -> .gpu-wheels/
#
# then copy the repository, .gpu-wheels/ included, to the node and run there, from its root:
#
#   bash benchmarks/gpu_compare.sh [--out DIR]
#   bash benchmarks/gpu_compare.sh --dry-run # on a CPU: the same spec shrunk to gpt2-tiny, no compile
#
# Resumable: the comparison lives in runs/compare-h200/ (ignored by git; GPU_COMPARE_DIR to move
# it). A run cut off by the budget (GPU_COMPARE_BUDGET seconds, default 540) stops the comparison
# cleanly; running it again on the same node skips finished runs, resumes unfinished ones from
# their last checkpoint and then writes the outputs. Into the --out folder (default: a new
# gpu_compare-<UTC time> folder in the working directory): REPORT.md, summary.json, compare.png
# (when the comparison finished), STATUS.md (finished or cut off, runs done, the command, commit
# and wall time), compare.log, wheels.log.
set -uo pipefail

DRY=0
OUTDIR=
while [ $# -gt 0 ]; do
    case $1 in
    --dry-run) DRY=1; shift ;;
    --out) OUTDIR=${2:?--out needs a folder}; shift 2 ;;
    *) echo "error: unknown option $1 (--dry-run, --out DIR)" >&2; exit 2 ;;
    esac
done
OUTDIR=${OUTDIR:-$(mktemp -d "$PWD/gpu_compare-$(date -u +%Y%m%dT%H%M%SZ)-XXXX")}
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd) || exit 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_COMPARE_BUDGET:-540}
WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
if [ $DRY = 1 ]; then
    STATE=${GPU_COMPARE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_compare_dry.XXXXXX")}
    # shrunk: gpt2-tiny, 32-token sequences, the same batch sizes and micro-batch, no compile
    ARGS=(--model gpt2-tiny --seq-len 32 --tokens 16384 --device cpu --jobs 2 --set compile=false)
else
    STATE=${GPU_COMPARE_DIR:-$ROOT/runs/compare-h200}
    ARGS=()
fi
START=$(date +%s)
mkdir -p "$STATE"
LOG=$OUTDIR/compare.log
: >"$LOG"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
export TRANSFORMERS_VERBOSITY=error TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 MPLBACKEND=Agg
# caches inside the state folder, so a second run also reuses the tokenized corpus and compiled kernels
export MERIT_CACHE_DIR=$STATE/cache TORCHINDUCTOR_CACHE_DIR=$STATE/inductor HF_HOME=$STATE/hf
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

say() { echo "$*" | tee -a "$LOG"; }
elapsed() { echo $(($(date +%s) - START)); }
say "gpu_compare: $([ $DRY = 1 ] && echo "DRY RUN on CPU" || echo "GPU run"), $(date -u +%FT%TZ), budget $BUDGET s, state $STATE"
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; } >>"$LOG" 2>&1

# -- wheels: LAMB needs pytorch-optimizer, which the node's image lacks (as in gpu_check.sh) -------
SITE=$STATE/site
: >"$OUTDIR/wheels.log"
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    if [ ! -f "$SITE/.installed" ]; then
        # the same command on the node and in a dry run: the target is Python 3.12 either way
        if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --only-binary=:all: \
            --python-version 3.12 --implementation cp --target "$SITE" "$WHEELS"/*.whl >>"$OUTDIR/wheels.log" 2>&1; then
            touch "$SITE/.installed"
            say "installed $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE"
        else
            say "wheel install failed (see wheels.log)"
        fi
    fi
    if [ $DRY = 0 ]; then # a dry run keeps its own environment (Python 3.11 here): the install is the check
        export PYTHONPATH=$PYTHONPATH:$SITE
    fi
else
    say "no $WHEELS/*.whl: run benchmarks/fetch_gpu_wheels.sh first (LAMB needs pytorch-optimizer)"
fi
if ! "$PY" -c "import pytorch_optimizer" >>"$OUTDIR/wheels.log" 2>&1; then
    say "error: pytorch_optimizer does not import, so LAMB cannot run; see wheels.log"
    exit 1
fi

# -- the comparison, under the budget left (30 s kept for the outputs) ---------------------------
CMD=("$PY" -m merit_cli compare compare-h200 --out "$STATE/out" "${ARGS[@]}")
LEFT=$((BUDGET - $(elapsed) - 30))
say "=== $(printf '%q ' "${CMD[@]}")(limit ${LEFT} s)"
# SIGTERM lets the comparison stop its runs at a checkpoint; SIGKILL 20 s later if it has not
timeout --kill-after=20 "$LEFT" "${CMD[@]}" >>"$LOG" 2>&1
RC=$?
case $RC in
0) STATE_LINE="finished" ;;
124 | 137) STATE_LINE="cut off by the budget after ${LEFT} s: run it again to continue" ;;
*) STATE_LINE="failed (rc $RC): see compare.log" ;;
esac
say "=== compare: $STATE_LINE after $(elapsed) s"

for f in REPORT.md summary.json compare.png; do
    if [ $RC = 0 ] && [ -f "$STATE/out/$f" ]; then cp "$STATE/out/$f" "$OUTDIR/$f"; fi
done
# run folders and how many of them finished (their last checkpoint is at their last step)
COUNTS=$("$PY" - "$STATE/out/runs" <<'EOF' 2>>"$LOG"
import sys
from pathlib import Path
from merit_core.checkpoint import runs
from merit_core.checkpoint.state import read_trainer_state
from merit_core.train.config import read_toml
folders = sorted(p for p in Path(sys.argv[1]).glob("*") if (p / "config.toml").is_file())
done = 0
for run in folders:
    ckpt = runs.latest(run)
    done += ckpt is not None and read_trainer_state(ckpt).step >= int(read_toml(run / "config.toml")["steps"])
print(len(folders), done)
EOF
)
read -r PLANNED DONE <<<"${COUNTS:-? ?}"
{
    echo "# gpu_compare: $STATE_LINE"
    echo
    echo "- mode: $([ $DRY = 1 ] && echo "DRY RUN on CPU (gpt2-tiny, shrunk; no CUDA)" || echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)")"
    echo "- command: \`$(printf '%q ' "${CMD[@]}" | sed "s|$STATE|\$STATE|g")\` (STATE=$STATE)"
    echo "- commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "- wall time of this run: $(elapsed) s (budget $BUDGET s)"
    echo "- run folders: $PLANNED, finished: $DONE"
    echo "- outputs: $([ $RC = 0 ] && echo "REPORT.md, summary.json, compare.png" || echo "none yet (they are written when every run and Hessian is done)")"
} >"$OUTDIR/STATUS.md"
cat "$OUTDIR/STATUS.md" | tee -a "$LOG"
[ $RC = 0 ] || [ $RC = 124 ] || [ $RC = 137 ]
