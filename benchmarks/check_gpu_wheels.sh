#!/usr/bin/env bash
# Check, on a machine with internet and no GPU, that the fetched wheels are enough for merit on a
# node that has only its image: build a virtual environment holding exactly the image's packages
# (benchmarks/gpu_image_packages.txt, linked from this environment: torch CPU instead of CUDA),
# fetch the wheels for this Python (fetch_gpu_wheels.sh --python-version), install them with
# `pip install --no-index --no-deps` as on the node, then run `merit train --steps 2`,
# `merit inspect` and `merit eval` on a local task, offline. Not part of the test suite (it
# downloads); a few minutes.
#
#   PYTHON=/path/to/merit-env/bin/python bash benchmarks/check_gpu_wheels.sh [--keep]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
KEEP=0
[ "${1:-}" = "--keep" ] && KEEP=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/check_gpu_wheels.XXXXXX")
[ $KEEP = 1 ] || trap 'rm -rf "$WORK"' EXIT
PYVER=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
step() { echo; echo "=== $*"; }

step "fetch the wheels for CPython $PYVER"
PYTHON=$PYTHON bash "$ROOT/benchmarks/fetch_gpu_wheels.sh" --python-version "$PYVER" --dest "$WORK/wheels" | tail -1

step "an environment with the image's packages only"
"$PYTHON" -m venv "$WORK/image"
IMAGE_PY=$WORK/image/bin/python
SITE=$("$IMAGE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$PYTHON" "$ROOT/benchmarks/gpu_wheels.py" --link-image "$SITE"
echo "before the wheels: $("$IMAGE_PY" -c 'from merit_core.extras import missing_cli_modules as m; print("missing", ", ".join(m()) or "nothing")' 2>&1 | tail -1)" 2>&1 || true

step "install the wheels as on the node: pip install --no-index --no-deps"
"$IMAGE_PY" -m pip install --quiet --no-index --no-deps "$WORK/wheels"/*.whl
"$IMAGE_PY" -m pip list --format=freeze 2>/dev/null | wc -l | xargs echo "distributions in the environment:"
"$IMAGE_PY" -m pip check || echo "(pip check: the lines above are requirements the image's own packages declare)"

export PYTHONPATH=$ROOT HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HOME=$WORK/hf
export MERIT_CACHE_DIR=$WORK/cache MPLBACKEND=Agg TOKENIZERS_PARALLELISM=false
cd "$WORK"
step "merit train --steps 2"
"$IMAGE_PY" -m merit_cli train --model gpt2-tiny --steps 2 --batch-size 4 --seq-len 64 --eval-every 0 \
    --device cpu --out "$WORK/run"
step "merit inspect"
"$IMAGE_PY" -m merit_cli inspect "$WORK/run"
step "merit eval on a local task"
"$IMAGE_PY" "$ROOT/benchmarks/gpu_kit.py" local-tasks "$WORK/tasks"
CKPT=$(ls -d "$WORK"/run/step_* | tail -1)
"$IMAGE_PY" -m merit_cli eval "$CKPT" --tasks harbour_lambada,harbour_wiki --include-path "$WORK/tasks" --trust-task-code \
    --device cpu --limit 3 --bootstrap-iters 0 -o "$WORK/eval.json"
echo
echo "check_gpu_wheels: OK (CPython $PYVER, $(ls "$WORK/wheels"/*.whl | wc -l) wheels on the image's packages)"
