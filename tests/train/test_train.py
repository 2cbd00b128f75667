"""End-to-end `merit train` on a 2-layer, 32-dim GPT-2: run folder, checkpoints, resume, logits."""

import math
import shlex

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core.checkpoint import runs
from merit_core.checkpoint.state import read_trainer_state
from merit_core.checkpoint.tensors import load_trainer_state
from merit_core.metrics import read_metrics
from tests.cli_runs import TINY_TRAIN, invoke, train_args


@pytest.fixture(scope="module")
def finished_run(model_cfg, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "4"))
    assert result.exit_code == 0, result.output + result.stderr
    return out, result


def test_run_folder_layout_and_metrics(finished_run):
    out, result = finished_run
    assert sorted(p.name for p in out.iterdir()) == [
        ".merit-run",
        "config.toml",
        "curves.png",
        "metrics.jsonl",
        "step_2",
        "step_4",
    ]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for step, path in runs.checkpoints(out):
        names = {p.name for p in path.iterdir()}
        assert {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "trainer_state.json",
            "trainer_state.pt",
        } <= names
        info = read_trainer_state(path).to_dict()
        assert info["step"] == step and info["tokens"] == step * 8 * 32
        assert (info["global_batch_size"], info["seq_len"], info["optimizer"]) == (8, 32, "merit")
        assert info["lr"] > 0 and info["model"].endswith("config.json")
        state = load_trainer_state(path)  # weights_only=True
        assert state["step"] == step and state["optimizer"]["state"]
    records = read_metrics(out)
    logs = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 4] and [r["step"] for r in evals] == [0, 2, 4]
    for r in logs:
        assert {"step", "tokens", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) and math.isfinite(r["loss"])
    assert all(len(r["max_attention_logit"]) == 2 for r in evals)
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]  # it learns
    text = result.output
    assert "Run summary" in text and f"merit inspect {out}" in text and f"merit eval {out / 'step_4'}" in text
    assert any(line.split() == ["compile", "eager"] for line in text.splitlines())  # how it ran (CPU: eager)


def test_checkpoint_loads_in_transformers_with_the_same_logits(finished_run, data_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from merit_core.data import open_tokens
    from merit_core.train.batches import val_batches

    out, _ = finished_run
    model = AutoModelForCausalLM.from_pretrained(out / "step_4").eval()
    tok = AutoTokenizer.from_pretrained(out / "step_4")
    assert tok.decode(tok("the cat sees the moon")["input_ids"]) == "the cat sees the moon"
    # the val loss the trainer logged at step 4 comes back from the reloaded model's logits
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in val_batches(open_tokens(data_dir, "val"), 2, 4, 32):
            logits = model(input_ids=x).logits
            total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
            count += y.numel()
    logged = [r for r in read_metrics(out) if r["step"] == 4 and "val_loss" in r][0]
    assert total / count == pytest.approx(logged["val_loss"], rel=1e-6)


def _direct_max_logits(model, input_ids):
    """Max over heads and causal pairs of q.k/sqrt(d) per layer, from GPT-2's own weights (no probe)."""
    out = model(input_ids=input_ids, output_hidden_states=True)
    result = []
    t = input_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for layer, hidden in zip(model.transformer.h, out.hidden_states):
        q, k, _ = layer.attn.c_attn(layer.ln_1(hidden)).split(model.config.n_embd, dim=2)
        heads = model.config.n_head
        q = q.view(*q.shape[:2], heads, -1).transpose(1, 2)
        k = k.view(*k.shape[:2], heads, -1).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        result.append(logits.masked_fill(~causal, float("-inf")).amax().item())
    return result


def test_logged_max_attention_logit_matches_direct_computation(finished_run, data_dir):
    from transformers import AutoModelForCausalLM

    from merit_core.data import open_tokens
    from merit_core.models.attention_probe import max_attention_logits
    from merit_core.train.batches import val_batches

    out, _ = finished_run
    model = AutoModelForCausalLM.from_pretrained(out / "step_4", attn_implementation="eager").eval()
    batch = val_batches(open_tokens(data_dir, "val"), 2, 4, 32)[0][0]
    logged = [r for r in read_metrics(out) if r["step"] == 4 and "val_loss" in r][0]["max_attention_logit"]
    with torch.no_grad():
        direct = _direct_max_logits(model, batch)
        probe = max_attention_logits(model, batch).amax(dim=1).tolist()
    assert logged == pytest.approx(direct, rel=1e-5) and logged == pytest.approx(probe, rel=1e-6)


class Crash(Exception):
    pass


def test_resume_reproduces_the_uninterrupted_losses_exactly(model_cfg, data_dir, tmp_path, finished_run):
    from merit_core.train.callbacks import TrainCallbacks
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    reference, _ = finished_run

    class CrashAtStep3(TrainCallbacks):
        def on_log(self, record):
            if record["step"] == 3:  # after step_2 was saved and step 3's line was written
                raise Crash

    config = load_config(
        values={**TINY_TRAIN, "model": str(model_cfg), "data": str(data_dir), "steps": 4, "out": str(tmp_path / "run")}
    )
    with pytest.raises(Crash):
        run_training(config, CrashAtStep3())
    assert [s for s, _ in runs.checkpoints(tmp_path / "run")] == [2]
    assert max(r["step"] for r in read_metrics(tmp_path / "run")) == 3

    result = invoke(["train", "--resume", "--out", str(tmp_path / "run")])  # config comes from the run folder
    assert result.exit_code == 0, result.output + result.stderr
    assert "Resuming from" in result.output
    resumed, uninterrupted = read_metrics(tmp_path / "run"), read_metrics(reference)
    strip = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in resumed]
    assert strip == [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in uninterrupted]  # bit-exact
    a = load_trainer_state(tmp_path / "run" / "step_4")["optimizer"]["state"]
    b = load_trainer_state(reference / "step_4")["optimizer"]["state"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i] if torch.is_tensor(a[i][k]))


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(model_cfg, data_dir, tmp_path, monkeypatch):
    from merit_core.train.trainer import Trainer

    original = Trainer._loss

    def poisoned(self, module, x, y, scale):
        loss = original(self, module, x, y, scale)
        return loss * float("nan") if module.training and self.step >= 2 else loss

    monkeypatch.setattr(Trainer, "_loss", poisoned)
    out = tmp_path / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "6"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "non-finite at step 3" in lines[0] and str(out / "step_2") in lines[0]
    assert [s for s, _ in runs.checkpoints(out)] == [2]
    assert read_metrics(out)[-1]["step"] == 3 and read_metrics(out)[-1]["loss"] is None


