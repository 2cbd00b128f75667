"""Every registry optimizer trains in the loop, and its state survives a weights_only round trip."""

import io

import numpy as np
import pytest
import torch

from merit_core.optim import OPTIMIZER_NAMES
from merit_core.train.config import TrainConfig, resolve
from merit_core.train.distributed import Parallel
from merit_core.train.trainer import build_trainer
from tests.prepared_data import TINY_GPT2

TOKENS = (np.arange(20_000) * 7 % 251).astype(np.uint16)  # a periodic stream: easy to learn


def make_trainer(optimizer, **changes):
    from transformers import GPT2Config

    from merit_core.models import build_model

    config = resolve(
        TrainConfig(
            model="tiny",
            optimizer=optimizer,
            batch_size=8,
            micro_batch_size=4,
            seq_len=16,
            steps=20,
            eval_batches=1,
            eval_batch_size=2,
            out="unused",
            **changes,
        ),
    ).config
    model = build_model(GPT2Config(**{**TINY_GPT2, "vocab_size": 256}), seed=0)
    return build_trainer(config, model, Parallel(torch.device("cpu")), TOKENS, TOKENS[:2000])


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_optimizer_trains_and_its_state_loads_with_weights_only(name):
    trainer = make_trainer(name)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    for _ in range(3):
        out = trainer.train_step()
    assert torch.isfinite(out.loss) and torch.isfinite(out.grad_norm)
    assert trainer.first_nonfinite_step() is None
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    for group, scale in zip(trainer.optimizer.param_groups, trainer.lr_scales):  # schedule applied to every group
        assert group["lr"] == pytest.approx(trainer.lr_for(2) * scale)
    buffer = io.BytesIO()
    torch.save(trainer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = make_trainer(name)
    fresh.load_state_dict(state)
    assert fresh.step == 3


def test_sophia_hessian_is_refreshed_every_k_steps():
    trainer = make_trainer("sophiag", optimizer_args={"hessian_interval": 2})
    assert trainer.hook_every == 2  # the cadence is read from the optimizer the spec's hook belongs to

    def hessians():
        return [
            trainer.optimizer.state[p]["hessian"].abs().sum().item()
            for p in trainer.model.parameters()
            if p in trainer.optimizer.state
        ]

    trainer.train_step()
    assert all(h == 0 for h in hessians())  # step 1: not yet
    trainer.train_step()
    refreshed = hessians()
    assert refreshed and all(h > 0 for h in refreshed)  # after step 2 (index 1 = k - 1)
    trainer.train_step()
    assert hessians() == refreshed  # step 3: unchanged
    assert make_trainer("adamw").hook is None


def test_llama_trains_and_evaluates_per_layer():
    from transformers import LlamaConfig

    from merit_core.models import build_model

    config = resolve(
        TrainConfig(
            model="tiny-llama",
            optimizer="merit",
            lr=1e-2,
            batch_size=4,
            micro_batch_size=2,
            seq_len=16,
            steps=5,
            eval_batches=2,
            eval_batch_size=2,
            out="unused",
        ),
    ).config
    model = build_model(
        LlamaConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            tie_word_embeddings=False,
        ),
        seed=0,
    )
    trainer = build_trainer(config, model, Parallel(torch.device("cpu")), TOKENS, TOKENS[:2000])
    first = trainer.evaluate()
    for _ in range(5):
        trainer.train_step()
    last = trainer.evaluate()
    assert len(last["max_attention_logit"]) == 3 and last["val_loss"] < first["val_loss"]
