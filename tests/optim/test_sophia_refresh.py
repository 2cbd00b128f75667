"""Sophia-G outside `merit train`: it refreshes its Hessian from a closure, or warns once that it is not refreshed."""

from __future__ import annotations

import warnings

import pytest
import torch

from merit_core.optim.sophia import SophiaG, sampled_label_loss

K = 3


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    x = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    return model, x


def _train_step(model, opt, x):
    opt.zero_grad()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), x[:, 1:].reshape(-1)).backward()
    opt.step()


def test_warns_once_when_stepped_past_its_interval_without_a_refresh():
    model, x = _setup()
    opt = SophiaG(model.parameters(), lr=1e-2, hessian_interval=K)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(K):  # the first k steps may run before the first refresh
            _train_step(model, opt, x)
    with pytest.warns(RuntimeWarning, match="without a Hessian refresh") as caught:
        for _ in range(2 * K):
            _train_step(model, opt, x)
    assert len(caught) == 1


def test_no_warning_when_the_loop_refreshes_every_interval():
    model, x = _setup()
    opt = SophiaG(model.parameters(), lr=1e-2, hessian_interval=K)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3 * K + 1):
            _train_step(model, opt, x)
            if step % K == K - 1:
                opt.zero_grad()
                loss, n = sampled_label_loss(model(x))
                loss.backward()
                opt.update_hessian(n)


def test_hessian_closure_refreshes_as_the_manual_protocol_does_and_keeps_the_gradients():
    steps = 2 * K + 1
    manual_model, x = _setup()
    manual = SophiaG(manual_model.parameters(), lr=1e-2, hessian_interval=K)
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):  # the protocol of merit_core.optim.sophia's docstring
        _train_step(manual_model, manual, x)
        if step % K == K - 1:
            manual.zero_grad()
            loss, n = sampled_label_loss(manual_model(x), generator=gen)
            loss.backward()
            manual.update_hessian(n)

    model, _ = _setup()
    gen = torch.Generator().manual_seed(7)
    opt = SophiaG(model.parameters(), lr=1e-2, hessian_interval=K)
    opt.hessian_closure = lambda: sampled_label_loss(model(x), generator=gen)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(steps):
            opt.zero_grad()
            logits = model(x)
            torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 11), x[:, 1:].reshape(-1)).backward()
            grads = [p.grad for p in model.parameters()]
            opt.step()
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the loop's gradients stay
    for p, q in zip(model.parameters(), manual_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        torch.testing.assert_close(opt.state[p]["hessian"], manual.state[q]["hessian"], rtol=0, atol=0)
    assert any(opt.state[p]["hessian"].abs().sum() > 0 for p in model.parameters())
