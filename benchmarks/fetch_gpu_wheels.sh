#!/usr/bin/env bash
# Download, on a machine with network, the wheels that benchmarks/gpu_check.sh installs on the
# offline GPU machine: the packages merit needs that its image lacks (it has torch, triton,
# transformers, tokenizers, safetensors, accelerate, peft, click, rich, pandas, pyarrow, ...).
#
#   bash benchmarks/fetch_gpu_wheels.sh            # -> .gpu-wheels/ (ignored by git)
#
# Only what `merit train` / `merit eval` / the tests import on the way is fetched (checked by
# listing the modules an offline `merit eval` of a local task and the optimizer registry load):
# lm-eval's other requirements (evaluate, pytablewriter, rouge-score, sqlitedict, word2number,
# more-itertools) are imported only by metrics and options merit does not use. The versions are
# those the project's CPU environment is tested with. The set must stay small: the device tool
# carries at most 64 MiB of ignored paths together with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
PYTHON=${PYTHON:-python3}
PACKAGES=(
    lm_eval==0.4.13
    datasets==5.2.0
    dill==0.4.1          # datasets: dill<0.4.2; multiprocess 0.70.19: dill>=0.4.1
    multiprocess==0.70.19
    pytorch_optimizer==4.1.0
)
LIMIT_MIB=40 # leaves room for the working tree under the device tool's 64 MiB

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$DEST" "${PACKAGES[@]}"

echo "fetched into $DEST:"
total=0
for wheel in "$DEST"/*.whl; do
    size=$(stat -c %s "$wheel")
    total=$((total + size))
    awk -v n="$(basename "$wheel")" -v b="$size" 'BEGIN { printf "  %-60s %8.2f MiB\n", n, b / 1048576 }'
done
awk -v b="$total" 'BEGIN { printf "  %-60s %8.2f MiB\n", "total", b / 1048576 }'
count=$(ls "$DEST"/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
    echo "error: expected ${#PACKAGES[@]} wheels, found $count (one version of each package only)" >&2
    exit 1
fi
if [ "$total" -gt $((LIMIT_MIB * 1048576)) ]; then
    echo "error: the wheels take more than $LIMIT_MIB MiB; the device tool carries 64 MiB in all" >&2
    exit 1
fi
