"""Today's max-norm logit bound beside the spectral one, on the grid's final checkpoints.

    python results/watch-cpu/bounds.py GRID_DIR/<label>/step_80 ...

One line per checkpoint: the largest measured max attention logit over layers, the max-norm bound
(`logit_bound`) and the spectral bound (`spectral_logit_bound`), both max over layers, on inspect's
default probe batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths  # noqa: E402


def main(paths: list[str]) -> None:
    print("| checkpoint | measured max logit | max-norm bound | spectral bound | ratio |")
    print("|---|---:|---:|---:|---:|")
    for path in paths:
        (c,) = inspect_paths([Path(path)], InspectOptions(device="cpu")).checkpoints
        logit = max(layer.max_attention_logit for layer in c.layers)
        old = max(layer.logit_bound for layer in c.layers)
        new = max(layer.spectral_logit_bound for layer in c.layers)
        name = f"{Path(path).parent.name}/{Path(path).name}"
        print(f"| {name} | {logit:.4g} | {old:.4g} | {new:.4g} | {old / new:.1f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