def test_resuming_a_finished_run_trains_nothing_and_reports_it(finished_run):
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    out, _ = finished_run
    before = {p.name: p.stat().st_mtime_ns for p in (out / "step_4").iterdir()}
    summary = run_training(load_config(out / "config.toml", values={"resume": True}))
    assert summary.steps == 4 and summary.tokens_per_s is None and summary.last_checkpoint == out / "step_4"
    last_eval = [r for r in read_metrics(out) if "val_loss" in r][-1]
    assert (
        summary.final_val_loss == last_eval["val_loss"]
        and summary.max_attention_logit == last_eval["max_attention_logit"]
    )
    assert {p.name: p.stat().st_mtime_ns for p in (out / "step_4").iterdir()} == before


def _hint(output: str, command: str) -> list[str]:
    line = next(line for line in output.splitlines() if line.strip().startswith(f"merit {command} "))
    return shlex.split(line.strip().split("  # ")[0])[1:]  # the command, without its note


def test_next_eval_hint_is_a_command_that_runs(finished_run, monkeypatch):
    """The hint names tasks (it had none, and `merit eval` refused it); run as printed it reaches the
    evaluation with the last checkpoint, and its tasks are in lm-eval's index."""
    from merit_cli import eval_cmd
    from merit_core.evaluation.results import CheckpointResult
    from merit_core.evaluation.tasks import resolve_tasks

    out, result = finished_run
    output = result.output
    args = _hint(output, "eval")
    assert args[:2] == ["eval", str(out / "step_4")] and "--tasks" in args
    calls = []

    def evaluate(checkpoints, settings, progress=None, quiet=True, note=None):
        calls.append((checkpoints, settings))
        return [CheckpointResult(path=checkpoints[0], label="step_4", results={}, meta={})]

    monkeypatch.setattr(eval_cmd, "evaluate_checkpoints", evaluate)
    ran = CliRunner().invoke(cli, args)
    assert ran.exit_code == 0, ran.output
    ((checkpoints, settings),) = calls
    assert checkpoints == [str(out / "step_4")]
    resolved = resolve_tasks(settings.tasks)  # offline: lm-eval's YAMLs, no data
    assert set(resolved.names) <= set(resolved.manager.all_tasks)


