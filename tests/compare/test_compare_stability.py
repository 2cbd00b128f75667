"""The rules of round five: 'unstable' runs and cells, the lr caps built without them, the sampled
environment check, the batch-change claim, provenance, a removed run folder, a tampered marker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.compare import load_spec
from merit_core.compare.environment import FLOORS, Perturbation, floored_spread, perturbations
from merit_core.compare.grid import plan_runs
from merit_core.compare.markdown_report import render_report
from merit_core.compare.provenance import Provenance, git_state
from merit_core.compare.results import CellResult, CompareSettings, CompareSummary, Curve, RunResult
from merit_core.compare.runner import STATUS_FILE, read_status
from merit_core.compare.stability import LOGIT_LIMIT, LOSS_EXCESS, run_unstable
from merit_core.compare.summary import build_summary, cells, environment_check
from merit_core.compare.verdicts import BATCH_CLAIM, findings
from merit_core.errors import ConfigError
from merit_core.optim.lr_table import STABLE_LRS
from tests.compare.records import best_of, record, seeded, synthetic_summary, with_env
from tests.compare.test_compare import tiny_spec

ROOT = Path(__file__).resolve().parents[2]
COMPARE_CPU = ROOT / "results" / "compare-cpu" / "summary.json"


def _write_metrics(run_dir: Path, steps: int, loss: float, logit: float) -> None:
    """A run folder's metrics.jsonl as `merit train` writes it: a start eval, a log line, the final eval."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        {"step": 0, "val_loss": 8.3, "max_attention_logit": [0.3, 0.2]},
        {"step": steps, "loss": loss + 0.05, "tokens_per_s": 1000.0},
        {"step": steps, "val_loss": loss, "max_attention_logit": [logit / 2, logit]},
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_logit_jump_is_unstable_never_best_and_shown(tmp_path, model_cfg, data_dir):
    spec = tiny_spec(model_cfg, data_dir, tmp_path / "cmp", optimizers="merit", batch_sizes="8", lrs="1e-3,3e-3,1e-2")
    runs = plan_runs(spec)
    # lr 3e-3 has the lowest loss but a saturated logit; 1e-2 a loss 7% above the best (a collapse);
    # 1e-3 is the best stable lr
    values = {1e-3: (4.20, 5.0), 3e-3: (4.10, 500.0), 1e-2: (4.20 * 1.07, 10.0)}
    for run in runs:
        _write_metrics(run.run_dir, run.steps, *values[run.lr])
    settings = CompareSettings(model="tiny", optimizers=["merit"], batch_sizes=[8], seeds=[0])
    summary = build_summary(settings, runs, {run.name: "finished" for run in runs})
    assert type(summary.best[0].curve) is Curve and summary.best[0].curve.step == [0, runs[0].steps]
    assert CompareSummary.from_dict(summary.to_dict()) == summary  # what summary.json reads back to
    by_lr = {c.lr: c for c in summary.cells}
    assert by_lr[3e-3].status == "unstable" and f">= {LOGIT_LIMIT:g}" in by_lr[3e-3].message
    assert by_lr[3e-3].final_val_loss == pytest.approx(4.10) and by_lr[3e-3].max_attention_logit == 500.0  # kept
    assert by_lr[1e-2].status == "unstable" and "7.0% above the best lr's (0.001)" in by_lr[1e-2].message
    assert by_lr[1e-3].status == "finished"
    (best,) = summary.best
    assert best.lr == 1e-3 and best.status == "finished" and best.n_unstable == 2 and best.n_diverged == 0
    assert best.lr_at_edge == "low"  # the best stable lr is the grid's smallest: the grid extends downwards
    text = render_report(summary)
    assert "1e-2" not in text and "0.003: unstable (4.1000)" in text and "0.01: unstable (4.4940)" in text
    assert "Unstable lrs (finished with a finite loss" in text and "merit b8 lr 0.003 (seed 0: max attention" in text


def test_the_loss_rule_marks_only_lrs_above_the_best():
    records = seeded("adamw", 8, 1e-3, [4.0, 4.0]) + seeded("adamw", 8, 1e-4, [5.0, 5.0])
    records += seeded("adamw", 8, 1e-2, [4.0 * (1 + LOSS_EXCESS) + 0.01] * 2)
    records += seeded("adamw", 8, 3e-3, [4.0 * (1 + LOSS_EXCESS) - 0.01] * 2)
    status = {c.lr: c.status for c in cells(records)}
    # a too-small lr is slow, not unstable; within LOSS_EXCESS above the best is not a collapse
    assert status == {1e-3: "finished", 1e-4: "finished", 1e-2: "unstable", 3e-3: "finished"}
    assert run_unstable(LOGIT_LIMIT - 0.01) is None and run_unstable(LOGIT_LIMIT) is not None


