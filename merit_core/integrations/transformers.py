"""The max attention logit in Hugging Face ``Trainer`` logs (and so in its TensorBoard / W&B / MLflow reports).

    from merit_core import MERIT
    from merit_core.integrations.transformers import MaxAttentionLogitCallback

    trainer = Trainer(model=model, args=args, train_dataset=train, optimizers=(MERIT(model.parameters(), lr=6e-3), None))
    trainer.add_callback(MaxAttentionLogitCallback(trainer, probe_ids, every_n_steps=50))
    trainer.train()

Every `every_n_steps` optimizer steps (and at step 0 when `at_start`), the callback runs the
model once on the fixed probe batch and calls ``trainer.log`` with ``max_attention_logit`` and
``max_attention_logit/layer_{i}``: the values land in ``trainer.state.log_history`` and go to
every tracker in ``args.report_to``. The callback needs the trainer to log through it (as TRL's
WinRateCallback does): a value written into another callback's ``logs`` would miss the trackers,
which Trainer calls first. Works for every model family the probe supports (transformers' attention
interface: GPT-2, Llama, Qwen, Mistral, ...); the model is the Trainer's unwrapped model.

The Trainer's own log records are left as they are. ``Trainer.log`` ends in
``CallbackHandler.on_log``, which clears ``control.should_log``; called from ``on_step_end`` (after
``DefaultFlowCallback`` has set the flag for a logging step, before the Trainer reads it) that would
skip the Trainer's loss / learning-rate / grad-norm record of the step and fold its loss into the
next record's average. So the callback puts ``should_log`` back as it found it after logging.
"""

from __future__ import annotations

from typing import Any

from merit_core.extras import require
from merit_core.integrations import METRIC, ProbeSchedule

require("transformers", "merit_core.integrations.transformers", "transformers")

from transformers import Trainer, TrainerCallback  # noqa: E402


class MaxAttentionLogitCallback(ProbeSchedule, TrainerCallback):
    """Log the max attention logit (per layer and overall) of a fixed probe batch every N steps.

    Args:
        trainer: the ``transformers.Trainer`` whose ``log`` receives the values.
        probe_input_ids: token ids, [batch, seq] or [seq] (a fixed batch, e.g. a few validation sequences).
        every_n_steps: measure when ``state.global_step`` is a multiple of this.
        attention_mask: optional mask for the probe batch (1 = attend).
        at_start: also measure at step 0, before training.
        prefix: the metric name (``prefix`` and ``prefix/layer_i``).
        precursors: also log the smallest normalised attention entropy, the largest activation
            ratio and the mean log Z of the same forward pass (see merit_core.integrations).
    """

    def __init__(
        self,
        trainer: Any,
        probe_input_ids: Any,
        every_n_steps: int = 50,
        *,
        attention_mask: Any = None,
        at_start: bool = True,
        prefix: str = METRIC,
        precursors: bool = True,
    ):
        if not isinstance(trainer, Trainer):
            raise TypeError("MaxAttentionLogitCallback needs the transformers Trainer as its first argument")
        super().__init__(probe_input_ids, every_n_steps, attention_mask, at_start, prefix, precursors)
        self.trainer = trainer

    def measure(self, model: Any) -> dict[str, float]:
        """The metrics on the probe batch now (also usable outside training)."""
        return self.measure_model(model)

    def _log(self, state, control, model) -> None:
        if model is None or not self.first_at(state.global_step):
            return
        should_log = control.should_log  # Trainer.log -> on_log clears it: the Trainer's own record would be lost
        self.trainer.log(dict(self.measure(model)))
        control.should_log = should_log

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.at_start and state.global_step == 0:
            self._log(state, control, model)
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % self.every_n_steps == 0:
            self._log(state, control, model)
        return control
