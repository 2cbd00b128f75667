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
