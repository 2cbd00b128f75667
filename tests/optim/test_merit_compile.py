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
