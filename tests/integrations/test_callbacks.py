"""MaxAttentionLogitCallback in Hugging Face Trainer and in Lightning, on a tiny GPT-2."""

import pytest
import torch

from merit_core.models.attention_probe import max_attention_logits, probe_attention
from tests.tiny_models import tiny_gpt2

VOCAB, SEQ = 64, 16


def batches(n):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def assert_precursors(logged, model, probe):
    """The instability precursors logged beside the logit equal a direct probe of the trained model."""
    direct = probe_attention(model, probe, instability=True)
    assert logged["normalized_attention_entropy_min"] == pytest.approx(
        float(direct.entropy["normalized_min"].min()), rel=1e-5
    )
    assert logged["activation_ratio"] == pytest.approx(max(a.ratio for a in direct.activations), rel=1e-5)
    assert logged["log_z_mean"] == pytest.approx(direct.output.log_z_mean, rel=1e-5)


def test_hf_trainer_logs_max_attention_logit(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import Trainer, TrainingArguments

    from merit_core import MERIT
    from merit_core.integrations.transformers import MaxAttentionLogitCallback

    model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, n_head=4)
    probe = batches(2)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=4,
        logging_steps=2,
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    optimizer = MERIT(model.parameters(), lr=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(batches(16)), optimizers=(optimizer, None))
    callback = MaxAttentionLogitCallback(trainer, probe, every_n_steps=2)
    trainer.add_callback(callback)
    trainer.train()

    logged = [h for h in trainer.state.log_history if "max_attention_logit" in h]
    assert [h["step"] for h in logged] == [0, 2, 4]
    expected = max_attention_logits(model, probe).amax(dim=1)  # the trained model, measured directly
    assert logged[-1]["max_attention_logit"] == pytest.approx(float(expected.max()), rel=1e-5)
    assert logged[-1]["max_attention_logit/layer_1"] == pytest.approx(float(expected[1]), rel=1e-5)
    assert_precursors(logged[-1], model, probe)
    without = MaxAttentionLogitCallback(trainer, probe, precursors=False).measure(model)
    assert set(without) == {"max_attention_logit", "max_attention_logit/layer_0", "max_attention_logit/layer_1"}
    # Trainer's own trackers got it: its TensorBoard callback wrote the scalar
    (event_file,) = (tmp_path / "out").rglob("events.out.tfevents.*")  # output_dir/runs/<date>/
    events = EventAccumulator(str(event_file.parent))
    events.Reload()
    assert "train/max_attention_logit" in events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("train/max_attention_logit")] == [0, 2, 4]


TRAINER_KEYS = ("loss", "learning_rate", "grad_norm", "epoch", "step")


def _hf_run(tmp_path, every_n_steps=None):
    """8 MERIT steps logged every 2 steps; with the callback every `every_n_steps` (none: no callback)."""
    from transformers import Trainer, TrainingArguments

    from merit_core import MERIT
    from merit_core.integrations.transformers import MaxAttentionLogitCallback

    model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, n_head=4)
    args = TrainingArguments(
        output_dir=str(tmp_path / f"out-{every_n_steps}"),
        per_device_train_batch_size=4,
        max_steps=8,
        logging_steps=2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    optimizer = MERIT(model.parameters(), lr=1e-2)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(batches(32)), optimizers=(optimizer, None))
    if every_n_steps is not None:
        trainer.add_callback(MaxAttentionLogitCallback(trainer, batches(2), every_n_steps=every_n_steps))
    trainer.train()
    own = [
        {k: h[k] for k in TRAINER_KEYS if k in h}
        for h in trainer.state.log_history
        if "max_attention_logit" not in h and "train_runtime" not in h  # the end-of-training summary times itself
    ]
    logits = [h["step"] for h in trainer.state.log_history if "max_attention_logit" in h]
    return own, logits


