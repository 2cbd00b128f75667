#!/usr/bin/env bash
# Download, on a machine with internet, the wheels an offline GPU node needs besides its image:
# merit's [cli] and [gpu] extras and everything they require, minus what the image ships
# (benchmarks/gpu_image_packages.txt), each at the version installed in the environment that runs
# this script, the one the test suite passes in (benchmarks/gpu_wheels.py derives the set).
#
#   bash benchmarks/fetch_gpu_wheels.sh                        # -> .gpu-wheels/ (ignored by git)
#   bash benchmarks/fetch_gpu_wheels.sh --python-version 3.11  # for a node (or a check) on 3.11
#   bash benchmarks/fetch_gpu_wheels.sh --dest DIR
#
# Run it with the Python of a merit environment (PYTHON=..., default python3, with merit-optim[cli,gpu]
# installed). Wheels are for CPython on manylinux x86-64; a package published only as a source
# archive is built here into a wheel, which must be pure Python (py3-none-any). It fails if any
# package of the set is missing from DEST at the end. Last, the wheels are unpacked for that
# Python into DEST/site-cpXY (pip install --no-index --no-deps --target, as on the node), so the
# node's scripts find them installed and spend no time on it. Then copy the repository with
# .gpu-wheels/ to the node and run benchmarks/gpu_check.sh or gpu_speed.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PYVER=3.12
DEST=.gpu-wheels
while [ $# -gt 0 ]; do
    case $1 in
    --python-version) PYVER=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    -h | --help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case $PYVER in 3.[0-9] | 3.[0-9][0-9]) ;; *) echo "error: --python-version takes 3.N, got $PYVER" >&2; exit 2 ;; esac

mkdir -p "$DEST"
REQS=$DEST/requirements-cp${PYVER/./}.txt
"$PYTHON" benchmarks/gpu_wheels.py --python-version "$PYVER" >"$REQS"
rm -rf "$DEST"/*.whl "$DEST"/site-cp${PYVER/./}
PLATFORMS=(--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
    --platform manylinux_2_34_x86_64)
BUILT=()
while read -r pin; do
    if ! "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
        --implementation cp "${PLATFORMS[@]}" --dest "$DEST" "$pin" 2>/dev/null; then
        # no wheel on the index: build one from the source archive (pure Python only)
        "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$DEST" "$pin"
        BUILT+=("$pin")
    fi
done <"$REQS"

# one wheel per pinned package, for this Python and platform, pure Python where built here
"$PYTHON" - "$DEST" "$REQS" "$PYVER" "${BUILT[@]}" <<'EOF'
import re, sys
from pathlib import Path
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

dest, reqs, pyver, built = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
major, minor = (int(p) for p in pyver.split("."))
plats = ["manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]
tags = set(cpython_tags((major, minor), platforms=plats)) | set(compatible_tags((major, minor), "cp" + pyver.replace(".", ""), plats))
wanted = dict(line.split("==") for line in reqs.read_text().split())
found, bad = {}, []
for wheel in sorted(dest.glob("*.whl")):
    name, version, _, wheel_tags = parse_wheel_filename(wheel.name)
    found[str(canonicalize_name(name))] = str(version)
    if not wheel_tags & tags:
        bad.append(f"{wheel.name}: not installable on CPython {pyver} manylinux x86-64")
built_names = {canonicalize_name(p.split("==")[0]) for p in built}
for wheel in dest.glob("*.whl"):
    name, _, _, wheel_tags = parse_wheel_filename(wheel.name)
    if canonicalize_name(name) in built_names and Tag("py3", "none", "any") not in wheel_tags:
        bad.append(f"{wheel.name}: built here from source but not pure Python")
for name, version in wanted.items():
    if found.get(name) != version:
        bad.append(f"{name}=={version}: {'missing' if name not in found else 'got ' + found[name]}")
total = sum(w.stat().st_size for w in dest.glob("*.whl"))
for wheel in sorted(dest.glob("*.whl")):
    print(f"  {wheel.name:<72} {wheel.stat().st_size / 2**20:7.2f} MiB")
print(f"  {len(found)} wheels for CPython {pyver}, {total / 2**20:.1f} MiB in {dest}" + (f"; built from source here: {', '.join(built)}" if built else ""))
if bad:
    print("error: the wheel set is incomplete:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
EOF

# unpacked for the node's Python, stamped with the wheel set (benchmarks/gpu_kit.sh reads the stamp)
SITE=$DEST/site-cp${PYVER/./}
rm -rf "$SITE"
"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --only-binary=:all: \
    --python-version "$PYVER" --implementation cp --target "$SITE" "$DEST"/*.whl
(cd "$DEST" && ls *.whl | sha256sum | cut -c1-16) >"$SITE/.installed"
echo "  unpacked for CPython $PYVER into $SITE"
