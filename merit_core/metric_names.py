"""The names of the measurements merit records: keys of metrics.jsonl lines, of the callbacks'
records, of compare's summary and of inspect's report. One spelling, so that a reader and its
writer cannot drift apart. JSON files keep these exact strings."""

STEP = "step"
TOKENS = "tokens"
LOSS = "loss"
VAL_LOSS = "val_loss"
# Max over heads and positions of q.k / sqrt(d_head), per layer in a run's eval records: the
# quantity MERIT is built to keep bounded (docs/MERIT.md).
MAX_ATTENTION_LOGIT = "max_attention_logit"

# The probe's instability statistics (docs/DIAGNOSTICS.md). Attention entropy in nats, per layer
# and head (inspect) or per layer, min over heads (a run's eval records): mean / min over query
# positions, plain and divided by log(number of keys seen).
ATTENTION_ENTROPY_MEAN = "attention_entropy_mean"
ATTENTION_ENTROPY_MIN = "attention_entropy_min"
NORMALIZED_ENTROPY_MEAN = "normalized_attention_entropy_mean"
NORMALIZED_ENTROPY_MIN = "normalized_attention_entropy_min"
# The residual stream after each layer: max |h|, median |h|, their ratio, and where the max sits.
ACTIVATION_MAX = "activation_max"
ACTIVATION_MEDIAN = "activation_median"
ACTIVATION_RATIO = "activation_ratio"
ACTIVATION_MAX_POSITION = "activation_max_position"
ACTIVATION_MAX_DIM = "activation_max_dim"
# The output layer: the largest |logit| and log Z = logsumexp of the logits over positions.
OUTPUT_LOGIT_MAX = "output_logit_max_abs"
LOG_Z_MEAN = "log_z_mean"
LOG_Z_STD = "log_z_std"
LOG_Z_MAX = "log_z_max"
# RMS(next update) / RMS(weight) of a 2-D weight, from a checkpoint's optimizer state; the max over
# weights in a run's eval records.
UPDATE_RATIO = "update_rms_ratio"

# `merit train --watch` (merit_core/train/watch.py): one record every watch_every steps with the
# precursors on a few sequences of the first validation batch (per layer where a list) and the
# step's loss and grad norm; `watch_warnings` lists the warnings raised at that step, and
# `watch_rewind` says where an --on-instability rewind went back to and with which lr.
WATCH_LOSS = "watch_loss"
WATCH_GRAD_NORM = "watch_grad_norm"
WATCH_LOGIT = "watch_max_attention_logit"
WATCH_ENTROPY = "watch_normalized_attention_entropy_min"
WATCH_ACTIVATION = "watch_activation_ratio"
WATCH_LOG_Z = "watch_log_z_mean"
WATCH_UPDATE = "watch_update_rms_ratio"
WATCH_WARNINGS = "watch_warnings"
WATCH_REWIND = "watch_rewind"
