"""MuonWithAdamW: routing, parity with torch's Muon + AdamW, and behaving as one optimizer."""

import copy

import pytest
import torch
from torch import nn

from merit_core.optim.muon import MuonWithAdamW, muon_param_groups
from tests.tiny_models import NO_DROPOUT, tiny_gpt2

# float results of reductions: CI runs this file again with OMP_NUM_THREADS=1 (see .ci/run)
pytestmark = pytest.mark.float_compare


def lm_loss(model, seed=0):
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def train_step(model, opt, seed=0):
    opt.zero_grad()
    loss = lm_loss(model, seed)
    loss.backward()
    opt.step()
    return loss.item()


def build(model, **kw):
    return MuonWithAdamW(muon_param_groups(model, 0.01), lr=0.02, adamw_lr=1e-3, **kw)


def test_routing_hidden_matrices_to_muon_and_the_rest_to_adamw():
    model = tiny_gpt2(**NO_DROPOUT)
    opt = build(model)
    groups = {g["name"]: g for g in opt.param_groups}
    assert [g["name"] for g in opt.param_groups] == ["muon", "adamw_decay", "adamw_no_decay"]
    assert groups["muon"]["use_muon"] and not groups["adamw_decay"]["use_muon"]
    assert len(groups["muon"]["params"]) == 8 and all(p.ndim == 2 for p in groups["muon"]["params"])
    assert set(groups["adamw_decay"]["param_names"]) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert groups["adamw_decay"]["weight_decay"] == 0.01 and groups["adamw_no_decay"]["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in groups["adamw_no_decay"]["params"])
    assert groups["muon"]["momentum"] == 0.95 and groups["muon"]["nesterov"] is True
    assert groups["adamw_decay"]["betas"] == (0.9, 0.95) and groups["adamw_decay"]["fused"] is True  # CPU fused
    total = sum(len(g["params"]) for g in opt.param_groups)
    assert total == len(list(model.parameters()))


def test_raw_tensors_route_2d_to_muon():
    w, b, conv = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.zeros(4)), nn.Parameter(torch.randn(2, 3, 3, 3))
    opt = MuonWithAdamW([w, b, conv])
    assert [(g["use_muon"], len(g["params"])) for g in opt.param_groups] == [(True, 1), (False, 2)]
    assert opt.param_groups[0]["params"][0] is w
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAdamW([{"params": [w]}])
    with pytest.raises(ValueError, match="2D"):
        MuonWithAdamW([{"params": [b], "use_muon": True}])


def test_step_matches_torch_muon_plus_adamw_run_separately():
    model = tiny_gpt2(**NO_DROPOUT)
    ref = copy.deepcopy(model)
    opt = build(model)
    ref_groups = muon_param_groups(ref, 0.01)
    muon = torch.optim.Muon([g for g in ref_groups if g["use_muon"]], lr=0.02, weight_decay=0.01)
    adamw = torch.optim.AdamW(
        [g for g in ref_groups if not g["use_muon"]],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-10,
        weight_decay=0.01,
        fused=True,
    )
    for seed in range(3):
        train_step(model, opt, seed)
        muon.zero_grad()
        adamw.zero_grad()
        lm_loss(ref, seed).backward()
        muon.step()
        adamw.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_reduces_loss_step_closure_and_zero_grad():
    model = tiny_gpt2(**NO_DROPOUT)
    opt = build(model)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = lm_loss(model)
        loss.backward()
        return loss

    first = opt.step(closure).item()
    assert len(calls) == 1
    for _ in range(10):
        last = opt.step(closure).item()
    assert last < first - 0.3
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_lambda_lr_scales_both_parts():
    model, half = tiny_gpt2(**NO_DROPOUT), tiny_gpt2(**NO_DROPOUT)
    opt = build(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.01, 5e-4, 5e-4]
    opt_half = MuonWithAdamW(muon_param_groups(half, 0.01), lr=0.01, adamw_lr=5e-4)
    for seed in range(2):
        train_step(model, opt, seed)
        train_step(half, opt_half, seed)
        sched.step()
    for p, q in zip(model.parameters(), half.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # lr 0 everywhere: nothing moves
    assert all(g["lr"] == 0.0 for g in opt.param_groups) and zero.last_epoch == 0
    train_step(model, opt, 5)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters())


def test_state_dict_round_trip_gives_identical_next_step_and_relinks_parts():
    model = tiny_gpt2(**NO_DROPOUT)
    opt = build(model)
    for seed in range(3):
        train_step(model, opt, seed)
    sd = copy.deepcopy(opt.state_dict())
    assert sorted(sd["state"]) == list(range(len(list(model.parameters()))))
    assert [g["use_muon"] for g in sd["param_groups"]] == [True, False, False]
    assert "momentum_buffer" in sd["state"][sd["param_groups"][0]["params"][0]]
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(sd["state"][sd["param_groups"][1]["params"][0]])

    clone = copy.deepcopy(model)
    opt2 = MuonWithAdamW(muon_param_groups(clone, 0.5), lr=0.3, adamw_lr=0.3)  # all hparams come from sd
    opt2.load_state_dict(sd)
    assert [g["lr"] for g in opt2.param_groups] == [0.02, 1e-3, 1e-3]
    train_step(model, opt, 7)
    train_step(clone, opt2, 7)
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)

    # after loading, the parts step the composite's (new) group dicts: lr 0 freezes everything
    for g in opt2.param_groups:
        g["lr"] = 0.0
    frozen = [p.detach().clone() for p in clone.parameters()]
    train_step(clone, opt2, 8)
    assert all(torch.equal(p, f) for p, f in zip(clone.parameters(), frozen))


def test_add_param_group_routes_by_shape():
    model = tiny_gpt2(**NO_DROPOUT)
    opt = build(model)
    extra_w, extra_b = nn.Parameter(torch.randn(5, 32)), nn.Parameter(torch.zeros(5))
    opt.add_param_group({"params": [extra_w], "param_names": ["extra.w"]})
    opt.add_param_group({"params": [extra_b], "param_names": ["extra.b"], "lr": 0.1})
    assert [g["use_muon"] for g in opt.param_groups] == [True, True, False, False, False]
    assert opt.param_groups[1]["params"] == [extra_w] and opt.param_groups[1]["lr"] == 0.02
    assert opt.param_groups[-1]["lr"] == 0.1 and opt.param_groups[-1]["betas"] == (0.9, 0.95)
    extra_w.grad, extra_b.grad = torch.randn(5, 32), torch.randn(5)
    before_w, before_b = extra_w.detach().clone(), extra_b.detach().clone()
    opt.step()
    assert not torch.equal(extra_w, before_w) and not torch.equal(extra_b, before_b)
    with pytest.raises(ValueError, match="2-D"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "param_names": ["v"], "use_muon": True})
