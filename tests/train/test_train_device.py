"""Device-facing pieces of training, checked on CPU: the chunked loss, the micro-batch choice,
pinned/contiguous batches, device selection under torchrun, TF32 and MFU bookkeeping."""

from __future__ import annotations

import dataclasses
import tomllib
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from merit_core.errors import ConfigError
from merit_core.train import hardware, lm_loss
from merit_core.train.batches import TrainBatches, to_device
from merit_core.train.config import load_config, resolve
from merit_core.train.trainer import activation_bytes_per_sequence, largest_fitting, optimizer_state_reserve
from tests.tiny_models import NO_DROPOUT, tiny_gpt2, tiny_llama

# the tiny models of these tests: a 97-token vocabulary, 4 heads (2 key heads for the Llama)
_gpt2 = partial(tiny_gpt2, vocab_size=97, n_head=4, **NO_DROPOUT)
_llama = partial(tiny_llama, vocab_size=97, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _loss_and_grads(model, x, y, chunk_tokens=None, scale=1.0, **head_args):
    model.zero_grad(set_to_none=True)
    if chunk_tokens is None:  # the plain computation: full fp32 logits
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    else:
        head = lm_loss.install(model, chunk_tokens, **head_args)
        assert head is not None
        with lm_loss.targets_for(head, y) as summed:
            loss = model(input_ids=x, use_cache=False).logits
        assert summed and loss.ndim == 0
    (loss * scale).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(grads, ref_grads, rel):
    """Each gradient within `rel` x its reference's largest entry (the chunked loss's gradients come
    from softmax - onehot, made in forward; the plain ones from log_softmax's backward: measured worst
    3.7e-7 of the largest entry, fp32, CPU, well inside the reordering bound used below)."""
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=rel * float(g.abs().max()), msg=name)


@pytest.mark.float_compare
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama-gqa"])
def test_chunked_loss_equals_full_logits_loss_and_gradients(build):
    model = build()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 97, (3, 20), generator=gen)
    y = torch.randint(0, 97, (3, 20), generator=gen)
    ref_loss, ref_grads = _loss_and_grads(model, x, y)
    # Chunking only reorders float32 sums: the loss is a sum of n = 60 positive per-token terms and
    # each gradient entry a sum of n per-token contributions. Two orders of an n-term sum differ by
    # at most 2(n-1)u * sum|terms| (u = 2^-24, Higham's bound); with every contribution at most the
    # tensor's largest entry, that is 2nu * max|g|. Both bounds hold on any thread count (the BLAS
    # splits its sums differently per thread count). A real bug, a token dropped or counted twice at
    # a chunk boundary, moves the sums by about 1/n of their size: ~10^5 times these bounds.
    n, u = x.numel(), 2.0**-24
    for chunk in (7, 60, 1000):  # uneven chunks, exactly one sequence-batch, a single chunk
        loss, grads = _loss_and_grads(model, x, y, chunk)
        torch.testing.assert_close(loss, ref_loss, rtol=2 * n * u, atol=0)
        assert_grads_close(grads, ref_grads, 2 * n * u)
    # the gradient made in forward is scaled by the incoming one (the trainer backpropagates loss * scale)
    _, scaled = _loss_and_grads(model, x, y, 7, scale=0.25)
    assert_grads_close(scaled, {name: 0.25 * g for name, g in ref_grads.items()}, 2 * n * u)
    with torch.no_grad():  # evaluation: the loss only
        head = lm_loss.install(model, 7)
        with lm_loss.targets_for(head, y):
            torch.testing.assert_close(model(input_ids=x).logits, ref_loss, rtol=2 * n * u, atol=0)
    # outside targets_for the head is an ordinary output layer again, with unchanged parameter names
    head = model.get_output_embeddings()
    assert isinstance(head, torch.nn.Linear) and head.targets is None
    assert model(input_ids=x).logits.shape == (3, 20, 97)
    assert set(model.state_dict()) == set(build().state_dict())


@pytest.mark.float_compare
def test_chunked_loss_under_bf16_autocast_matches_the_plain_bf16_loss():
    model = _gpt2()
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = _loss_and_grads(model, x, x)
        loss, _ = _loss_and_grads(model, x, x, chunk_tokens=5)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=0)


