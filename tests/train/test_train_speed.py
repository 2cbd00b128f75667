"""The fast path of training, on CPU: compile settings and regional compilation, a compile failure's
message, no host syncs in `train_step`, the micro-batch chosen for speed, the prefetching copies.

The one test that really compiles (inductor's C++ backend on CPU) trains, evaluates, saves and
resumes a 2-layer GPT-2 with compile=true and compares it with the eager run.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from merit_core.errors import ConfigError
from merit_core.train import compiling
from merit_core.train.config import load_config, resolve
from merit_core.train.distributed import Parallel
from merit_core.train.run_folder import save_config
from merit_core.train.trainer import build_trainer, fastest_fitting, prefetched
from tests.cli_runs import TINY_TRAIN


def test_compile_setting_auto_true_false(tmp_path):
    assert load_config().compile == "auto"
    assert load_config(overrides=["compile=auto"]).compile == "auto"
    assert load_config(overrides=["compile=false"]).compile is False
    assert load_config(values={"compile": True}).compile is True
    with pytest.raises(ConfigError, match="compile must be auto, true or false, got 'yes'"):
        load_config(overrides=["compile=yes"])
    assert compiling.resolve_compile("auto", torch.device("cuda")) is True
    assert compiling.resolve_compile("auto", torch.device("cpu")) is False  # the CPU default is unchanged
    assert compiling.resolve_compile(True, torch.device("cpu")) is True
    save_config(resolve(load_config()).config, tmp_path / "c.toml")
    assert load_config(tmp_path / "c.toml").compile == "auto"  # a resume reads back what was written


def _tiny_trainer(tmp_path, optimizer="adamw", **values):
    from merit_core.models import build_model, model_config

    config = resolve(
        load_config(
            values=dict(
                model="gpt2-tiny",
                optimizer=optimizer,
                batch_size=4,
                micro_batch_size=2,
                seq_len=16,
                device="cpu",
                out=str(tmp_path),
                eval_batches=1,
                eval_batch_size=2,
                lr=1e-3,
                weight_decay=0.0,
                **values,
            )
        ),
    ).config
    tokens = np.random.default_rng(0).integers(0, 97, size=4000).astype(np.uint16)
    model = build_model(model_config("gpt2-tiny", vocab_size=97, context=16), seed=0)
    return build_trainer(config, model, Parallel(torch.device("cpu")), tokens, tokens[:500])


def test_a_compile_failure_stops_with_one_line_naming_compile_false(tmp_path, monkeypatch):
    def failing_backend(gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    real = torch.compile
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, **kw: real(fn, backend=failing_backend))
    trainer = _tiny_trainer(tmp_path, compile=True)
    with pytest.raises(compiling.CompileFailed) as info:
        trainer.train_step()
    message = str(info.value)
    assert "--set compile=false" in message and "no C++ compiler found" in message and "\n" not in message
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one red line, exit 2
    torch._dynamo.reset()


def test_compile_auto_falls_back_to_eager_with_one_warning(tmp_path, monkeypatch):
    """compile=auto means "on where it works": a compiler that fails makes one warning line with its
    first error line, the failed step is redone eagerly (same loss as a run that never compiled) and
    the run stays eager, and says so (compile_state, which the summary shows)."""
    from merit_core.train import trainer as trainer_module

    compiles = []

    def failing_backend(gm, example_inputs):
        compiles.append(1)
        raise RuntimeError("no C++ compiler found\nsecond line")

    real = torch.compile
    monkeypatch.setattr(compiling.torch, "compile", lambda fn, **kw: real(fn, backend=failing_backend))
    monkeypatch.setattr(trainer_module, "resolve_compile", lambda setting, device: setting is not False)
    eager_trainer = _tiny_trainer(tmp_path / "eager", compile=False)
    expected = [float(eager_trainer.train_step().loss) for _ in range(2)]
    trainer = _tiny_trainer(tmp_path / "auto", compile="auto")
    assert trainer.compiled and trainer.compile_state == "compiled"
    losses = [float(trainer.train_step().loss) for _ in range(2)]
    torch._dynamo.reset()
    assert losses == pytest.approx(expected, rel=1e-6)
    assert len(compiles) == 1  # the second step never tried to compile again
    assert trainer.notes == [
        "torch.compile failed (RuntimeError: no C++ compiler found); running eager; --set compile=false to skip this"
    ]
    assert not trainer.compiled
    assert trainer.compile_state == "eager (compile=auto fell back: RuntimeError: no C++ compiler found)"


@pytest.mark.parametrize("optimizer, args", [("adamw", {}), ("merit", {"implementation": "foreach"})])
def test_train_step_reads_nothing_back_to_the_host(tmp_path, monkeypatch, optimizer, args):
    """Loss, grad norm and the non-finite marker stay on the device between log steps: no
    .item(), float(), int(), bool() or .tolist() of a tensor during train_step (with gradient
    accumulation over two micro-batches), the model's forward included (transformers' packed-
    sequence check read a bool per forward before `mask_free_attention`). MERIT runs its
    device-generic foreach backend here: the CPU-only C++ backend reads its lr from a CPU scalar,
    no device sync; tests/gpu/test_gpu.py checks the CUDA path with CUDA's sync debug mode."""
    trainer = _tiny_trainer(tmp_path, optimizer, optimizer_args=args)
    trainer.train_step()  # optimizer state created
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    out = trainer.train_step()
    out = trainer.train_step()
    assert calls == [], calls
    monkeypatch.undo()
    assert trainer.n_micro == 2 and torch.isfinite(out.loss) and trainer.first_nonfinite_step() is None


