"""docs/TRAINING.md's Hugging Face Trainer example at the library's lr defaults: MERIT, built as the
example builds it (`build_optimizer(name, model, batch_size=, seq_len=)`, the lr measured for the
model's width and batch), reaches a lower training loss than AdamW built the same way, on a model
of gpt2-tiny's shape (the width its measured lrs are for) and a corpus with structure to learn."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]
VOCAB, SEQ, BATCH, STEPS = 256, 128, 16, 20


def docs_optimizer_line() -> str:
    """The optimizer line of docs/TRAINING.md's Trainer example."""
    text = (ROOT / "docs" / "TRAINING.md").read_text(encoding="utf-8")
    match = re.search(r"^optimizer = (build_optimizer\(.*\))", text, re.M)
    assert match is not None, "docs/TRAINING.md's Trainer example builds no optimizer with build_optimizer"
    return match.group(1).split("  #")[0]


def corpus(n: int) -> torch.Tensor:
    """Sequences of a fixed random bigram chain (each token has 4 likely successors): learnable."""
    g = torch.Generator().manual_seed(0)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=g)
    ids = torch.empty(n, SEQ, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(1, SEQ):
        pick = torch.randint(0, 4, (n,), generator=g)
        ids[:, t] = successors[ids[:, t - 1], pick]
    return ids


class Tokens(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def final_loss(name: str, tmp_path: Path) -> tuple[float, float]:
    """(the mean training loss of the last 5 steps, the lr build_optimizer chose) for optimizer `name`."""
    from transformers import Trainer, TrainingArguments

    from merit_core.optim import build_optimizer

    model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=1, n_head=4)
    call = docs_optimizer_line().replace('"merit"', repr(name))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        optimizer = eval(call, {"build_optimizer": build_optimizer, "model": model})
    assert any("lr" in str(w.message) for w in said)  # it says which lr it chose
    args = TrainingArguments(
        output_dir=str(tmp_path / name),
        per_device_train_batch_size=BATCH,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(corpus(BATCH * STEPS)), optimizers=(optimizer, None))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == STEPS
    return sum(losses[-5:]) / 5, optimizer.defaults["lr"]  # the scheduler has decayed the groups' lr to 0


@pytest.mark.slow
def test_docs_trainer_example_merit_beats_adamw_at_the_library_defaults(tmp_path: Path) -> None:
    assert docs_optimizer_line() == f'build_optimizer("merit", model, batch_size={BATCH}, seq_len={SEQ})'
    merit, merit_lr = final_loss("merit", tmp_path)
    adamw, adamw_lr = final_loss("adamw", tmp_path)
    from merit_core.optim.lr_table import ADAMW_LRS, MERIT_LRS

    # the measured gpt2-tiny entries at this batch (the model is that width; no name: nearest width)
    assert merit_lr == next(e.lr for e in MERIT_LRS if (e.model, e.batch_size, e.seq_len) == ("gpt2-tiny", BATCH, SEQ))
    assert adamw_lr == next(e.lr for e in ADAMW_LRS if (e.model, e.batch_size, e.seq_len) == ("gpt2-tiny", BATCH, SEQ))
    assert merit < adamw, (merit, adamw)
