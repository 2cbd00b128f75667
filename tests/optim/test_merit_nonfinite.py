"""One meaning of NaN and infinity in every MERIT backend (the table in tests/optim/nonfinite.py):
reference, foreach, cpu (C++) and the sharded path's torch and C++ local passes. The Triton
backend runs the same table under the interpreter in tests/optim/test_merit_triton.py, the
compile backend in tests/optim/test_merit_compile.py (on the graphs it compiles anyway)."""

import pytest

from merit_core.optim.merit import cpu
from merit_core.optim.merit.dtensor_step import merit_sharded
from merit_core.optim.merit.functional import BACKENDS
from tests.optim.nonfinite import CASES, CONFIGS, check


def _backend(name):
    if name.startswith("sharded-"):
        local = name.split("-")[1]
        return lambda *args: merit_sharded(*args, local=local)
    return BACKENDS[name].load()


FAST = ["reference", "foreach", "cpu", "sharded-torch", "sharded-cpu"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", FAST)
def test_every_case_follows_the_rule(name, config):
    if "cpu" in name and cpu.load_kernel() is None:
        pytest.fail("the C++ kernel did not build here")
    for case in CASES:
        check(_backend(name), case, config)
