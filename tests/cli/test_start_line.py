"""merit train's start line: the lr's source in a few words, however far the lr was extrapolated."""

from __future__ import annotations


def test_the_start_lines_lr_source_stays_short_when_extrapolated():
    from merit_cli.train_cmd import lr_source
    from merit_core.optim.registry import default_lr

    far = default_lr("merit", "gpt2-tiny", 1024, 128, 128)  # 64x the measured tokens per step: capped
    assert far.extrapolated and len(far.source) > 250
    short = lr_source(far)
    assert short == (
        "extrapolated from the lr measured for gpt2-tiny at batch 16 x 128, 0.0283, capped at 0.0283, the largest lr "
        "trained stably on gpt2-tiny; run: results/compare-cpu"
    )
    near = default_lr("merit", "gpt2-tiny", 16, 128, 128)
    assert lr_source(near) == near.source  # a measured default keeps its words
