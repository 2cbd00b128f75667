"""compare carries the instability precursors of each run's final eval record into the summary and
REPORT.md (one table row per best run)."""

from merit_core.compare.markdown_report import render_report
from merit_core.compare.precursor_table import instability_lines, instability_record
from tests.compare.records import synthetic_summary


def test_final_eval_record_to_summary_fields():
    final = {
        "step": 40,
        "val_loss": 4.0,
        "max_attention_logit": [2.0, 7.5],
        "normalized_attention_entropy_min": [0.8, 0.3],
        "activation_ratio": [12.0, 40.0],
        "log_z_mean": 6.25,
        "update_rms_ratio": 0.002,
    }
    assert instability_record(final) == {
        "max_attention_logit": 7.5,
        "normalized_attention_entropy_min": 0.3,
        "activation_ratio": 40.0,
        "log_z_mean": 6.25,
        "update_rms_ratio": 0.002,
    }
    assert instability_record({"step": 40, "val_loss": 4.0, "max_attention_logit": [1.0]}) is None  # older runs
    assert instability_record(None) is None


def test_report_section_one_row_per_best_run():
    summary = synthetic_summary()
    assert "Instability precursors" not in render_report(summary)  # runs that recorded none: no section
    first = summary.best[0]
    first.instability = instability_record(
        {
            "max_attention_logit": [3.0],
            "normalized_attention_entropy_min": [0.25],
            "activation_ratio": [50.0],
            "log_z_mean": 5.5,
        }
    )
    lines = instability_lines(summary)
    assert lines[-1] == f"| {first.optimizer} | {first.batch_size} | 3 | 0.25 | 50 | 5.5 | - |"
    assert "## Instability precursors" in render_report(summary)