def test_models_that_change_their_logits_keep_the_plain_loss():
    model = _gpt2()
    model.config.final_logit_softcapping = 30.0
    assert lm_loss.install(model) is None
    with lm_loss.targets_for(None, torch.zeros(1)) as summed:
        assert not summed


def test_chunk_size_follows_the_vocabulary():
    assert lm_loss.chunk_tokens_for(50257) == 256 * 2**20 // (4 * 50257)
    assert lm_loss.chunk_tokens_for(10**12) == 1


def test_micro_batch_search_halves_to_the_largest_fitting_divisor():
    tried = []

    def fits_up_to(limit):
        def fits(size):
            tried.append(size)
            return size <= limit

        return fits

    assert largest_fitting(64, fits_up_to(64)) == 64 and tried == [64]
    tried.clear()
    assert largest_fitting(64, fits_up_to(20)) == 16 and tried == [64, 32, 16]
    tried.clear()
    assert largest_fitting(60, fits_up_to(12)) == 6 and tried == [60, 30, 15, 6]  # 6: the largest divisor <= 15 / 2
    assert largest_fitting(8, fits_up_to(0)) == 1


def test_gpu_search_treats_cuda_oom_as_does_not_fit(monkeypatch, model_cfg, data_dir, tmp_path):
    """The CUDA path of choose_micro_batch, driven on CPU: a fake out-of-memory above 4 sequences."""
    from merit_core.data import open_tokens
    from merit_core.models import build_model, model_config
    from merit_core.train.distributed import Parallel
    from merit_core.train.trainer import build_trainer

    config = resolve(
        load_config(
            values={
                "model": str(model_cfg),
                "batch_size": 16,
                "seq_len": 16,
                "optimizer": "adamw",
                "lr": 1e-3,
                "weight_decay": 0.0,
            }
        ),
        auto_micro_batch=True,
    ).config
    assert config.micro_batch_size is None
    model = build_model(model_config(str(model_cfg), vocab_size=320), seed=0)
    trainer = build_trainer(
        config, model, Parallel(torch.device("cpu")), open_tokens(data_dir, "train"), open_tokens(data_dir, "val")
    )
    sizes = []
    real_loss = trainer._loss

    def loss(module, x, y, scale):
        sizes.append(len(x))
        if len(x) > 4:
            raise torch.cuda.OutOfMemoryError("fake")
        return real_loss(module, x, y, scale)

    monkeypatch.setattr(trainer, "_loss", loss)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    fork_rng = torch.random.fork_rng
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=None: fork_rng(devices=[]))
    rng = torch.get_rng_state()
    assert trainer._fits_on_gpu(4) and not trainer._fits_on_gpu(8)
    monkeypatch.setattr(trainer, "_fits_in_host_memory", trainer._fits_on_gpu)  # the search, as on CUDA
    assert trainer.choose_micro_batch() == 4 and config.micro_batch_size is None  # returned, not written
    assert sizes == [4, 8, 16, 8, 4]
    assert all(p.grad is None for p in model.parameters())  # the tries leave no gradients
    assert torch.equal(torch.get_rng_state(), rng)  # nor a different random stream
    trainer.config = dataclasses.replace(config, micro_batch_size=4)  # what TrainingRun does with the choice
    assert trainer.n_micro == 4 and trainer.choose_micro_batch() == 4 and sizes == [4, 8, 16, 8, 4]  # no new search


def test_cpu_choice_is_the_whole_batch_unless_memory_is_short(monkeypatch):
    class Cfg:
        num_hidden_layers, hidden_size, num_attention_heads = 12, 768, 12

    per_seq = activation_bytes_per_sequence(Cfg, 1024)
    assert per_seq == 2 * 12 * 1024 * (34 * 768 + 5 * 12 * 1024)
    model = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    assert optimizer_state_reserve(model, opt) == 2 * 4 * 110
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    assert optimizer_state_reserve(model, opt) == 0


