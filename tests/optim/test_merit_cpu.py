"""The CPU backend: the C++ kernel's build, cache and fallback, the tensors it takes, and
torch.compile of a whole training step through its custom op."""

import stat

import pytest
import torch

from merit_core.optim.merit import MERIT
from merit_core.optim.merit import cpu as merit_kernels


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


@pytest.mark.float_compare
def test_without_a_compiler_the_default_falls_back_to_torch(monkeypatch, tmp_path):
    _fresh_kernel_state(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PATH", str(tmp_path))  # no g++ / c++ to be found
    monkeypatch.delenv("CXX", raising=False)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        got = _steps(None)
    for a, b in zip(got, _steps("reference")):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="implementation='cpp'.*no C\\+\\+ compiler"):
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


@pytest.mark.float_compare
def test_kernel_takes_3d_and_non_contiguous_tensors(monkeypatch, tmp_path):
    _fresh_kernel_state(monkeypatch, tmp_path)
    calls = []
    real = merit_kernels._step_one
    monkeypatch.setattr(merit_kernels, "_step_one", lambda lib, p, *a: calls.append(p.shape) or real(lib, p, *a))
    params = [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.nn.Parameter(torch.randn(2, 3, 4)),
        torch.nn.Parameter(torch.randn(6, 4).t()),
    ]
    for p in params:
        p.grad = torch.randn_like(p)
    MERIT(params, implementation="cpu").step()
    assert calls == [p.shape for p in params]  # no silent fallback for 3-D or non-contiguous
    assert not params[2].is_contiguous()  # updated in place through a copy, layout kept


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.float_compare
def test_dtensor_params_bypass_the_kernel_and_match_the_reference(one_process_group, monkeypatch, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    _fresh_kernel_state(monkeypatch, tmp_path)
    monkeypatch.setattr(merit_kernels, "_step_one", lambda *a: pytest.fail("the per-tensor kernel got a DTensor"))
    mesh = init_device_mesh("cpu", (1,))
    gen = torch.Generator().manual_seed(0)
    w, g = torch.randn(6, 4, generator=gen), torch.randn(6, 4, generator=gen)
    w[2] = 0
    plain = torch.nn.Parameter(w.clone())
    sharded = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    for impl in (None, "cpu", "cpp", "foreach", "eager", "reference"):
        plain.grad = g.clone()
        sharded.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        MERIT([plain], lr=0.1, implementation="reference").step()
        MERIT([sharded], lr=0.1, implementation=impl).step()
        torch.testing.assert_close(sharded.detach().full_tensor(), plain.detach(), rtol=0, atol=0)


def test_torch_compile_of_a_whole_train_step_has_no_graph_break_or_recompile(monkeypatch, tmp_path):
    """A tiny GPT-2 step with opt.step() inside torch.compile: MERIT's group update is one custom
    op call, state creation runs eagerly (_init_group), a tensor lr changes without recompiling.
    Dynamo with the "eager" backend: the graph capture (with the op's fake implementation) is
    what is under test here, not Inductor's code generation, which would take minutes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _fresh_kernel_state(monkeypatch, tmp_path)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0  # the eager twin must see the same numbers
    models = [GPT2LMHeadModel(cfg) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def make(model):
        opt = MERIT(model.parameters(), lr=torch.tensor(1e-2), weight_decay=0.01)

        def train_step():
            logits = model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            return loss.detach()

        return opt, train_step

    eager_opt, eager_step = make(models[0])
    opt, step = make(models[1])
    compiled = torch.compile(step, backend="eager")
    for i in range(3):
        torch.testing.assert_close(compiled(), eager_step())
        for o in (opt, eager_opt):
            o.zero_grad(set_to_none=True)  # outside: torch marks Optimizer.zero_grad as not traceable
            o.param_groups[0]["lr"].fill_(1e-2 / (i + 2))  # a schedule on a tensor lr
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    counters = torch._dynamo.utils.counters
    # Dynamo always breaks the graph at loss.backward(); nothing else may break it.
    breaks = [reason.splitlines()[0] for reason in counters["graph_break"]]
    assert all("backward()" in reason.lower() for reason in breaks), breaks
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])  # forward; step (+ its first-step twin)
    assert not counters["recompiles"], dict(counters["recompiles"])