def test_micro_batch_choice_takes_the_fastest_fitting_size():
    fits = lambda limit: lambda size: size <= limit  # noqa: E731

    def timer(per_sequence):
        timed = []

        def seconds_per_sequence(size):
            timed.append(size)
            return per_sequence[size]

        return seconds_per_sequence, timed

    # 64 fits but 16 per micro-batch is faster per sequence: 16 is chosen
    sps, timed = timer({64: 1.0, 32: 0.9, 16: 0.8})
    assert fastest_fitting(64, fits(64), sps) == 16 and timed == [64, 32, 16]
    # a smaller size must be more than 3% faster to win over the largest
    sps, _ = timer({64: 1.0, 32: 0.98, 16: 0.99})
    assert fastest_fitting(64, fits(64), sps) == 64
    # only sizes that fit are timed: the largest fitting, then its halvings (divisors of the batch)
    sps, timed = timer({12: 1.0, 6: 0.5, 3: 0.7})
    assert fastest_fitting(48, fits(20), sps) == 6 and timed == [12, 6, 3]
    sps, timed = timer({})
    assert fastest_fitting(8, fits(0), sps) == 1 and timed == []  # nothing fits: 1, untimed


def test_prefetched_copies_keep_the_order():
    pairs = [(torch.full((2, 3), i), torch.full((2, 3), -i)) for i in range(3)]
    got = list(prefetched(iter(pairs), torch.device("cpu")))
    assert [int(x[0, 0]) for x, _ in got] == [0, 1, 2] and [int(y[0, 0]) for _, y in got] == [0, -1, -2]
    assert list(prefetched(iter([]), torch.device("cpu"))) == []


@pytest.mark.float_compare
def test_compiled_run_trains_evaluates_saves_and_resumes_like_the_eager_run(model_cfg, data_dir, tmp_path):
    """compile=true on CPU (inductor): the per-block compiled forward gives the eager run's first
    loss within 1e-5 relative (fp32; fused kernels reorder sums) and the later ones within 5e-3
    (measured 5.7e-4 at worst: the optimizer's normalised updates amplify the reordering),
    evaluation and the attention probe work, checkpoints keep the plain parameter names, and a
    resume continues the compiled run."""
    from merit_core.checkpoint.tensors import load_trainer_state  # noqa: F401  (the run writes it)
    from merit_core.metrics import read_metrics
    from merit_core.train.training_run import TrainCallbacks, run_training

    notes = []

    class Notes(TrainCallbacks):
        def on_note(self, message):
            notes.append(message)

    small = dict(batch_size=4, micro_batch_size=2, seq_len=16, eval_batches=1, eval_batch_size=2, device="cpu")
    common = {**TINY_TRAIN, **small, "model": str(model_cfg), "data": str(data_dir)}
    eager = run_training(load_config(values={**common, "steps": 3, "out": str(tmp_path / "eager")}))
    out = tmp_path / "compiled"
    run_training(load_config(values={**common, "steps": 2, "compile": True, "out": str(out)}), Notes())
    assert any("compil" in n and "--set compile=false" not in n for n in notes), notes
    resumed = run_training(load_config(values={**common, "steps": 3, "compile": True, "out": str(out), "resume": True}))
    assert resumed.steps == 3
    want = {r["step"]: r for r in read_metrics(tmp_path / "eager") if "loss" in r}
    got = {r["step"]: r for r in read_metrics(out) if "loss" in r}
    assert sorted(got) == [1, 2, 3]
    losses = [(got[step]["loss"], want[step]["loss"]) for step in sorted(got)]
    assert losses[0][0] == pytest.approx(losses[0][1], rel=1e-5), losses  # the same weights, reordered sums
    for a, b in losses[1:]:  # after updates: Adam-type steps amplify the reordering of tiny gradients
        assert a == pytest.approx(b, rel=5e-3), losses
    evals = [r for r in read_metrics(out) if "val_loss" in r]
    assert evals and all(len(r["max_attention_logit"]) == 2 for r in evals)
    assert resumed.final_val_loss == pytest.approx(eager.final_val_loss, rel=5e-3)
    from safetensors.torch import load_file

    names = set(load_file(str(resumed.last_checkpoint / "model.safetensors")))
    assert names and not any("_orig_mod" in n for n in names)
    with contextlib.suppress(Exception):
        torch._dynamo.reset()
