"""`merit compare --seeds 2 --hessian --eval` end to end on a 2-layer, 32-dim GPT-2 and a local lm-eval task."""

from __future__ import annotations

import json
import statistics

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.compare.environment import FLOORS, Perturbation
from merit_core.compare.measures import EVAL_FILE, HESSIAN_FILE
from tests.eval.local_tasks import LAMBADA_LINES, lambada_yaml, set_offline

TRAIN = dict(eval_batches=2, eval_batch_size=4, log_every=1, keep_checkpoints=0)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    with open(root / "harbour_lambada.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in LAMBADA_LINES)
    (root / "harbour_lambada.yaml").write_text(lambada_yaml("harbour_lambada", root / "harbour_lambada.jsonl"))
    return root


@pytest.fixture(scope="module")
def measured(tmp_path_factory, model_cfg, data_dir, tasks_dir):
    """One optimizer, one batch, one lr, two seeds, with --hessian and --eval, through the CLI."""
    root = tmp_path_factory.mktemp("cmp")
    out = root / "cmp"
    args = [
        "compare",
        "--model",
        str(model_cfg),
        "--data",
        str(data_dir),
        "--seq-len",
        "32",
        "--optimizers",
        "merit",
        "--batch-sizes",
        "4",
        "--lrs",
        "1e-2",
        "--tokens",
        "384",
        "--jobs",
        "1",
        "--device",
        "cpu",
        "--seeds",
        "2",
        "--best-seeds",
        "2",
        "--hessian",
        "--eval",
        "harbour_lambada",
        "--include-path",
        str(tasks_dir),
        "--trust-task-code",
        "--out",
        str(out),
        *[a for k, v in TRAIN.items() for a in ("--set", f"{k}={v}")],
    ]
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and immune to a busy machine
    with pytest.MonkeyPatch.context() as mp:
        set_offline(mp, root)
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        summary = json.loads((out / "summary.json").read_text())
        yield out, summary, result.output, args, mp
    torch.set_num_threads(threads)


def test_seeds_are_separate_runs(measured):
    out, summary, _, _, _ = measured
    names = [r["name"] for r in summary["runs"]]
    environment = summary["settings"]["environment"]
    alt = environment["check_threads"]
    made = [Perturbation(p["kind"], p["value"]) for p in environment["perturbations"]]
    # the two seeds, and seed 0 once more under each perturbation the host can make (the environment
    # check): another thread count always, a lower torch ISA and MKL ISA where there is one
    assert made[0] == Perturbation("threads", str(alt)) and len(made) + len(environment["perturbations_skipped"]) == 3
    assert names[:2] == ["merit-b4-lr0.01", "merit-b4-lr0.01-s1"]
    assert sorted(names[2:]) == sorted(f"merit-b4-lr0.01{p.suffix}" for p in made)
    assert [r["seed"] for r in summary["runs"]] == [0, 1] + [0] * len(made)
    isa = next((p for p in made if p.kind == "isa"), None)
    if isa is not None:  # the forced ISA is the run's own, recorded per run
        (forced,) = [r for r in summary["runs"] if r["name"].endswith(isa.suffix)]
        assert forced["cpu_capability"] == isa.value.upper() != environment["cpu_capability"]
        assert summary["runs"][0]["cpu_capability"] == environment["cpu_capability"]
    (best,) = summary["best"]
    losses = [r["final_val_loss"] for r in summary["runs"][:2]]
    assert losses[0] != losses[1]  # another seed, another run
    assert best["final_val_loss"] == pytest.approx(statistics.fmean(losses))
    assert best["final_val_loss_values"] == losses and best["seeds"] == [0, 1]
    assert summary["settings"]["seeds"] == [0, 1] and summary["settings"]["steps"] == {"4": 3}
    env = best["environment"]
    assert [s["run"] for s in env["samples"]] == names[2:]
    assert env["run"] == names[2] and env["final_val_loss_original"] == losses[0]
    # the spread: the largest difference over the samples, never below the floor
    differences = [abs(r["final_val_loss"] - losses[0]) for r in summary["runs"][2:]]
    assert env["final_val_loss_spread"] == pytest.approx(max(differences + [FLOORS["final_val_loss"] * losses[0]]))
    assert {"torch", "blas", "threads", "isa_flags", "cpu_capability"} <= set(summary["settings"]["environment"])
    # the largest batch's Hessian gets an environment spread too
    assert (
        env["hessian"]["largest_algebraic_eigenvalue_original"]
        == best["hessian"]["largest_algebraic_eigenvalue_values"][0]
    )


def test_hessian_fields_match_inspects_estimators(measured, data_dir):
    import torch

    from merit_core.checkpoint.resolve import SafetensorsReader, find_checkpoints
    from merit_core.data import open_tokens
    from merit_core.diagnostics.checkpoint_model import load_model
    from merit_core.diagnostics.hessian import model_hessian
    from merit_core.train.batches import val_batches

    out, summary, output, _, _ = measured
    (best,) = summary["best"]
    h = best["hessian"]
    assert set(h) >= {
        "largest_algebraic_eigenvalue",
        "largest_algebraic_eigenvalue_std",
        "largest_algebraic_eigenvalue_values",
        "smallest_algebraic_eigenvalue_values",
        "largest_magnitude_eigenvalue_values",
        "trace",
        "trace_std",
    }
    assert h["batch"] == {"sequences": 4, "seq_len": 32, "step": 3}
    cached = [json.loads((out / "runs" / name / HESSIAN_FILE).read_text()) for name in best["run_names"]]
    assert h["largest_algebraic_eigenvalue_values"] == [c["largest_algebraic_eigenvalue"] for c in cached]
    assert h["trace_values"] == [c["trace"] for c in cached]
    assert h["largest_algebraic_eigenvalue"] == pytest.approx(
        statistics.fmean(h["largest_algebraic_eigenvalue_values"])
    )
    assert h["largest_algebraic_eigenvalue_values"][0] != h["largest_algebraic_eigenvalue_values"][1]
    assert h["smallest_algebraic_eigenvalue_values"] == [c["smallest_algebraic_eigenvalue"] for c in cached]
    assert all(c["smallest_algebraic_eigenvalue"] <= c["largest_algebraic_eigenvalue"] for c in cached)
    # the first seed's numbers are inspect's estimators on the final weights and the training's
    # first validation batch (built with the run's eval_batches, as the trainer builds it)
    from merit_core.checkpoint import read_run_config

    run_dir = out / "runs" / best["run_names"][0]
    config = read_run_config(run_dir)
    (ckpt,) = find_checkpoints(run_dir / "step_3")
    model = load_model(ckpt, SafetensorsReader(ckpt))
    batches = val_batches(open_tokens(data_dir, "val"), config["eval_batches"], config["eval_batch_size"], 32)
    ids = batches[0][0][:4]
    torch.manual_seed(0)
    est = model_hessian(model, ids, cached[0]["iters"], cached[0]["samples"], 0)
    assert h["largest_algebraic_eigenvalue_values"][0] == pytest.approx(est.largest_algebraic_eigenvalue, rel=1e-5)
    assert h["trace_values"][0] == pytest.approx(est.trace, rel=1e-5)
    report = (out / "REPORT.md").read_text()
    assert "## Sharpness (Hessian)" in report and "| merit | 4 | 0.01 |" in report and "| 12.3 | 3,445 |" in report
    assert "Hessian" in output and "trace" in output
    import matplotlib.image

    assert matplotlib.image.imread(out / "compare.png").shape[1] > 1800  # four panels with the Hessian


def test_eval_scores_each_best_run_on_a_local_task(measured, tasks_dir):
    out, summary, output, _, _ = measured
    (best,) = summary["best"]
    rows = {(r["task"], r["metric"]): r for r in best["zero_shot"]}
    acc = rows["harbour_lambada", "acc"]
    assert acc["higher_is_better"] is True
    per_run = [json.loads((out / "runs" / n / EVAL_FILE).read_text()) for n in best["run_names"]]
    expected = [p["results"]["harbour_lambada"]["acc,none"] for p in per_run]
    assert acc["values"] == expected and acc["value"] == pytest.approx(statistics.fmean(expected))
    assert per_run[0]["results"]["harbour_lambada"]["sample_len"] == len(LAMBADA_LINES)
    assert summary["settings"]["eval"] == {"tasks": ["harbour_lambada"], "include_path": str(tasks_dir), "limit": None}
    assert summary["settings"]["command"].startswith("merit compare --optimizers merit --batch-sizes 4 --lrs 1e-2")
    report = (out / "REPORT.md").read_text()
    assert "## Zero-shot evaluation" in report and "harbour_lambada acc ↑" in report
    assert "harbour_l" in output


def test_rerun_measures_nothing_again(measured, monkeypatch):
    out, summary, _, args, mp = measured

    def refuse(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr("merit_core.diagnostics.hessian.model_hessian", refuse)
    monkeypatch.setattr("merit_core.evaluation.evaluate_checkpoints", refuse)
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    again = json.loads((out / "summary.json").read_text())
    assert again["best"][0]["hessian"] == summary["best"][0]["hessian"]
    assert again["best"][0]["zero_shot"] == summary["best"][0]["zero_shot"]
    assert "0 run(s) trained" in result.output


def test_unknown_eval_task_fails_before_training(tmp_path, tasks_dir):
    out = tmp_path / "cmp"
    result = CliRunner().invoke(
        cli,
        [
            "compare",
            "--out",
            str(out),
            "--eval",
            "harbour_lambda",
            "--include-path",
            str(tasks_dir),
            "--trust-task-code",
        ],
    )
    assert result.exit_code == 2 and "harbour_lambda" in result.stderr and not out.exists()
