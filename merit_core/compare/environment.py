"""The environment check: how far the floating-point environment alone moves a best cell's numbers.

Each best cell's first `samples` seeds are trained again with everything equal but one part of the
floating-point environment (a *perturbation*):

- ``threads``: another intra-op thread count (2 after 1, else 1): sums split over other chunks;
- ``isa``: torch's CPU kernels forced one instruction set below the host's
  (``ATEN_CPU_CAPABILITY``: AVX512 -> avx2, AVX2 -> default), as on an older machine;
- ``blas``: MKL's code path forced one instruction set below the host's
  (``MKL_ENABLE_INSTRUCTIONS``: AVX512 -> AVX2, AVX2 -> SSE4_2), only where torch uses MKL.

A perturbation the host cannot make (no lower ISA, a BLAS that cannot be switched) is left out
and said so. A cell's environment spread of a key is the largest |re-run - original| over its
samples and perturbations, and never below a stated floor (`FLOORS`, relative to the value): one
sample of a chaotic quantity can fall close to its original by luck, and a re-run of committed
cells on a machine with another ISA moved them an order of magnitude more than a thread-count
re-run had (results/compare-cpu/README.md gives the numbers). The floors are those relative
movements, rounded: a verdict must exceed what a change of machine did once already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

PERTURBATIONS = ("threads", "isa", "blas")
DEFAULT_PERTURBATIONS = PERTURBATIONS
# The smallest environment spread of each key, as a fraction of the original value (module docstring).
# The Hessian's: its estimate on a few hundred tokens moved 73% on a thread-count re-run.
FLOORS = {
    "final_val_loss": 0.005,
    "max_attention_logit": 0.25,
    "largest_algebraic_eigenvalue": 0.5,
    "largest_magnitude_eigenvalue": 0.5,
    "smallest_algebraic_eigenvalue": 0.5,
    "trace": 0.5,
}
# torch's CPU dispatch levels (torch.backends.cpu.get_cpu_capability) -> the one below it.
_ISA_BELOW = {"AVX512": "avx2", "AVX2": "default"}
_MKL_BELOW = {"avx512f": "AVX2", "avx2": "SSE4_2"}  # by the host's best ISA flag


@dataclass(frozen=True)
class Perturbation:
    """One change of the floating-point environment: `kind` (PERTURBATIONS) and its `value` (the
    thread count, the forced torch ISA or the forced MKL instruction set)."""

    kind: str
    value: str

    @property
    def suffix(self) -> str:
        """The re-run's run-name suffix: '-env2t' (threads, as earlier versions named it), '-envisa-avx2', ..."""
        if self.kind == "threads":
            return f"-env{self.value}t"
        return f"-env{self.kind}-{self.value.lower()}"

    @property
    def threads(self) -> int | None:
        return int(self.value) if self.kind == "threads" else None

    def env(self) -> dict[str, str]:
        """The environment variables the re-run's process gets (threads: set by the runner's share of cores)."""
        if self.kind == "isa":
            return {"ATEN_CPU_CAPABILITY": self.value}
        if self.kind == "blas":
            return {"MKL_ENABLE_INSTRUCTIONS": self.value}
        return {}

    def describe(self) -> str:
        return {
            "threads": f"{self.value} intra-op thread(s)",
            "isa": f"torch kernels forced to {self.value.upper()}",
            "blas": f"MKL forced to {self.value}",
        }[self.kind]


def perturbations(
    kinds: tuple[str, ...], threads: int, environment: dict[str, Any]
) -> tuple[list[Perturbation], list[str]]:
    """The perturbations of `kinds` this host can make (its `environment`: hardware.float_environment)
    at the runs' thread count, and a line for each it cannot."""
    made: list[Perturbation] = []
    skipped: list[str] = []
    for kind in kinds:
        if kind == "threads":
            made.append(Perturbation("threads", str(2 if threads == 1 else 1)))
        elif kind == "isa":
            below = _ISA_BELOW.get(str(environment.get("cpu_capability")))
            if below is None:
                skipped.append(f"isa: no instruction set below {environment.get('cpu_capability')} to force")
            else:
                made.append(Perturbation("isa", below))
        elif kind == "blas":
            flags = set(environment.get("isa_flags") or [])
            best = next((flag for flag in _MKL_BELOW if flag in flags), None)
            if environment.get("blas") != "mkl" or best is None:
                skipped.append(f"blas: {environment.get('blas')} cannot be switched to a lower instruction set")
            else:
                made.append(Perturbation("blas", _MKL_BELOW[best]))
    return made, skipped


def floored_spread(differences: list[float], original: float | None, key: str) -> float | None:
    """The environment spread of `key`: the largest |difference| measured, never below FLOORS[key] x
    |original| (None without a difference)."""
    if not differences:
        return None
    floor = FLOORS.get(key, 0.0) * abs(original) if original is not None and math.isfinite(original) else 0.0
    return max(max(differences), floor)