def _committed_stable_lrs() -> dict[str, float]:
    """The largest lr per optimizer of results/compare-cpu that no seed of any batch trained unstably
    or diverged, by the rules of merit_core.compare.stability applied to its runs."""
    data = json.loads(COMPARE_CPU.read_text())
    records = []
    for run in data["runs"]:
        if run.get("threads") is not None or run.get("perturbation") is not None:
            continue  # the environment re-runs
        record = RunResult.from_dict(run)
        if record.status == "finished" and run_unstable(record.max_attention_logit):
            record.status = "unstable"
        records.append(record)
    table = cells(records)
    bad = {(c.optimizer, c.lr) for c in table if c.status != "finished"}
    stable: dict[str, float] = {}
    for c in table:
        if (c.optimizer, c.lr) not in bad:
            stable[c.optimizer] = max(stable.get(c.optimizer, 0.0), c.lr)
    return stable


def test_the_lr_caps_are_the_largest_lrs_neither_diverged_nor_unstable():
    stable = _committed_stable_lrs()
    assert set(stable) == {"adamw", "lamb", "merit"}
    for name, lr in stable.items():
        (cap,) = [s for s in STABLE_LRS[name] if s.model == "gpt2-tiny"]
        assert cap.lr == lr, name
    # the lrs the earlier caps allowed fail under these rules: MERIT 0.09, AdamW 0.00849
    assert stable["merit"] < 0.09 and stable["adamw"] < 8.49e-3


def test_the_environment_spread_is_the_largest_sample_and_never_below_the_floor():
    entry = CellResult.extend(
        record("a", 8, 1e-3, 4.05),
        seeds=[0, 1],
        final_val_loss_values=[4.0, 4.1],
        max_attention_logit_values=[10.0, 12.0],
    )

    def rerun(name, seed, perturbation, loss, logit, threads=None):
        r = record("a", 8, 1e-3, loss, logit=logit)
        r.name, r.seed, r.threads, r.perturbation = name, seed, threads, perturbation
        return r

    samples = [
        rerun("a-env2t", 0, "2 intra-op thread(s)", 4.01, 10.0, threads=2),
        rerun("a-envisa-avx2", 0, "torch kernels forced to AVX2", 3.95, 20.0),
        rerun("a-s1-envisa-avx2", 1, "torch kernels forced to AVX2", 4.1, 12.0),
    ]
    env = environment_check(entry, samples)
    assert env.final_val_loss_spread == pytest.approx(0.05)  # the ISA sample, not the thread count's 0.01
    assert (env.final_val_loss_original, env.final_val_loss_rerun) == (4.0, 3.95)
    assert env.max_attention_logit_spread == pytest.approx(10.0) and env.threads == 2
    assert [s.final_val_loss_difference for s in env.samples] == pytest.approx([0.01, 0.05, 0.0])
    assert [s.perturbation for s in env.samples][1] == "torch kernels forced to AVX2" and env.status == "finished"
    # differences below the floor: the floor, relative to the value
    assert floored_spread([0.0001], 4.0, "final_val_loss") == FLOORS["final_val_loss"] * 4.0
    assert floored_spread([], 4.0, "final_val_loss") is None