def test_hf_callback_leaves_the_trainers_own_logs_alone(tmp_path):
    """Unequal intervals (log every 2 steps, measure every 4 or 3): every loss / lr / grad-norm record
    the Trainer writes is there and the same, and the logit is recorded at its own steps."""
    plain, none = _hf_run(tmp_path)
    assert [r["step"] for r in plain] == [2, 4, 6, 8] and none == []
    assert all(set(TRAINER_KEYS) <= set(r) for r in plain)
    for every, steps in ((4, [0, 4, 8]), (3, [0, 3, 6])):
        own, logits = _hf_run(tmp_path, every)
        assert own == plain, f"every_n_steps={every} changed the Trainer's own records"
        assert logits == steps


def test_hf_callback_needs_the_trainer():
    from merit_core.integrations.transformers import MaxAttentionLogitCallback

    with pytest.raises(TypeError, match="needs the transformers Trainer"):
        MaxAttentionLogitCallback(batches(1), batches(1))
    from merit_core.integrations import check_every

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_n_steps"):
            check_every(bad)


def test_lightning_logs_max_attention_logit(tmp_path):
    lightning = pytest.importorskip("lightning")  # in the [dev] extra
    from lightning.pytorch.loggers import CSVLogger

    from merit_core import MERIT
    from merit_core.integrations.lightning import MaxAttentionLogitCallback

    class LitGPT(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, n_head=4)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return MERIT(self.parameters(), lr=1e-2)

    module = LitGPT()
    probe = batches(2)
    trainer = lightning.Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=CSVLogger(str(tmp_path)),
        callbacks=[MaxAttentionLogitCallback(probe, every_n_steps=2)],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches(16), batch_size=4))
    import csv

    with open(f"{trainer.logger.log_dir}/metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    logged = [{k: float(v) for k, v in r.items() if v != ""} for r in rows if r.get("max_attention_logit")]
    assert [m["step"] for m in logged] == [0, 2, 4]
    expected = max_attention_logits(module.model, probe).amax(dim=1)
    assert logged[-1]["max_attention_logit"] == pytest.approx(float(expected.max()), rel=1e-5)
    assert logged[-1]["max_attention_logit/layer_0"] == pytest.approx(float(expected[0]), rel=1e-5)
    assert_precursors(logged[-1], module.model, probe)


def _lightning_run(tmp_path, every_n_steps=None):
    """8 MERIT steps, `loss` and `lr` logged by the module every 2 steps; the callback every `every_n_steps`."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from merit_core import MERIT
    from merit_core.integrations.lightning import MaxAttentionLogitCallback

    class LitGPT(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, n_head=4)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.log("loss", loss)
            self.log("lr", self.optimizers().param_groups[0]["lr"])
            return loss

        def configure_optimizers(self):
            return MERIT(self.parameters(), lr=1e-2)

    lightning.seed_everything(0, verbose=False)
    module = LitGPT()
    callbacks = [] if every_n_steps is None else [MaxAttentionLogitCallback(batches(2), every_n_steps=every_n_steps)]
    trainer = lightning.Trainer(
        max_steps=8,
        accelerator="cpu",
        logger=CSVLogger(str(tmp_path), name=f"run-{every_n_steps}"),
        callbacks=callbacks,
        log_every_n_steps=2,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches(32), batch_size=4))
    import csv

    with open(f"{trainer.logger.log_dir}/metrics.csv") as fh:
        rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(fh)]
    own = [{k: r[k] for k in ("loss", "lr", "epoch", "step") if k in r} for r in rows if "max_attention_logit" not in r]
    logits = [int(r["step"]) for r in rows if "max_attention_logit" in r]
    return own, logits


def test_lightning_callback_leaves_lightnings_own_logs_alone(tmp_path):
    plain, none = _lightning_run(tmp_path)
    assert len(plain) == 4 and all({"loss", "lr"} <= set(r) for r in plain) and none == []
    own, logits = _lightning_run(tmp_path, 3)  # measured at steps Lightning does not log at, and at one it does
    assert own == plain
    assert logits == [0, 3, 6]
