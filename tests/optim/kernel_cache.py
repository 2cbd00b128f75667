"""The C++ kernel of the tests: built into a temporary cache, never into the user's.

`private_kernel_cache(mp, folder)` points the kernel's cache at `folder` and forgets a kernel
already loaded, through the MonkeyPatch `mp` (undone by its owner); `kernel_cache` is the
module-scoped autouse fixture a test module imports to do so for all its tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from merit_core.optim.merit import cpu


def private_kernel_cache(mp: pytest.MonkeyPatch, folder: Path | str) -> None:
    mp.setenv("MERIT_KERNEL_CACHE", str(folder))
    mp.setattr(cpu, "_state", dict(loaded=False, lib=None, error=None, path=None, build_s=None))


@pytest.fixture(autouse=True, scope="module")
def kernel_cache(tmp_path_factory):
    """Build the C++ kernel into a temporary cache, never into the user's."""
    mp = pytest.MonkeyPatch()
    private_kernel_cache(mp, tmp_path_factory.mktemp("merit_kernels"))
    yield
    mp.undo()
