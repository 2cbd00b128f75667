"""The max attention logit in Lightning's logs (and so in every logger of the Lightning ``Trainer``).

    from merit_core.integrations.lightning import MaxAttentionLogitCallback

    trainer = lightning.Trainer(callbacks=[MaxAttentionLogitCallback(probe_ids, every_n_steps=50)], logger=...)

Every `every_n_steps` optimizer steps (``trainer.global_step``), the callback runs the
transformers model once on the fixed probe batch and logs ``max_attention_logit`` and
``max_attention_logit/layer_{i}`` to each of ``trainer.loggers`` at that step (on rank zero).
The model is the LightningModule itself when it is a transformers model, else its attribute
`model_attr` (default ``"model"``). Works for every model family the probe supports.
Written against Lightning 2.x's documented ``Callback`` API (``lightning.pytorch``, or the older
``pytorch_lightning`` package).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from merit_core.errors import MissingDependencyError
from merit_core.extras import is_installed
from merit_core.integrations import METRIC, ProbeSchedule

if TYPE_CHECKING:  # the type checker sees one Callback class; at run time, either package's
    from lightning.pytorch import Callback
elif is_installed("lightning"):
    from lightning.pytorch import Callback
elif is_installed("pytorch_lightning"):
    from pytorch_lightning import Callback
else:
    raise MissingDependencyError("merit_core.integrations.lightning needs Lightning: pip install lightning")


def _transformers_model(pl_module: Any, model_attr: str) -> Any:
    if hasattr(pl_module, "set_attn_implementation") and hasattr(pl_module, "config"):
        return pl_module
    model = getattr(pl_module, model_attr, None)
    if model is None or not hasattr(model, "set_attn_implementation"):
        raise TypeError(
            f"MaxAttentionLogitCallback: {type(pl_module).__name__}.{model_attr} is not a transformers model; "
            "pass model_attr= the attribute that holds it"
        )
    return model


class MaxAttentionLogitCallback(ProbeSchedule, Callback):
    """Log the max attention logit (per layer and overall) of a fixed probe batch every N optimizer steps.

    Args:
        probe_input_ids: token ids, [batch, seq] or [seq].
        every_n_steps: measure when ``trainer.global_step`` is a multiple of this.
        attention_mask: optional mask for the probe batch (1 = attend).
        model_attr: the LightningModule attribute holding the transformers model.
        at_start: also measure before the first step.
        prefix: the metric name (``prefix`` and ``prefix/layer_i``).
        precursors: also log the smallest normalised attention entropy, the largest activation
            ratio and the mean log Z of the same forward pass (see merit_core.integrations).
    """

    def __init__(
        self,
        probe_input_ids: Any,
        every_n_steps: int = 50,
        *,
        attention_mask: Any = None,
        model_attr: str = "model",
        at_start: bool = True,
        prefix: str = METRIC,
        precursors: bool = True,
    ):
        super().__init__(probe_input_ids, every_n_steps, attention_mask, at_start, prefix, precursors)
        self.model_attr = model_attr

    def measure(self, pl_module: Any) -> dict[str, float]:
        return self.measure_model(_transformers_model(pl_module, self.model_attr))

    def _log(self, trainer: Any, pl_module: Any) -> None:
        step = int(trainer.global_step)
        if not self.first_at(step):  # several batches per optimizer step under gradient accumulation
            return
        values = self.measure(pl_module)
        if trainer.is_global_zero:
            # straight to the loggers, at this optimizer step: LightningModule.log would repeat the
            # value at every later logging step until the next measurement
            for logger in trainer.loggers:
                logger.log_metrics(values, step=step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at_start and trainer.global_step == 0 and self.last_step is None:
            self._log(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step % self.every_n_steps == 0:
            self._log(trainer, pl_module)
