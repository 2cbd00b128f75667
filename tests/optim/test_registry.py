"""The optimizer registry: every name builds and trains, names and hyperparameters are checked."""

import copy
import math

import pytest
import torch
from torch import nn

from merit_core.errors import ConfigError
from merit_core.optim import (
    MERIT,
    OPTIMIZER_NAMES,
    MuonWithAdamW,
    SophiaG,
    build_optimizer,
    canonical_name,
    default_hparams,
    fixed_hparams,
    optimizer_summary,
    resolve_hparams,
    sampled_label_loss,
)
from tests.tiny_models import NO_DROPOUT, tiny_gpt2


@pytest.fixture(scope="module")
def gpt2():
    return tiny_gpt2(**NO_DROPOUT)


@pytest.fixture
def model(gpt2):
    return copy.deepcopy(gpt2)


# learning rates large enough to see progress in a few steps on a fixed batch (trust-ratio methods
# scale their step by the small init weights, so the MERIT family gets lr 0.1)
FAST = {
    "adamw": dict(lr=1e-2),
    "lamb": dict(lr=5e-2),
    "lion": dict(lr=2e-3),
    "sophiag": dict(lr=1e-2, hessian_interval=2),
    "muon": dict(lr=0.02, adamw_lr=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_name_builds_and_reduces_a_loss(name, model):
    opt = build_optimizer(name, model, **FAST.get(name, dict(lr=0.1)))
    assert isinstance(opt, torch.optim.Optimizer)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(8):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if isinstance(opt, SophiaG) and step % opt.hessian_interval == opt.hessian_interval - 1:
            opt.zero_grad()
            sampled, n = sampled_label_loss(model(input_ids=ids).logits, generator=gen)
            sampled.backward()
            opt.update_hessian(n)
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_classes_behind_the_names(model):
    from pytorch_optimizer import Lamb, Lion

    expected = {
        "merit": MERIT,
        "adamw": torch.optim.AdamW,
        "lamb": Lamb,
        "lion": Lion,
        "sophiag": SophiaG,
        "muon": MuonWithAdamW,
        "merit-noclip": MERIT,
        "merit-nobound": MERIT,
        "max-lamb": MERIT,
        "l2-merit": MERIT,
        "lamb-ref": MERIT,
    }
    assert set(expected) == set(OPTIMIZER_NAMES)
    for name, cls in expected.items():
        assert type(build_optimizer(name, model)) is cls, name


@pytest.mark.parametrize(
    "name, switches",
    [
        ("merit", dict(norm="max", elementwise=True, weight_bound=True, clip=1.0)),
        ("merit-noclip", dict(norm="max", elementwise=True, weight_bound=True, clip=None)),
        ("merit-nobound", dict(norm="max", elementwise=True, weight_bound=False, clip=1.0)),
        ("max-lamb", dict(norm="max", elementwise=False, weight_bound=True, clip=1.0)),
        ("l2-merit", dict(norm="l2", elementwise=True, weight_bound=True, clip=1.0)),
        ("lamb-ref", dict(norm="l2", elementwise=False, clip=None)),
    ],
)
def test_ablation_variants_set_their_switches(name, switches, model):
    opt = build_optimizer(name, model)
    for group in opt.param_groups:
        for key, value in switches.items():
            assert group[key] == value, (name, key)
        assert group["bias_correction"] is False
    if name == "merit":
        assert fixed_hparams(name) == {}
    else:
        assert {k: fixed_hparams(name)[k] for k in switches} == switches


def _lamb_formula(w, grads, lr, b1, b2, eps, wd, debias_m=False):
    """LAMB with the decay inside the trust-ratio update, written out; optionally lr / (1 - b1^t)."""
    w, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        u = m / (v.sqrt() + eps) + wd * w
        step = lr / (1 - b1**t) if debias_m else lr
        w = w - step * (w.norm() / u.norm()) * u
    return w


@pytest.mark.parametrize("name", ["lamb-ref", "lamb"])
def test_lamb_ref_is_lamb_without_bias_correction_and_lamb_debiases_m(name):
    # lamb-ref: no bias correction at all. pytorch_optimizer's Lamb divides the step by
    # 1 - b1^t (first moment only), which is otherwise the same update.
    torch.manual_seed(0)
    w0 = torch.randn(6, 5, dtype=torch.float64)
    grads = [torch.randn(6, 5, dtype=torch.float64) for _ in range(4)]
    p = nn.Parameter(w0.clone())
    opt = build_optimizer(name, [p], lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _lamb_formula(w0, grads, 0.05, 0.9, 0.99, 1e-8, 0.1, debias_m=(name == "lamb"))
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)


def test_names_are_case_and_underscore_insensitive(model):
    assert canonical_name(" MERIT_NoClip ") == "merit-noclip"
    assert canonical_name("L2_MERIT") == "l2-merit"
    assert canonical_name("SophiaG") == "sophiag"
    opt = build_optimizer("Max_LAMB", model)
    assert opt.param_groups[0]["elementwise"] is False


def test_unknown_name_lists_valid_names_and_suggests_the_closest(model):
    with pytest.raises(ConfigError) as err:
        build_optimizer("lmab", model)
    msg = str(err.value)
    assert "unknown optimizer 'lmab'" in msg and "did you mean 'lamb'" in msg
    assert all(name in msg for name in OPTIMIZER_NAMES) and "\n" not in msg
    with pytest.raises(ConfigError, match="did you mean 'sophiag'"):
        build_optimizer("sophia_g", model)
    with pytest.raises(ConfigError, match="valid names: merit, adamw"):
        build_optimizer("sgd-with-magic", model)


def test_unknown_or_mistyped_hyperparameter_is_never_swallowed(model):
    with pytest.raises(ConfigError) as err:
        build_optimizer("adamw", model, weight_decai=0.1)
    msg = str(err.value)
    assert "unknown hyperparameter 'weight_decai'" in msg and "did you mean 'weight_decay'" in msg
    assert "accepted: lr, betas, eps, weight_decay" in msg
    with pytest.raises(ConfigError, match="unknown hyperparameter 'rho' for optimizer 'lamb'"):
        build_optimizer("lamb", model, rho=0.1)  # Lamb's **kwargs would silently accept it
    with pytest.raises(ConfigError, match="unknown hyperparameter 'momentum' for optimizer 'lion'"):
        build_optimizer("lion", model, momentum=0.9)
    with pytest.raises(ConfigError, match="fixes 'clip' to None"):
        build_optimizer("merit-noclip", model, clip=1.0)
    with pytest.raises(ConfigError, match="fixes 'norm'"):
        build_optimizer("lamb-ref", model, norm="max")


@pytest.mark.parametrize(
    "name, hparams, pattern",
    [
        ("adamw", dict(lr=-1.0), r"optimizer 'adamw': invalid hyperparameters: .*-1\.0"),
        ("adamw", dict(lr="fast"), "'lr' must be a number, got 'fast'"),
        ("adamw", dict(betas=(0.9,)), "'betas' must be a pair of numbers"),
        ("adamw", dict(fused="yes"), "'fused' must be true, false or None"),
        ("lamb", dict(betas=(1.5, 0.9)), "optimizer 'lamb': invalid hyperparameters"),
        ("lion", dict(weight_decay=-1.0), "optimizer 'lion': invalid hyperparameters"),
        ("sophiag", dict(rho=0.0), "rho must be > 0"),
        ("sophiag", dict(hessian_interval=2.5), "'hessian_interval' must be an integer"),
        ("muon", dict(adjust_lr_fn="spectral"), "optimizer 'muon': invalid hyperparameters"),
        ("muon", dict(nesterov=1), "'nesterov' must be true or false"),
        ("merit", dict(betas=(0.9, 1.0)), "optimizer 'merit': invalid hyperparameters"),
        ("merit", dict(clip="none"), "'clip' must be a number or None"),
    ],
)
def test_bad_values_raise_config_error_with_the_reason(name, hparams, pattern, model):
    with pytest.raises(ConfigError, match=pattern):
        build_optimizer(name, model, **hparams)


def test_defaults_are_used_and_overrides_are_normalised(model):
    opt = build_optimizer("adamw", model)
    decay, no_decay = opt.param_groups
    assert (decay["name"], decay["lr"], decay["betas"], decay["weight_decay"]) == ("decay", 6e-4, (0.9, 0.95), 0.1)
    assert no_decay["weight_decay"] == 0.0 and decay["fused"] is True  # CPU tensors: fused kernel
    opt = build_optimizer("adamw", model, betas=[0.8, 0.9], **{"weight-decay": 0})
    assert opt.param_groups[0]["betas"] == (0.8, 0.9) and opt.param_groups[0]["weight_decay"] == 0.0
    opt = build_optimizer("adamw", model, fused=False)
    assert opt.param_groups[0]["fused"] is False
    assert build_optimizer("sophiag", model).hessian_interval == 10
    # an integral float is an integer, as in a train config (TOML's 4.0 from a script's output)
    assert resolve_hparams("sophiag", hessian_interval=4.0)["hessian_interval"] == 4


def test_default_hparams_table_and_helpers():
    assert default_hparams("merit") == dict(
        lr=2e-3,  # the measured GPT-2 small lr (not the reference README's 2e-4)
        betas=(0.9, 0.95),
        eps=1e-6,
        weight_decay=1e-2,
        norm="max",
        elementwise=True,
        weight_bound=True,
        clip=1.0,
        bias_correction=False,
        maximize=False,
        implementation=None,
        decay_embeddings=True,
    )
    assert "clip" not in default_hparams("merit-noclip") and fixed_hparams("merit-noclip")["clip"] is None
    assert default_hparams("sophiag")["betas"] == (0.965, 0.99)
    assert default_hparams("muon")["lr"] == 0.02 and default_hparams("muon")["momentum"] == 0.95
    d = default_hparams("adamw")
    d["lr"] = 1.0
    assert default_hparams("adamw")["lr"] == 6e-4  # a fresh copy each time
    assert resolve_hparams("lion", lr=3e-5) == {**default_hparams("lion"), "lr": 3e-5}
    assert all(optimizer_summary(n) for n in OPTIMIZER_NAMES)
    for name in OPTIMIZER_NAMES:  # every default passes its own type check
        assert resolve_hparams(name, **default_hparams(name)) == default_hparams(name)
    with pytest.raises(ConfigError, match="unknown optimizer"):
        default_hparams("adam")


def test_decay_embeddings_switch_reaches_every_family(model):
    for name in ("merit", "adamw", "muon"):
        opt = build_optimizer(name, model, decay_embeddings=False)
        no_decay = [g for g in opt.param_groups if g["weight_decay"] == 0.0]
        names = {n for g in no_decay for n in g["param_names"]}
        assert {"transformer.wte.weight", "transformer.wpe.weight"} <= names, name
        decayed = {n for g in opt.param_groups if g["weight_decay"] > 0 for n in g["param_names"]}
        assert not decayed & {"transformer.wte.weight", "transformer.wpe.weight"}


def test_raw_parameter_lists_work_too():
    w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.zeros(4))
    opt = build_optimizer("merit", [w, b])
    assert [(g["name"], g["weight_decay"]) for g in opt.param_groups] == [("decay", 1e-2), ("no_decay", 0.0)]
    opt = build_optimizer("muon", [("w", w), ("b", b)])
    assert [(g["name"], g["param_names"]) for g in opt.param_groups] == [("muon", ["w"]), ("adamw_no_decay", ["b"])]


def test_every_builtin_spec_describes_itself():
    from merit_core.optim.registry import get_spec, lr_centre, measured_lrs

    for name in OPTIMIZER_NAMES:
        spec = get_spec(name)
        assert set(spec.kinds) == set(spec.defaults), name  # every settable hyperparameter has a kind
        centre = lr_centre(name)
        assert (centre is None) == bool(measured_lrs(name)), name  # measured lrs, or an unmeasured centre
        assert centre is None or (0 < centre["small"] and 0 < centre["gpt2"]), name
    ablations = ("merit-noclip", "merit-nobound", "max-lamb", "l2-merit", "lamb-ref")
    assert all(get_spec(n).lr_family == "merit" and measured_lrs(n) == measured_lrs("merit") for n in ablations)
    assert [n for n in OPTIMIZER_NAMES if measured_lrs(n) and n not in ablations] == ["merit", "adamw", "lamb"]
    assert [n for n in OPTIMIZER_NAMES if get_spec(n).fsdp_refused] == ["lamb"]
    assert "lamb-ref" in get_spec("lamb").fsdp_refused
    assert [n for n in OPTIMIZER_NAMES if get_spec(n).step_hook] == ["sophiag"]
    sophia = get_spec("sophiag")
    assert sophia.step_hook.interval(build_optimizer(sophia, [nn.Parameter(torch.ones(2, 2))])) == 10
    assert get_spec(sophia) is sophia  # a spec is its own entry: the functions taking a name take it too
    assert get_spec("merit").kinds["clip"] == float | None and get_spec("adamw").kinds["fused"] == bool | None


def test_measured_lrs_name_their_run_and_the_registry_default_is_the_gpt2_small_entry():
    from merit_core.optim.registry import measured_lrs

    for name in ("merit", "adamw", "lamb"):
        table = measured_lrs(name)
        assert all(e.run and e.lr > 0 for e in table)
        assert len({(e.model, e.batch_size, e.seq_len) for e in table}) == len(table)  # one entry per setting
        small = {e.lr for e in table if e.model == "gpt2-small"}
        assert small == {default_hparams(name)["lr"]}  # one default: build_optimizer's is the table's
    compare_cpu = {(e.batch_size, e.lr) for e in measured_lrs("merit") if e.model == "gpt2-tiny"}
    assert compare_cpu == {(2, 1e-2), (16, 2.83e-2)}  # results/compare-cpu's best cells
    assert all("results/compare-cpu" in e.run for e in measured_lrs("adamw") if e.model == "gpt2-tiny")


def test_default_lr_lookup_and_scaling_rule():
    from merit_core.optim.registry import default_lr, measured_lr

    tiny, small, medium_width = 128, 768, 1024
    # an entry: its lr, and the source names it and its run
    exact = default_lr("merit", "gpt2-small", 64, 1024, small)
    assert exact.lr == 2e-3 and not exact.scaled and not exact.extrapolated
    assert exact.source.startswith("merit's measured default for gpt2-small at batch 64 x 1024")
    assert "run: " in exact.source and "H200" in exact.source
    assert default_lr("adamw", "gpt2-small", 64, 1024, small).lr == 6e-4
    assert "nanoGPT" in default_lr("adamw", "gpt2-small", 480, 1024, small).source
    assert default_lr("lamb", "gpt2-tiny", 16, 128, tiny).lr == 2.83e-2
    # between entries: the nearest (in log tokens per step) of the same model, x sqrt(tokens ratio)
    up = default_lr("merit", "gpt2-small", 256, 1024, small)
    assert up.lr == pytest.approx(4e-3) and up.scaled and "x sqrt(262,144 / 65,536 tokens per step)" in up.source
    assert not up.extrapolated  # 4x its entry: the edge of the checked range
    down = default_lr("adamw", "gpt2-small", 16, 1024, small)
    assert down.lr == pytest.approx(3e-4)
    assert default_lr("adamw", "gpt2-small", 64, 256, small).lr == pytest.approx(3e-4)  # tokens, not sequences
    near = default_lr("merit", "gpt2-tiny", 4, 128, tiny)  # 512 tokens: nearer the batch-2 entry (256) than 16 (2048)
    assert near.entry.batch_size == 2 and near.lr == pytest.approx(1e-2 * 2**0.5, rel=3e-3)
    # a model without entries: the nearest measured width's entries, batch-scaled only, and it says so
    medium = default_lr("merit", "gpt2-medium", 64, 1024, medium_width)
    assert medium.entry.model == "gpt2-small" and medium.lr == 2e-3 and medium.scaled and medium.extrapolated
    assert "no measurement for gpt2-medium" in medium.source and medium.source.startswith("extrapolated")
    assert default_lr("adamw", "llama-tiny", 16, 128, tiny).entry.model == "gpt2-tiny"  # 128 wide, as gpt2-tiny
    # ablations share MERIT's table and say so; unmeasured optimizers get their registry default
    noclip = default_lr("merit-noclip", "gpt2-small", 64, 1024, small)
    assert noclip.lr == 2e-3 and "merit-noclip shares merit's lrs" in noclip.source
    lion = default_lr("lion", "gpt2-small", 64, 1024, small)
    assert lion.lr == default_hparams("lion")["lr"] and lion.entry is None and "registry default" in lion.source
    assert measured_lr("lion", "gpt2-small", 64, 1024, small) is None


def test_extrapolated_lrs_are_capped_at_the_largest_stable_lr_and_say_so():
    from merit_core.optim.lr_table import EXTRAPOLATION_LIMIT, STABLE_LRS
    from merit_core.optim.registry import default_lr

    # gpt2-tiny at batch 100k: sqrt(100k / 16) x 2.83e-2 = 2.24, far past anything stable
    far = default_lr("merit", "gpt2-tiny", 100_000, 128, 128)
    cap = next(s for s in STABLE_LRS["merit"] if s.model == "gpt2-tiny")
    assert far.extrapolated and far.cap == cap and far.lr == cap.lr == 2.83e-2
    assert far.source.startswith("extrapolated (6.25e+03x its entry's tokens per step, beyond the 4x")
    assert "2.24 capped at 0.0283, the largest lr merit's grids trained stably on gpt2-tiny" in far.source
    assert "run: results/compare-cpu" in far.source
    # just past the limit, below the cap: extrapolated and said, the rule's lr kept (AdamW's cap is its
    # batch-16 entry, so a small batch far below it extrapolates downwards, under the cap)
    past = default_lr("adamw", "gpt2-tiny", 1, 16, 128)  # 16 tokens per step, 16x below the batch-2 entry
    assert past.extrapolated and past.cap is None and past.lr == pytest.approx(1e-3 / 16**0.5, rel=3e-3)
    assert "under the cap 0.00283" in past.source
    # past the limit upwards: capped at the largest stable lr
    up = default_lr("adamw", "gpt2-tiny", int(16 * EXTRAPOLATION_LIMIT * 2), 128, 128)
    assert up.extrapolated and up.lr == up.cap.lr == 2.83e-3
    # within the limit either way: not extrapolated
    assert not default_lr("adamw", "gpt2-tiny", 64, 128, 128).extrapolated  # 4x the batch-16 entry
    assert default_lr("adamw", "gpt2-small", 8, 1024, 768).extrapolated  # 8x below its nearest entry
    # an unknown model (no width, no entry of its name): the registry default, and the source says why
    unknown = default_lr("merit", "a/config.json", 16, 128, None)
    assert unknown.entry is None and "config could not be read" in unknown.source


@pytest.mark.parametrize("name", ["lamb", "lion"])
def test_baselines_without_pytorch_optimizer_say_what_to_install(monkeypatch, name):
    from merit_core import extras
    from merit_core.errors import MissingDependencyError

    real = extras.is_installed
    monkeypatch.setattr(extras, "is_installed", lambda module: module != "pytorch_optimizer" and real(module))
    with pytest.raises(MissingDependencyError, match=r"merit-optim\[baselines\]"):
        build_optimizer(name, torch.nn.Linear(3, 2))
