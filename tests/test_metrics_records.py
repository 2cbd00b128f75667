"""metrics.jsonl has one owner (merit_core.metrics: its name, record type, writer and reader), and a
probe pass is reduced to metrics in one place (ProbeResult.layers / eval_metrics / overall_metrics)."""

import ast
import math
import subprocess
from pathlib import Path

import pytest
import torch

from merit_core import metric_names
from merit_core.metrics import METRICS_FILE, MetricsLog, MetricsRecord, eval_lines, log_lines, read_metrics
from merit_core.models.attention_probe import ActivationStats, OutputLogitStats, ProbeResult

ROOT = Path(__file__).resolve().parents[1]
OWNER = ROOT / "merit_core" / "metrics.py"


def _code_strings(tree: ast.Module) -> list[ast.Constant]:
    """The string constants of a module that are not docstrings (prose may name the file)."""
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_only_the_owner_spells_the_metrics_file_name_in_code():
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    paths = [ROOT / p for p in listed.stdout.split() if not p.startswith("tests/")]
    assert OWNER in paths and METRICS_FILE == "metrics.jsonl"
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [f"{path.relative_to(ROOT)}:{n.lineno}" for n in _code_strings(tree) if METRICS_FILE in n.value]
    assert found == [f"{OWNER.relative_to(ROOT)}:{_line_of(OWNER, 'METRICS_FILE = ')}"]


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))


def test_every_record_key_is_a_metric_name():
    names = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    assert set(MetricsRecord.__annotations__) <= names
    assert {metric_names.LR, metric_names.GRAD_NORM, metric_names.TOKENS_PER_S} <= set(MetricsRecord.__annotations__)
    assert MetricsRecord.__required_keys__ == {metric_names.STEP, metric_names.TOKENS}


def test_the_writer_and_the_reader_round_trip_and_pass_over_other_lines(tmp_path):
    log = MetricsLog(tmp_path)
    log.write({"step": 1, "tokens": 64, "loss": 3.5, "lr": 1e-3, "grad_norm": math.inf, "tokens_per_s": 10.0})
    log.write({"step": 2, "tokens": 128, "val_loss": math.nan, "max_attention_logit": [1.5, math.inf]})
    log.write({"step": 2, "tokens": 128, "warning": "a key of a line kind the readers do not know"})
    records = read_metrics(tmp_path)
    assert records[0] == {"step": 1, "tokens": 64, "loss": 3.5, "lr": 1e-3, "grad_norm": None, "tokens_per_s": 10.0}
    assert records[1] == {"step": 2, "tokens": 128, "val_loss": None, "max_attention_logit": [1.5, None]}
    assert log_lines(records) == records[:1] and eval_lines(records) == records[1:2]
    log.truncate_after(1)
    assert read_metrics(tmp_path / METRICS_FILE) == records[:1]


def _probe() -> ProbeResult:
    """Two layers of two heads, numbers chosen so that every reduction picks a different head."""
    entropy = {
        "mean": torch.tensor([[1.0, 2.0], [0.5, 1.5]]),
        "min": torch.tensor([[0.25, 0.75], [0.125, 1.0]]),
        "normalized_mean": torch.tensor([[0.5, 1.0], [0.25, 0.75]]),
        "normalized_min": torch.tensor([[0.375, 0.125], [0.5, 0.25]]),
    }
    return ProbeResult(
        max_logits=torch.tensor([[1.0, 3.0], [2.0, 0.5]]),
        scaling=[0.5, 0.5],
        input_max_l1=None,
        entropy=entropy,
        activations=[ActivationStats(8.0, 2.0, 0, 3, 1), ActivationStats(30.0, 3.0, 0, 5, 2)],
        output=OutputLogitStats(max_abs_logit=9.0, log_z_mean=4.5, log_z_std=0.5, log_z_max=5.0),
    )


def test_the_probe_reduction_over_heads_and_layers():
    probed = _probe()
    record = probed.precursors()
    assert list(record.max_logit) == [3.0, 2.0]  # max over heads
    assert list(record.max_logit_head) == [1, 0]  # the head holding it
    assert record.heads_max_logit[0] == [1.0, 3.0]
    assert record.of_layer(metric_names.ATTENTION_ENTROPY_MEAN, 0) == 1.5  # mean of the heads' means
    assert record.of_layer(metric_names.ATTENTION_ENTROPY_MIN, 1) == 0.125  # min of the heads' mins
    assert record.of_head(metric_names.NORMALIZED_ENTROPY_MIN, 1, 0) == 0.5
    assert record.heads_entropy[metric_names.NORMALIZED_ENTROPY_MIN][1] == [0.5, 0.25]
    assert record.of_layer("ratio", 1) == 10.0 and record.of_layer("position", 0) == 3
    assert record.log_z_mean == 4.5 and record.output is not None and record.output.log_z_max == 5.0
    assert probed.eval_metrics() == {
        metric_names.MAX_ATTENTION_LOGIT: [3.0, 2.0],
        metric_names.NORMALIZED_ENTROPY_MIN: [0.125, 0.25],
        metric_names.ACTIVATION_RATIO: [4.0, 10.0],
        metric_names.LOG_Z_MEAN: 4.5,
    }
    assert probed.overall_metrics() == {
        metric_names.MAX_ATTENTION_LOGIT: 3.0,
        metric_names.NORMALIZED_ENTROPY_MIN: 0.125,
        metric_names.ACTIVATION_RATIO: 10.0,
        metric_names.LOG_Z_MEAN: 4.5,
    }


def test_a_probe_without_the_instability_statistics_reduces_to_its_max_logits():
    plain = ProbeResult(max_logits=torch.tensor([[1.0, 3.0], [2.0, 0.5]]), scaling=[1.0, 1.0], input_max_l1=None)
    assert plain.eval_metrics() == {metric_names.MAX_ATTENTION_LOGIT: [3.0, 2.0]}
    assert plain.overall_metrics() == {metric_names.MAX_ATTENTION_LOGIT: 3.0}
    record = plain.precursors()
    assert record.of_layer(metric_names.ATTENTION_ENTROPY_MEAN, 0) is None and record.of_layer("ratio", 0) is None
    assert record.of_head(metric_names.NORMALIZED_ENTROPY_MIN, 0, 1) is None and record.log_z_mean is None


def test_the_integrations_report_the_shared_reduction(monkeypatch):
    from merit_core import integrations
    from merit_core.models import attention_probe

    monkeypatch.setattr(attention_probe, "probe_attention", lambda *a, **k: _probe())
    model = torch.nn.Linear(1, 1)
    metrics = integrations.logit_metrics(model, [[1, 2]])
    assert metrics == pytest.approx(
        {
            "max_attention_logit": 3.0,
            "max_attention_logit/layer_0": 3.0,
            "max_attention_logit/layer_1": 2.0,
            "normalized_attention_entropy_min": 0.125,
            "activation_ratio": 10.0,
            "log_z_mean": 4.5,
        }
    )
