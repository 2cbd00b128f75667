"""The opt-in compile backend, on two tiny shapes only: a cold Inductor compile costs seconds
per (shape, switches) combination, so this file compiles exactly four graphs."""

import pytest
import torch

from merit_core.optim.merit import MERIT

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()  # count only this test's graphs, whatever ran before in the process
    torch._dynamo.utils.counters.clear()


def test_compiled_path_matches_reference_and_never_recompiles_for_a_new_lr():
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(5, 4, generator=gen), torch.randn(4, generator=gen)]
    init[0][1] = 0  # a zero row
    runs = {}
    for impl in ("reference", "compile"):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = MERIT(params, lr=0.1, weight_decay=0.1, implementation=impl)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            opt.param_groups[0]["lr"] = 0.1 / (step + 1)  # a schedule: lr travels inside a tensor
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        runs[impl] = [p.detach() for p in params]
    for a, b in zip(runs["compile"], runs["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)

    from merit_core.optim.merit import compiled as merit_compiled
    from tests.optim.nonfinite import CASES, check

    for case in CASES:  # the non-finite rule, on the same two shapes and switches: no new graph
        check(merit_compiled.merit_compiled, case, "default")

    # Two passes x two shapes = four graphs; neither a changing lr nor NaN/inf added any.
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 4, dict(torch._dynamo.utils.counters["stats"])
    assert set(merit_compiled._compiled) == {"pass1", "pass2"}


def test_the_coefficients_are_computed_in_float64_and_rounded_once():
    """1 - beta2 at 0.999 from float64, as the other backends compute it in Python floats: a float32
    beta2 (0.99900001...) would give 1 - beta2 = 9.99987e-4, 1.3e-5 relative off."""
    from merit_core.optim.merit import compiled
    from merit_core.optim.merit.common import Hyper
    from tests.optim.nonfinite import BASE

    h = Hyper.of(**{**BASE, "betas": (0.9, 0.999), "bias_correction": True})
    vector = compiled._vector(h, torch.tensor(3.0))
    assert vector[compiled.ONE_MINUS_BETA2] == 1 - 0.999 and vector[compiled.ONE_MINUS_BETA1] == 1 - 0.9
    assert vector[compiled.INV_SQRT_BC2] == 1 / (1 - 0.999**3) ** 0.5
    as_float32 = torch.tensor(vector, dtype=torch.float32)
    assert as_float32[compiled.ONE_MINUS_BETA2] == torch.tensor(1 - 0.999, dtype=torch.float32)
    assert abs(float(1 - torch.tensor(0.999, dtype=torch.float32)) / (1 - 0.999) - 1) > 1e-5  # what was fixed


@pytest.mark.slow
def test_the_compile_backend_runs_inside_an_outer_fullgraph_compile():
    """torch's compiled-optimizer recipe, torch.compile(fullgraph=True) around step(): the two passes
    are traced into the caller's graph, and the result equals the eager compile backend's."""
    gen = torch.Generator().manual_seed(2)
    init, grad = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    runs = []
    for outer in (False, True):
        p = torch.nn.Parameter(init.clone())
        opt = MERIT([p], lr=0.05, implementation="compile")
        step = torch.compile(opt.step, fullgraph=True) if outer else opt.step
        for _ in range(2):
            p.grad = grad.clone()
            step()
        runs.append(p.detach().clone())
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-6, atol=1e-7)  # the same fp32 ops, fused differently
