"""The default comparison that `merit compare` runs with no arguments, in a module of its own that
imports nothing: `merit compare --help` shows these values without importing the comparison (torch).

merit_core.compare.spec reads them (and re-exports them under the same names)."""

from __future__ import annotations

from typing import Any

# The paper's three optimizers on the tiny GPT-2 and the built-in corpus, a small and a large batch
# (8x apart) at one token budget, sized so the large batch takes 64 optimizer steps (at least 50)
# within the 2-core CPU budget (see merit_core.compare.__doc__ and benchmarks/README.md).
DEFAULT_OPTIMIZERS = ("adamw", "lamb", "merit")
DEFAULT_BATCH_SIZES = (2, 16)
DEFAULT_TOKENS = 131_072
DEFAULT_TRAIN: dict[str, Any] = {"model": "gpt2-tiny", "seq_len": 128, "warmup_ratio": 0.1}
# `--quick`: the same comparison with half the tokens and one lr per optimizer (the auto grid's centre).
QUICK_TOKENS = 65_536
