"""The C++ CPU kernel's build, cache and fallback, and which path a parameter takes."""

import stat

import pytest
import torch

from merit_core.optim import merit_kernels
from merit_core.optim.merit import MERIT


def _fresh_kernel_state(monkeypatch, cache):
    monkeypatch.setenv("MERIT_KERNEL_CACHE", str(cache))
    fresh = dict(loaded=False, lib=None, error=None, path=None, build_s=None)
    monkeypatch.setattr(merit_kernels, "_state", fresh)


def _steps(impl, **kw):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 4), (4,)]]
    opt = MERIT(params, lr=0.1, weight_decay=0.1, implementation=impl, **kw)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() for p in params]


def test_kernel_is_built_once_then_loaded_from_the_cache(monkeypatch, tmp_path):
    _fresh_kernel_state(monkeypatch, tmp_path)
    assert merit_kernels.load_kernel() is not None
    first = merit_kernels.kernel_info()
    assert first["available"] and first["build_s"] is not None and first["path"].parent == tmp_path
    assert [f.name for f in tmp_path.iterdir()] == [first["path"].name]  # no temporaries left

    _fresh_kernel_state(monkeypatch, tmp_path)  # a new process, same cache
    assert merit_kernels.load_kernel() is not None
    second = merit_kernels.kernel_info()
    assert second["build_s"] is None and second["path"] == first["path"]


def test_without_a_compiler_the_default_falls_back_to_torch(monkeypatch, tmp_path):
    _fresh_kernel_state(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ to be found
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        got = _steps(None)
    for a, b in zip(got, _steps("reference")):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="implementation='cpp'.*no C\\+\\+ compiler"):
        _steps("cpp")


def test_a_failing_build_falls_back_and_says_why(monkeypatch, tmp_path):
    fake = tmp_path / "fakecxx"
    fake.write_text("#!/bin/sh\necho 'fatal error: no space left' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    _fresh_kernel_state(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("CXX", str(fake))
    with pytest.warns(RuntimeWarning, match="fakecxx exited with 3: fatal error: no space left"):
        _steps(None)
    assert not merit_kernels.kernel_info()["available"]
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written left behind


def test_kernel_is_used_only_for_tensors_it_supports(monkeypatch, tmp_path):
    _fresh_kernel_state(monkeypatch, tmp_path)
    calls = []
    real = merit_kernels.kernel_step
    monkeypatch.setattr(merit_kernels, "kernel_step", lambda *a: calls.append(a[1].shape) or real(*a))
    params = [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.nn.Parameter(torch.randn(2, 3, 4)),
        torch.nn.Parameter(torch.randn(6, 4).t()),
    ]  # 3-D and non-contiguous: eager path
    for p in params:
        p.grad = torch.randn_like(p)
    MERIT(params).step()
    assert calls == [torch.Size([4, 3])]


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_dtensor_params_bypass_the_kernel_and_match_the_reference(one_process_group, monkeypatch, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _fresh_kernel_state(monkeypatch, tmp_path)
    monkeypatch.setattr(merit_kernels, "kernel_step", lambda *a: pytest.fail("kernel got a DTensor"))
    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    w[2] = 0
    plain = torch.nn.Parameter(w.clone())
    sharded = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    for impl in (None, "cpp", "eager"):
        plain.grad = g.clone()
        sharded.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        MERIT([plain], lr=0.1, implementation="reference").step()
        MERIT([sharded], lr=0.1, implementation=impl).step()
        torch.testing.assert_close(sharded.detach().full_tensor(), plain.detach(), rtol=0, atol=0)
