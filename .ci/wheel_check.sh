#!/usr/bin/env bash
# The built wheel installs and runs on its own: build it, install it (without dependencies) into a
# fresh virtual environment that borrows the current environment's packages for torch & co (a
# plain path in a .pth file, so the checkout's editable install is not picked up), and run
# `merit` from outside the checkout, a shipped config by its name among them. Catches files missing
# from the wheel (the shipped configs, the C++ kernel source) and a broken entry point.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
work=$(mktemp -d)
made=()  # what the in-tree build leaves in the checkout and was not there before
for left in build merit_optim.egg-info; do [ -e "$left" ] || made+=("$PWD/$left"); done
trap 'rm -rf "$work" "${made[@]}"' EXIT
"$python" -m pip wheel -q --no-deps -w "$work/dist" .
"$python" -m venv "$work/venv"
deps=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$deps" > "$site/borrowed-deps.pth"
"$work/venv/bin/python" -m pip install -q --no-deps "$work"/dist/merit_optim-*.whl
cd "$work"
env -u PYTHONPATH "$work/venv/bin/merit" --version
env -u PYTHONPATH "$work/venv/bin/merit" train --list-configs > configs.txt
grep -q "merit train gpt2-small" configs.txt
# a shipped config by its bare name, found in the wheel (two steps of the CPU debug run)
env -u PYTHONPATH "$work/venv/bin/merit" train debug --steps 2 --set warmup_steps=0 --out "$work/run" > train.txt
grep -q "2 steps on cpu" train.txt
test -d "$work/run/step_2"
env -u PYTHONPATH "$work/venv/bin/python" - "$site" <<'PY'
import sys
import merit_cli
import merit_core
from merit_core.config_catalog import shipped_configs

site = sys.argv[1]
for module in (merit_core, merit_cli):
    assert module.__file__.startswith(site), f"{module.__name__} imported from {module.__file__}, not the wheel"
assert len(shipped_configs()) > 5
print(f"wheel: merit {merit_core.__version__} from {site}, {len(shipped_configs())} shipped configs")
PY
