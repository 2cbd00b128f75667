"""The watcher's detector (merit_core/train/watch_detector.py) on synthetic precursor series: a healthy run
whose signals grow and level off raises nothing; a max logit that starts growing exponentially is
warned within a few probes of its start, naming the signal and the layer; a one-probe spike that
falls back, noise on a flat history and a drift of log Z both ways are judged as the rules say."""

import math
import random

from merit_core.instability_rules import WatchSettings
from merit_core.metric_names import (
    WATCH_ACTIVATION,
    WATCH_ENTROPY,
    WATCH_GRAD_NORM,
    WATCH_LOG_Z,
    WATCH_LOGIT,
    WATCH_LOSS,
)
from merit_core.train.watch_detector import Watcher, replay

EVERY, WARMUP, STEPS = 2, 10, 200


def healthy(step: int, rng: random.Random) -> dict:
    """Precursors of a healthy run: logits and activations grow and level off, entropy and loss fall
    and level off, the grad norm wanders around 1; a few percent of multiplicative noise on each."""
    noise = lambda: math.exp(rng.gauss(0.0, 0.02))  # noqa: E731
    level = 1 - math.exp(-step / 40)
    return {
        "step": step,
        WATCH_LOSS: (7.0 - 3.0 * level) * noise(),
        WATCH_GRAD_NORM: 1.0 * math.exp(rng.gauss(0.0, 0.1)),
        WATCH_LOGIT: [(0.5 + 4.0 * level) * noise(), (0.3 + 2.0 * level) * noise()],
        WATCH_ENTROPY: [(0.95 - 0.3 * level) * noise(), (0.97 - 0.2 * level) * noise()],
        WATCH_ACTIVATION: [(3.0 + 2.0 * level) * noise(), (2.0 + 1.0 * level) * noise()],
        WATCH_LOG_Z: 7.0 - 1.0 * level + rng.gauss(0.0, 0.01),
    }


def series(onset: int | None = None, seed: int = 0) -> list[dict]:
    """A run's watch records; from `onset` on, layer 1's max logit grows by 6% per step."""
    rng = random.Random(seed)
    records = []
    for step in range(EVERY, STEPS + 1, EVERY):
        record = healthy(step, rng)
        if onset is not None and step > onset:
            record[WATCH_LOGIT][1] *= math.exp(0.06 * (step - onset))
        records.append(record)
    return records


def test_a_healthy_run_raises_no_warning():
    for seed in range(5):
        assert replay(series(seed=seed), WARMUP) == []
        assert replay(series(seed=seed), 0) == []  # also when the first records are judged


def test_an_exponentially_growing_logit_is_warned_within_a_few_probes():
    onset = 120
    for seed in range(5):
        found = replay(series(onset, seed), WARMUP)
        assert found, "no warning"
        first = found[0]
        assert (first.signal, first.layer) == ("max_logit", 1)
        # the slope must pass z * slope_floor = 0.04 per step above the history's: log(1 + x) of a
        # logit near 2.5 growing 6% a step rises ~0.04 per step at first, faster as it grows; with
        # `confirm` records in a row that is at most 12 probes (24 steps) after the onset
        assert onset < first.step <= onset + 24
        assert f"step {first.step}: max_logit in layer 1 rising" in first.line()


def test_a_spike_that_falls_back_and_a_noisy_flat_history_do_not_warn():
    records = series(seed=1)
    records[60][WATCH_LOGIT][0] *= 3.0  # one probe far above, the next back to normal
    assert replay(records, WARMUP) == []
    rng = random.Random(2)
    flat = [{"step": s, WATCH_GRAD_NORM: math.exp(rng.gauss(0.0, 0.3))} for s in range(2, 400, 2)]
    assert replay(flat, WARMUP) == []


def test_log_z_drift_is_judged_both_ways():
    for sign in (1, -1):
        records = series(seed=3)
        for r in records:
            if r["step"] > 100:
                r[WATCH_LOG_Z] += sign * 0.15 * (r["step"] - 100)
        found = replay(records, WARMUP)
        assert found and found[0].signal == "log_z_drift" and 100 < found[0].step <= 112


def test_records_in_warmup_and_unmeasured_signals_are_skipped():
    watcher = Watcher(warmup_steps=50, settings=WatchSettings(signals=("max_logit",)))
    for record in series(onset=20):
        if record["step"] <= 50:
            assert watcher.observe(record) == []  # the growth starts inside warmup: not judged there
    assert all(key[0] == "max_logit" for key in watcher.series)


def test_forget_after_replays_the_kept_records():
    records = series(onset=120)
    watcher = Watcher(WARMUP)
    warned = [w for r in records for w in watcher.observe(r)]
    assert warned
    watcher.forget_after(100)
    assert watcher.warned == {} and max(int(r["step"]) for r in watcher.records) == 100
    again = [w for r in records if r["step"] > 100 for w in watcher.observe(r)]
    assert [(w.signal, w.layer, w.step) for w in again] == [(w.signal, w.layer, w.step) for w in warned]
