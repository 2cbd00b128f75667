"""The scoring of early warnings over recorded runs (merit_core.train.watch_scoring) and the field's
spike rules it compares the watcher with (merit_core.instability_rules.BASELINE_RULES), each against a
direct computation on series built by hand."""

import math
import statistics

from merit_core.instability_rules import WatchSettings, spike_step, zclip_step
from merit_core.train.watch_scoring import DIVERGED, HEALTHY, SPIKED, RunSeries, Scored, counts, in_time, lead_table


def _series(losses, grads=None, watch=()):
    grads = grads or [1.0] * len(losses)
    metrics = [{"step": i + 1, "loss": x, "grad_norm": g} for i, (x, g) in enumerate(zip(losses, grads))]
    return RunSeries.of([*metrics, *watch])


def test_labels_follow_the_divergence_rule_and_tell_a_recovered_spike_apart():
    falling = [5.0 - 0.01 * i for i in range(60)]
    assert _series(falling).label() == (HEALTHY, None)
    spiked = list(falling)
    spiked[30] = falling[29] + 1.5  # one step 1.5 nats up, then back
    assert _series(spiked).label() == (SPIKED, 31)
    diverged = falling[:40] + [falling[39] + 2.0] * 20
    assert _series(diverged).label() == (DIVERGED, 41)
    assert _series(falling[:10] + [math.nan]).label() == (DIVERGED, 11)


def test_the_spike_rule_is_mean_plus_six_sd_of_the_previous_values():
    rng = [1.0 + 0.01 * ((7 * i) % 5) for i in range(40)]
    values = [(i + 1, x) for i, x in enumerate(rng)]
    assert spike_step(values) is None
    window = rng[:30]
    limit = statistics.fmean(window) + 6 * statistics.pstdev(window)
    values[30] = (31, limit + 1e-6)
    assert spike_step(values) == 31
    values[30] = (31, limit - 1e-6)
    assert spike_step(values) is None
    assert spike_step([(i, 1.0) for i in range(1, 10)] + [(10, math.inf)]) is None  # fewer than 16 values seen
    assert spike_step([(i, 1.0 + 0.01 * (i % 3)) for i in range(1, 20)] + [(20, math.inf)]) == 20


def test_zclip_fires_on_a_z_score_above_2_5_against_its_ema():
    grads = [(i + 1, 1.0 + 0.1 * (i % 2)) for i in range(30)]
    assert zclip_step(grads) is None
    mean, var = 1.05, 0.0025  # the first 10 alternate 1.0 and 1.1
    for _, x in grads[10:]:
        x = min(x, mean + 2.5 * math.sqrt(var))
        mean = 0.97 * mean + 0.03 * x
        var = 0.97 * var + 0.03 * (x - mean) ** 2
    grads.append((31, mean + 2.6 * math.sqrt(var)))
    assert zclip_step(grads) == 31
    grads[-1] = (31, mean + 2.4 * math.sqrt(var))
    assert zclip_step(grads) is None


def test_in_time_is_twenty_steps_or_a_tenth_of_the_steps_before():
    assert in_time(200, 180) and not in_time(200, 181)
    assert in_time(50, 45) and not in_time(50, 46)  # a tenth of 50 is 5 steps
    assert not in_time(200, None)


def test_counts_and_table_over_scored_runs():
    runs = [
        Scored("a", DIVERGED, 200, None, {"r": [150, 190]}),  # in time, lead 50
        Scored("b", DIVERGED, 200, None, {"r": [195]}),  # warned, not in time, lead 5
        Scored("c", DIVERGED, 200, None, {"r": [210]}),  # after the divergence: a miss
        Scored("p", DIVERGED, 200, 99, {"r": [30, 170]}),  # planted at 100: a false alarm, then in time (lead 30)
        Scored("d", HEALTHY, None, 260, {"r": [40]}),  # a false alarm
        Scored("e", HEALTHY, None, 260, {"r": []}),
        Scored("f", SPIKED, 90, None, {"r": [80]}),
        Scored("g", "planted, not diverged", None, 129, {"r": [140]}),  # after its fault: not a false alarm
    ]
    c = counts(runs, "r")
    assert (c["diverged"], c["recall"], c["in_time"], sorted(c["leads"])) == (4, 3, 2, [5, 30, 50])
    assert (c["safe"], c["false_alarms"], c["healthy"], c["healthy_warned"]) == (4, 2, 2, 1)
    assert (c["spiked"], c["warned_spikes"]) == (1, 1)
    table = lead_table(runs, tokens_per_step=100)
    assert (
        table[0]
        == "8 runs: 4 diverged, 1 spiked and recovered, 2 healthy, 1 neither (their safe steps count; see the labels)."
    )
    assert table[-1] == "| r | 3/4 | 2/4 | 30 | 3000 | 5 / 50 | 2/4 | 1/2 | 1/1 |"


def test_the_detector_replay_at_a_coarser_cadence_sees_only_those_records():
    grad = [1.0 + 0.01 * (s % 3) if s < 150 else 1.1 ** (s - 148) for s in range(2, 201, 2)]
    watch = [{"step": s, "watch_loss": 1.0, "watch_grad_norm": g} for s, g in zip(range(2, 201, 2), grad)]
    run = _series([1.0] * 200, watch=watch)
    every2 = run.detector(WatchSettings(signals=("grad_norm",)))
    assert every2[0] is not None and every2[1] == "grad_norm"
    every10 = run.detector(WatchSettings(signals=("grad_norm",)), every=10)
    assert every10[0] is not None and every10[0] % 10 == 0 and every10[0] >= every2[0]
    assert run.detector(WatchSettings(signals=("grad_norm",)), warmup=200) == (None, None)