def test_perturbations_this_host_can_make():
    host = {"cpu_capability": "AVX512", "blas": "mkl", "isa_flags": ["avx2", "avx512f"]}
    made, skipped = perturbations(("threads", "isa", "blas"), 1, host)
    assert made == [Perturbation("threads", "2"), Perturbation("isa", "avx2"), Perturbation("blas", "AVX2")]
    assert [p.suffix for p in made] == ["-env2t", "-envisa-avx2", "-envblas-avx2"] and not skipped
    assert made[1].env() == {"ATEN_CPU_CAPABILITY": "avx2"} and made[2].env() == {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    made, skipped = perturbations(("threads", "isa", "blas"), 2, {"cpu_capability": "DEFAULT", "blas": "open"})
    assert made == [Perturbation("threads", "1")] and len(skipped) == 2


def _batch_summary(merit_large: list[float]) -> CompareSummary:
    """adamw and merit at batches 8 and 64, three seeds; adamw's loss rises by 0.30 from 8 to 64."""
    records = [
        *seeded("adamw", 8, 1e-3, [4.00, 4.01, 4.02]),
        *seeded("merit", 8, 1e-3, [3.90, 3.91, 3.92]),
        *seeded("adamw", 64, 1e-3, [4.30, 4.31, 4.32]),
        *seeded("merit", 64, 1e-3, merit_large),
    ]
    records += [r for o in ("adamw", "merit") for b in (8, 64) for r in seeded(o, b, 3e-3, [5.0, 5.1, 5.2])]
    summary = synthetic_summary()
    summary.settings.seeds = [0, 1, 2]
    summary.runs, summary.cells = records, cells(records)
    summary.best = with_env(best_of(records), loss_spread=0.005, logit_spread=0.5)
    return summary


def test_the_batch_change_claim_resolves_by_the_same_rule():
    # merit rises by 0.10 (seeds 0.10 each), adamw by 0.30: MERIT loses less, resolved
    line = next(line for line in findings(_batch_summary([4.00, 4.01, 4.02])) if BATCH_CLAIM in line)
    assert line.startswith(f"Paper claim {BATCH_CLAIM}: from batch 8 to 64") and "**holds here**" in line
    assert (
        "MERIT 0.1000 ± 0.0000 vs adamw 0.3000 ± 0.0000 (resolved by 3 seeds and beyond the environment spread 0.0200)"
        in line
    )
    # merit rises by 0.50: the claim does not hold (resolved the other way)
    line = next(line for line in findings(_batch_summary([4.40, 4.41, 4.42])) if BATCH_CLAIM in line)
    assert "**does not hold here**" in line and "MERIT 0.5000" in line
    # claims at every batch, the largest first
    claims = [line for line in findings(_batch_summary([4.0, 4.01, 4.02])) if line.startswith("Paper claim 1")]
    assert [re.search(r"at batch (\d+)", line).group(1) for line in claims] == ["64", "8"]


def test_provenance_names_the_commit_times_and_host():
    record = Provenance({"cpu": "Some CPU", "cpu_capability": "AVX2", "isa_flags": ["avx2"]}).record()
    assert set(record) == {
        "git_sha",
        "git_dirty",
        "merit_version",
        "started",
        "finished_at",
        "wall_time_s",
        "host_cpu",
        "host_isa",
        "host_isa_flags",
    }
    sha, dirty = git_state()
    if (ROOT / ".git").exists():  # a checkout: the commit it is at
        assert re.fullmatch(r"[0-9a-f]{40}", sha) and isinstance(dirty, bool)
    assert git_state(Path("/")) == (None, None)  # not a checkout
    assert record["host_isa"] == "AVX2" and record["started"] <= record["finished_at"]


# A run folder removed (or spoiled) mid-grid: tests/compare/test_compare_families.py, through the CLI.


TAMPERED = [
    b"[]",
    b"not json",
    b'{"state": 5}',
    b'{"state": "finished"}',
    b'{"state": "diverged", "message": 7}',
    b'{"state": "diverged", "config": "x"}',
    b"\xff\xfe",
    b"[" * 100_000,
]


@pytest.mark.parametrize("content", TAMPERED)
def test_a_tampered_run_marker_is_one_line(tmp_path, content):
    (tmp_path / STATUS_FILE).write_bytes(content)
    with pytest.raises(ConfigError) as error:
        read_status(tmp_path)
    assert "\n" not in str(error.value) and "remove it to train that run again" in str(error.value)
    assert read_status(tmp_path / "absent") == {}


def test_compare_with_a_tampered_marker_exits_2_in_one_line(tmp_path, model_cfg, data_dir):
    spec = tiny_spec(model_cfg, data_dir, tmp_path / "cmp", optimizers="adamw", batch_sizes="4", lrs="1e-3")
    (run,) = plan_runs(spec)
    run.run_dir.mkdir(parents=True)
    (run.run_dir / STATUS_FILE).write_text('{"state": "diverged", "config": [1]}')
    args = ["compare", "--optimizers", "adamw", "--batch-sizes", "4", "--lrs", "1e-3", "--tokens", "512"]
    args += ["--model", str(model_cfg), "--data", str(data_dir), "--seq-len", "32", "--out", str(spec.out)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in result.output and STATUS_FILE in result.output


def test_environment_check_setting(tmp_path):
    spec = load_spec(None, out=str(tmp_path / "x"))
    assert spec.environment_perturbations == ("threads", "isa", "blas") and spec.environment_samples == 1
    toml = tmp_path / "c.toml"
    toml.write_text('environment_check = ["isa", "threads"]\nenvironment_samples = 2\n')
    spec = load_spec(toml, out=str(tmp_path / "x"))
    assert spec.environment_perturbations == ("isa", "threads") and spec.environment_samples == 2
    toml.write_text('environment_check = ["gpu"]\n')
    with pytest.raises(ConfigError, match="'gpu' is not a perturbation"):
        load_spec(toml, out=str(tmp_path / "x"))
    toml.write_text("environment_samples = 4\n")
    with pytest.raises(ConfigError, match="exceeds best_seeds 3"):
        load_spec(toml, out=str(tmp_path / "x"))


def test_the_gpu_logit_spec_plans_the_claims_test():
    from merit_core.config_catalog import find_config

    spec = load_spec(find_config("compare-gpt2-small-logit", "compare"))
    runs = plan_runs(spec)
    assert {r.optimizer for r in runs} == {"adamw", "merit"} and {r.batch_size for r in runs} == {128, 512}
    assert min(r.steps for r in runs if r.batch_size == 512) >= 1000 and len(runs) == 12
    assert all(r.config.model == "gpt2-small" and r.config.seq_len == 1024 for r in runs)
    for optimizer, batch in {(r.optimizer, r.batch_size) for r in runs}:
        grid = sorted(r.lr for r in runs if (r.optimizer, r.batch_size) == (optimizer, batch))
        assert grid[2] / grid[1] == pytest.approx(3, rel=0.01)  # the best lr (the centre) and 3x it