def test_micro_batch_auto_in_config_cli_and_saved_config(model_cfg, data_dir, tmp_path):
    from click.testing import CliRunner

    from merit_cli.main import cli

    assert load_config(overrides=["micro_batch_size=auto"]).micro_batch_size is None
    assert load_config(values={"micro_batch_size": "auto"}).micro_batch_size is None
    plain = resolve(load_config(values={"batch_size": 8, "lr": 1e-3, "weight_decay": 0.0})).config
    assert plain.micro_batch_size == 8  # library default: the batch
    with pytest.raises(ConfigError, match="micro_batch_size must be an integer"):
        load_config(overrides=["micro_batch_size=lots"])
    out = tmp_path / "run"
    args = ["train", "--model", str(model_cfg), "--data", str(data_dir), "--out", str(out), "--steps", "1"]
    args += ["--batch-size", "4", "--seq-len", "16", "--micro-batch-size", "auto", "--no-tf32", "--device", "cpu"]
    args += ["--set", "eval_batches=1", "--set", "eval_batch_size=2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    saved = tomllib.loads((out / "config.toml").read_text())
    assert saved["micro_batch_size"] == 4 and saved["tf32"] is False  # CPU: the whole batch; recorded
    text = " ".join(result.output.split())  # rich wraps lines at the test terminal's width
    assert "tf32 off (no effect on CPU)" in text and "MFU not reported on CPU" in text
    assert "peak RSS" in text
    bad = CliRunner().invoke(cli, [*args[:-4], "--micro-batch-size", "many"])
    assert bad.exit_code == 2 and "--micro-batch-size must be an integer" in bad.output


def test_batches_are_contiguous_and_copied_synchronously_unless_pinned():
    tokens = np.arange(5000, dtype=np.uint16) % 97
    ((x, y),) = list(TrainBatches(tokens, seq_len=16, seed=0).micro_batches(0, batch_size=4, micro_batch_size=4))
    assert x.is_contiguous() and y.is_contiguous() and not x.is_pinned()
    assert torch.equal(x[:, 1:], y[:, :-1])
    calls = []

    class Spy(torch.Tensor):
        def to(self, *args, **kw):
            calls.append(kw.get("non_blocking"))
            return torch.Tensor.to(self, *args, **kw)

    to_device((x.as_subclass(Spy), y.as_subclass(Spy)), torch.device("cpu"))
    assert calls == [False, False]


def test_set_device_happens_even_when_the_group_exists(monkeypatch):
    import torch.distributed as dist

    from merit_core.train import parallel as distributed

    chosen = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # someone else created the group
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("must not create a group"))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    parallel = distributed.setup_parallel("ddp", "auto")
    assert chosen == [torch.device("cuda:1")] and parallel.device == torch.device("cuda:1")
    assert not parallel._owns_group


def test_peak_table_and_mfu():
    assert hardware.peak_bf16_flops("NVIDIA H200") == 989e12
    assert hardware.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert hardware.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert hardware.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert hardware.peak_bf16_flops("NVIDIA L4") == 121e12
    assert hardware.peak_bf16_flops("NVIDIA L40S") == 362e12
    assert hardware.peak_bf16_flops("Tesla T4") is None
    assert hardware.mfu(124_000_000, 500_000, 989e12) == pytest.approx(6 * 124e6 * 5e5 / 989e12)
    assert hardware.mfu(124_000_000, 500_000, None) is None and hardware.mfu(1, None, 1e12) is None
    info = hardware.device_info(torch.device("cpu"))
    assert info.peak_flops is None and info.total_memory is None and info.name
    assert hardware.peak_memory(torch.device("cpu")) > 10 * 2**20  # peak RSS of this Python process


def test_start_line_on_a_gpu_names_device_dtype_tf32_and_the_mfu_peak():
    from pathlib import Path

    from merit_cli.train_cmd import device_line, peak_memory_text
    from merit_core.train.callbacks import RunInfo

    def info(name, peak, dtype="bfloat16"):
        return RunInfo(
            Path("r"), load_config(), 1, 1, 0, 1, 1, 1, "cuda:0", Path("d"), None, name, dtype, True, peak, 141 * 2**30
        )

    line = device_line(info("NVIDIA H200", 989e12))
    assert line == "device NVIDIA H200 (141 GiB), bf16 autocast, tf32 on, MFU against a 989 TFLOP/s bf16 peak"
    assert "MFU not reported (GPU not in" in device_line(info("Tesla T4", None, "float32"))
    assert peak_memory_text(3 * 2**30, "cuda:0") == "3.00 GiB (allocated on the GPU)"