def test_next_inspect_hint_runs_and_notes_the_probe_differs(finished_run):
    """`merit inspect RUN` as printed: the built-in probe fills its length without a 'first N measured'
    note, and where its max logit differs from training's, a note says the inputs differ."""
    out, result = finished_run
    output = result.output
    args = _hint(output, "inspect")
    assert args == ["inspect", str(out)]
    ran = CliRunner().invoke(cli, [*args, "--seq-len", "16", "--no-weights"])
    assert ran.exit_code == 0, ran.output
    assert "were measured" not in ran.output

    from merit_core.diagnostics.inspect_report import InspectOptions, inspect_paths
    from merit_core.metrics import read_metrics

    (ckpt,) = [c for c in inspect_paths([out], InspectOptions(seq_len=16)).checkpoints if c.step == 4]
    assert ckpt.probe.source == "builtin" and ckpt.probe.n_tokens == 16 and ckpt.probe.notes == []
    trained = next(r for r in read_metrics(out) if r["step"] == 4 and "max_attention_logit" in r)
    peak = max(trained["max_attention_logit"])
    assert ckpt.summary.max_attention_logit != pytest.approx(peak, rel=1e-3)  # other inputs, other numbers
    (note,) = [n for n in ckpt.notes if n.startswith("training recorded")]
    assert f"{peak:.4g}" in note and "first validation batch" in note and "built-in paragraph (16 tokens)" in note
    assert "training recorded" in ran.output


def test_a_run_looks_its_optimizer_up_once_and_its_start_line_prints_resolves_lr(
    model_cfg, data_dir, tmp_path, monkeypatch
):
    """TrainingRun looks the optimizer's spec up once and hands it to the hyperparameter check, the
    fsdp check (which a single process still runs), resolve and the Trainer (its builder and step
    hook); on_start carries the default lr resolve applied, whose source the start line prints."""
    import io

    from rich.console import Console

    from merit_cli.train_cmd import RichTrainReport
    from merit_core.optim import registry
    from merit_core.train import training_run
    from merit_core.train.config import load_config

    lookups = []

    class CountingSpecs(dict):
        def __contains__(self, key):  # canonical_name's one test per lookup by name
            lookups.append(key)
            return super().__contains__(key)

    monkeypatch.setattr(registry, "_SPECS", CountingSpecs(registry._SPECS))
    trainers, build = [], training_run.build_trainer
    monkeypatch.setattr(training_run, "build_trainer", lambda *args: trainers.append(build(*args)) or trainers[-1])
    starts = []

    class Report(RichTrainReport):
        def on_start(self, info):
            starts.append(info)
            super().on_start(info)

    report = Report()
    report.out = Console(file=io.StringIO(), width=400)
    settings = {k: v for k, v in TINY_TRAIN.items() if k != "lr"}
    values = {**settings, "model": str(model_cfg), "data": str(data_dir), "out": str(tmp_path / "run")}
    config = load_config(values={**values, "optimizer": "SophiaG", "parallel": "fsdp", "steps": 1, "eval_every": 0})
    training_run.run_training(config, report)
    assert lookups == ["sophiag"]

    spec = registry.get_spec("sophiag")
    (info,) = starts
    assert info.config.optimizer == "sophiag" and trainers[0].hook is spec.step_hook is not None
    assert info.lr_default.source == "sophiag's registry default (no measured lr for it)"
    assert info.config.lr == info.lr_default.lr == spec.defaults["lr"]
    text = " ".join(report.out.file.getvalue().split())
    assert f"with sophiag, lr {info.config.lr:g} (sophiag's registry default (no measured lr for it))," in text


def test_every_metrics_line_is_a_metrics_record(finished_run):
    """What a run writes is what MetricsRecord declares: step and tokens in every line, no other key."""
    from merit_core.metrics import MetricsRecord, eval_lines, log_lines

    records = read_metrics(finished_run[0])
    declared = set(MetricsRecord.__annotations__)
    for record in records:
        assert MetricsRecord.__required_keys__ <= set(record) <= declared, sorted(set(record) - declared)
    assert [r["step"] for r in log_lines(records)] == [1, 2, 3, 4]
    assert [r["step"] for r in eval_lines(records)] == [0, 2, 4]
