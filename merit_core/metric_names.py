"""The names of the measurements merit records: keys of metrics.jsonl lines, of the callbacks'
records, of compare's summary and of inspect's report. One spelling, so that a reader and its
writer cannot drift apart. JSON files keep these exact strings. `Final`: a type checker reads each as its literal string, so
that it checks them as keys of merit_core.metrics.MetricsRecord."""

from typing import Final

STEP: Final = "step"
TOKENS: Final = "tokens"
LOSS: Final = "loss"
# A log line's learning rate, global gradient norm (before clipping) and training throughput.
LR: Final = "lr"
GRAD_NORM: Final = "grad_norm"
TOKENS_PER_S: Final = "tokens_per_s"
VAL_LOSS: Final = "val_loss"
# Max over heads and positions of q.k / sqrt(d_head), per layer in a run's eval records: the
# quantity MERIT is built to keep bounded (docs/MERIT.md).
MAX_ATTENTION_LOGIT: Final = "max_attention_logit"

# The probe's instability statistics (docs/DIAGNOSTICS.md). Attention entropy in nats, per layer
# and head (inspect) or per layer, min over heads (a run's eval records): mean / min over query
# positions, plain and divided by log(number of keys seen).
ATTENTION_ENTROPY_MEAN: Final = "attention_entropy_mean"
ATTENTION_ENTROPY_MIN: Final = "attention_entropy_min"
NORMALIZED_ENTROPY_MEAN: Final = "normalized_attention_entropy_mean"
NORMALIZED_ENTROPY_MIN: Final = "normalized_attention_entropy_min"
# The residual stream after each layer: max |h|, median |h|, their ratio, and where the max sits.
ACTIVATION_MAX: Final = "activation_max"
ACTIVATION_MEDIAN: Final = "activation_median"
ACTIVATION_RATIO: Final = "activation_ratio"
ACTIVATION_MAX_POSITION: Final = "activation_max_position"
ACTIVATION_MAX_DIM: Final = "activation_max_dim"
# The output layer: the largest |logit| and log Z = logsumexp of the logits over positions.
OUTPUT_LOGIT_MAX: Final = "output_logit_max_abs"
LOG_Z_MEAN: Final = "log_z_mean"
LOG_Z_STD: Final = "log_z_std"
LOG_Z_MAX: Final = "log_z_max"
# RMS(next update) / RMS(weight) of a 2-D weight, from a checkpoint's optimizer state; the max over
# weights in a run's eval records.
UPDATE_RATIO: Final = "update_rms_ratio"

# `merit train --watch` (merit_core/train/watch_detector.py): one record every watch_every steps with the
# precursors on a few sequences of the first validation batch (per layer where a list) and the
# step's loss and grad norm; `watch_warnings` lists the warnings raised at that step, and
# `watch_rewind` says where an --on-instability rewind went back to and with which lr.
WATCH_LOSS: Final = "watch_loss"
WATCH_GRAD_NORM: Final = "watch_grad_norm"
WATCH_LOGIT: Final = "watch_max_attention_logit"
WATCH_ENTROPY: Final = "watch_normalized_attention_entropy_min"
WATCH_ACTIVATION: Final = "watch_activation_ratio"
WATCH_LOG_Z: Final = "watch_log_z_mean"
WATCH_UPDATE: Final = "watch_update_rms_ratio"
WATCH_WARNINGS: Final = "watch_warnings"
WATCH_REWIND: Final = "watch_rewind"
