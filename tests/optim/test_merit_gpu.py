"""Every MERIT backend against the reference on CUDA, fp32 and bf16 (``pytest -m gpu``).

The device-independent part runs on CPU everywhere: the foreach backend's case, with the same
shapes, zero rows/columns and non-contiguous grads, so a CPU run exercises the test's own code."""

import io

import pytest
import torch

from merit_core.optim.merit import MERIT
from merit_core.optim.merit.functional import BACKENDS

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none is available here")
SHAPES = [(64, 48), (48,), (8, 6, 4), (1,), (33, 130)]


def _run(impl, dtype, lr=0.05, steps=3, device="cuda", **kw):
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in SHAPES]
    init[0][3] = 0  # a zero row
    init[0][:, 5] = 0  # a zero column
    params = [torch.nn.Parameter(w.to(device, dtype)) for w in init]
    opt = MERIT(params, lr=lr, implementation=impl, **kw)
    for _ in range(steps):
        for p in params:
            g = torch.randn(p.shape, generator=gen).to(device, dtype)
            p.grad = g.t().contiguous().t() if g.dim() == 2 else g  # non-contiguous 2-D grads
        opt.step()
    return params, opt


CONFIGS = [dict(weight_decay=0.1), dict(norm="l2", bias_correction=True), dict(clip=None, maximize=True)]


def _cases():
    """(backend, dtype, config, device) for every CUDA backend that is wired; the compile backend
    only on the first config (each case compiles every shape); and foreach on the CPU."""
    cases = [pytest.param("foreach", torch.float32, kw, "cpu", id=f"cpu-foreach-{'-'.join(kw)}") for kw in CONFIGS]
    for name, backend in BACKENDS.items():
        if name in ("reference", "cpu") or backend.function is None:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for kw in CONFIGS[:1] if name == "compile" else CONFIGS:
                cases.append(
                    pytest.param(
                        name, dtype, kw, "cuda", id=f"{name}-{str(dtype)[6:]}-{'-'.join(kw)}", marks=needs_cuda
                    )
                )
    return cases


@pytest.mark.parametrize("impl, dtype, kw, device", _cases())
def test_backend_matches_reference(impl, dtype, kw, device):
    got, _ = _run(impl, dtype, device=device, **kw)
    want, _ = _run("reference", dtype, device=device, **kw)
    for a, b in zip(got, want):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-30)


@needs_cuda
def test_default_backend_and_tensor_lr_on_cuda():
    got, opt = _run(None, torch.float32, lr=torch.tensor(0.05, device="cuda"))
    want, _ = _run("reference", torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert all(opt.state[p]["step"].device.type == "cpu" for p in got)


@needs_cuda
def test_resume_with_map_location_cuda_keeps_step_on_the_cpu():
    params, opt = _run(None, torch.float32)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    sd = torch.load(io.BytesIO(buf.getvalue()), map_location="cuda", weights_only=True)
    assert all(st["step"].device.type == "cuda" for st in sd["state"].values())
    opt2 = MERIT([torch.nn.Parameter(p.detach().clone()) for p in params])
    opt2.load_state_dict(sd)
    assert all(st["step"].device.type == "cpu" for st in opt2.state.values())
