"""The verdict rules (merit_core.diagnostics.verdict) on synthetic precursors: each signal at each
level with its reason, the level rules alone for a checkpoint without history, a run's worst level
per signal, and the defaults equal to what results/watch-cpu/verdict_calibration.py picks on the
committed grid."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from merit_core import instability_rules as rules
from merit_core.diagnostics import verdict as v
from merit_core.instability_rules import ALARMING, HEALTHY, LOGIT_LIMIT, WATCH, Thresholds
from merit_core.precursors import Precursors

T = Thresholds()
ROOT = Path(__file__).resolve().parents[2]


def level_of(p: Precursors, signal: str, first: Precursors | None = None, t: Thresholds = T) -> rules.SignalVerdict:
    found = v.checkpoint_verdict(p, first, first, t).signal(signal)
    assert found is not None, signal
    return found


# -- level rules --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("logit", "level", "words"),
    [
        (12.0, HEALTHY, "below 44 (0.5 of the saturation 88)"),
        (50.0, WATCH, "past 44, on the way to float32 saturation at 88"),
        (LOGIT_LIMIT, ALARMING, "at least 88: exp(-88) underflows float32"),
        (math.inf, ALARMING, "not finite"),
        (math.nan, ALARMING, "not finite"),
    ],
)
def test_max_logit_levels_and_reasons(logit, level, words):
    s = level_of(Precursors(step=5, max_logit=[1.0, logit], max_logit_head=[0, 3]), rules.MAX_LOGIT)
    assert s.level == level and s.layer == 1 and s.rule == rules.LEVEL_RULE and s.step == 5
    assert words in s.reason
    assert "(layer 1, head 3)" in s.reason


def test_max_logit_watch_is_a_fraction_of_the_saturation_limit():
    p = Precursors(max_logit=[30.0])
    assert level_of(p, rules.MAX_LOGIT).level == HEALTHY
    assert level_of(p, rules.MAX_LOGIT, t=Thresholds(logit_watch=0.25)).level == WATCH  # 30 >= 22


@pytest.mark.parametrize(
    ("entropy", "level", "words"),
    [
        (0.8, HEALTHY, "0.8 (layer 0) is above 0.05"),
        (0.01, WATCH, "below 0.05: a head attends to about one key (not alarming by itself"),
        (math.nan, ALARMING, "not finite"),
    ],
)
def test_entropy_levels_and_reasons(entropy, level, words):
    s = level_of(Precursors(entropy_min=[entropy, 0.9]), rules.ENTROPY)
    assert s.level == level and words in s.reason


def test_entropy_is_never_alarming_when_finite():
    assert level_of(Precursors(entropy_min=[0.0]), rules.ENTROPY).level == WATCH


@pytest.mark.parametrize(
    ("ratio", "level", "words"),
    [
        (0.01, HEALTHY, "at most 0.01 of its RMS (lm_head.weight), below 0.15"),
        (0.2, WATCH, "0.2 of its RMS (lm_head.weight), at least 0.15"),
        (0.5, ALARMING, "0.5 of its RMS (lm_head.weight), at least 0.3"),
    ],
)
def test_update_ratio_levels_and_reasons(ratio, level, words):
    s = level_of(Precursors(update_ratio=ratio, update_weight="lm_head.weight"), rules.UPDATE)
    assert s.level == level and words in s.reason and s.layer is None


@pytest.mark.parametrize(
    ("bound", "level", "words"),
    [
        (50.0, HEALTHY, "the spectral bound 50 (layer 1) is below 88: no input as large as the probe's"),
        (200.0, WATCH, "the spectral bound 200 (layer 1) is at least 88: these weights allow a saturated"),
    ],
)
def test_logit_bound_levels_and_reasons(bound, level, words):
    p = Precursors(logit_bound=[1.0, bound], bound_kind=["max-norm", "spectral"])
    s = level_of(p, rules.BOUND)
    assert s.level == level and words in s.reason


def test_logit_bound_is_never_alarming():
    assert level_of(Precursors(logit_bound=[1e9]), rules.BOUND).level == WATCH


# -- history rules ------------------------------------------------------------------------------
def _logit_at(step: int, rate: float, start: float = 1.0) -> float:
    """A max logit that grew `rate` e-folds of (1 + logit) per step from `start` at step 0."""
    return math.expm1(math.log1p(start) + rate * step)


@pytest.mark.parametrize(("rate", "level"), [(0.1, HEALTHY), (0.9, WATCH), (5.0, WATCH)])
def test_logit_growth_levels(rate, level):
    first = Precursors(step=0, max_logit=[1.0, 1.0])
    p = Precursors(step=4, max_logit=[1.5, _logit_at(4, rate)])
    s = level_of(p, rules.LOGIT_GROWTH, first)
    assert s.level == level and s.layer == 1 and s.rule == rules.HISTORY_RULE
    assert s.value == pytest.approx(rate)
    assert f"{s.value:.3g} e-folds per step (layer 1: 1 at step 0 -> " in s.reason
    if level == WATCH:  # no alarming level: healthy runs of the grid grew as fast
        assert "at least 0.75 (not alarming by itself" in s.reason
    else:
        assert "below 0.75" in s.reason


def test_logit_growth_alarms_where_a_threshold_is_given():
    first, p = Precursors(step=0, max_logit=[1.0]), Precursors(step=2, max_logit=[_logit_at(2, 2.0)])
    s = level_of(p, rules.LOGIT_GROWTH, first, Thresholds(growth_alarming=1.5))
    assert s.level == ALARMING and "at least 1.5" in s.reason


def test_a_logit_grown_past_finite_is_alarming_without_an_alarming_threshold():
    """An infinite max logit grows infinitely fast: alarming, and its reason names the watch
    threshold (the only one given) instead of failing for want of an alarming one."""
    first, p = Precursors(step=0, max_logit=[1.0]), Precursors(step=2, max_logit=[math.inf])
    s = level_of(p, rules.LOGIT_GROWTH, first)
    assert s.level == ALARMING and s.value == math.inf and s.reason.endswith("at least 0.75")


def test_logit_growth_is_against_the_previous_checkpoint():
    points = [Precursors(step=s, max_logit=[x]) for s, x in ((0, 1.0), (10, _logit_at(10, 0.1)), (11, 1e4))]
    verdicts = v.trajectory_verdicts(points)
    growth = verdicts[2].signal(rules.LOGIT_GROWTH)
    assert growth is not None and growth.level == WATCH  # one step from the previous, not 11 from the first
    assert growth.value == pytest.approx(math.log1p(1e4) - math.log1p(_logit_at(10, 0.1)))


@pytest.mark.parametrize(
    ("log_z", "level", "words"),
    [
        (6.0, HEALTHY, "moved 0.1 nats since the run's first checkpoint (5.9 at step 0 -> 6), less than 0.5"),
        (6.9, WATCH, "moved 1 nats since the run's first checkpoint (5.9 at step 0 -> 6.9), at least 0.5"),
        (2.9, ALARMING, "moved 3 nats since the run's first checkpoint (5.9 at step 0 -> 2.9), at least 2"),
    ],
)
def test_log_z_drift_levels_both_ways(log_z, level, words):
    s = level_of(Precursors(step=8, log_z_mean=log_z), rules.LOG_Z, Precursors(step=0, log_z_mean=5.9))
    assert s.level == level and words in s.reason and s.layer is None


@pytest.mark.parametrize(
    ("ratio", "level", "words"),
    [
        (12.0, HEALTHY, "2x its value at the run's first checkpoint (layer 0: 6 at step 0 -> 12), below 20x"),
        (150.0, WATCH, "25x its value at the run's first checkpoint (layer 0: 6 at step 0 -> 150), at least 20x"),
    ],
)
def test_activation_growth_levels_and_reasons(ratio, level, words):
    first = Precursors(step=0, activation_ratio=[6.0, 5.0])
    s = level_of(Precursors(step=8, activation_ratio=[ratio, 5.0]), rules.ACTIVATION, first)
    assert s.level == level and words in s.reason
    assert (level == WATCH) == ("not alarming by itself" in s.reason)


# -- verdicts -----------------------------------------------------------------------------------
FULL = dict(
    max_logit=[10.0, 20.0],
    entropy_min=[0.5, 0.4],
    activation_ratio=[5.0, 6.0],
    log_z_mean=6.0,
    update_ratio=0.01,
    logit_bound=[30.0, 40.0],
)


def test_a_checkpoint_without_history_gets_the_level_rules_only_and_says_so():
    verdict = v.checkpoint_verdict(Precursors(step=3, **FULL))
    assert [s.signal for s in verdict.signals] == [rules.MAX_LOGIT, rules.ENTROPY, rules.UPDATE, rules.BOUND]
    assert {s.rule for s in verdict.signals} == {rules.LEVEL_RULE}
    assert not verdict.history and verdict.notes == [v.NO_HISTORY_NOTE]
    assert verdict.level == HEALTHY
    d = verdict.to_dict()
    assert d["level"] == HEALTHY and d["history"] is False and "steps" not in d
    assert d["signals"][0] == {
        "signal": rules.MAX_LOGIT,
        "level": HEALTHY,
        "value": 20.0,
        "layer": 1,
        "step": 3,
        "rule": rules.LEVEL_RULE,
        "reason": "max attention logit 20 (layer 1) is below 44 (0.5 of the saturation 88)",
    }


def test_the_level_is_the_worst_signal_and_nothing_measured_is_no_level():
    verdict = v.checkpoint_verdict(Precursors(**{**FULL, "update_ratio": 0.2, "entropy_min": [0.01, 0.4]}))
    assert verdict.level == WATCH
    verdict = v.checkpoint_verdict(Precursors(**{**FULL, "max_logit": [100.0, 1.0]}))
    assert verdict.level == ALARMING
    empty = v.checkpoint_verdict(Precursors(step=1))
    assert empty.signals == [] and empty.level is None and empty.to_dict()["level"] is None
    assert empty.notes == [v.NO_HISTORY_NOTE, v.NOTHING_NOTE]


def test_a_run_judges_later_checkpoints_against_its_first_and_takes_the_worst_per_signal():
    points = [
        Precursors(step=100, **FULL),
        Precursors(step=200, **{**FULL, "log_z_mean": 9.0, "update_ratio": 0.2}),  # drift 3: alarming
        Precursors(step=300, **{**FULL, "log_z_mean": 6.2, "update_ratio": 0.02}),  # back to healthy
    ]
    verdicts = v.trajectory_verdicts(points)
    assert verdicts[0].notes == [v.FIRST_NOTE] and not verdicts[0].history
    assert rules.LOG_Z not in [s.signal for s in verdicts[0].signals]
    assert verdicts[1].history and verdicts[1].signal(rules.LOG_Z).level == ALARMING
    assert verdicts[2].signal(rules.LOG_Z).level == HEALTHY
    run = v.run_verdict(verdicts, [p.step for p in points])
    assert run.history and run.notes == [] and run.steps == [100, 200, 300]
    assert run.level == ALARMING
    log_z, update = run.signal(rules.LOG_Z), run.signal(rules.UPDATE)
    assert log_z.level == ALARMING and log_z.step == 200  # the first step at the worst level
    assert update.level == WATCH and update.step == 200
    assert run.signal(rules.MAX_LOGIT).level == HEALTHY and run.signal(rules.MAX_LOGIT).step == 300  # healthy: latest
    assert [s.signal for s in run.signals] == list(rules.VERDICT_SIGNALS)


def test_a_run_of_one_checkpoint_has_no_history():
    verdicts = v.trajectory_verdicts([Precursors(step=5, **FULL)])
    run = v.run_verdict(verdicts, [5])
    assert run.notes == [v.NO_HISTORY_NOTE] and not run.history and verdicts[0].notes == [v.NO_HISTORY_NOTE]


# -- the calibration --------------------------------------------------------------------------
def test_the_defaults_are_what_the_grid_calibration_picks():
    path = ROOT / "results" / "watch-cpu" / "verdict_calibration.py"
    spec = importlib.util.spec_from_file_location("verdict_calibration", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # it imports analyze.py beside it
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    results = module.runs()
    assert len(results) == 42 and sum(r["diverged_at"] is not None for r in results) == 15
    for r in results:
        r["extreme"] = module.extremes(module.judged(r["records"]))
    _, picked = module.sweep(results)
    assert module.picked_thresholds(picked) == Thresholds()
    assert set(picked) - set(module.FIXED) == {rules.LOGIT_GROWTH, rules.LOG_Z, rules.ACTIVATION, rules.UPDATE}
