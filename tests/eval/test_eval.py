"""`merit eval` and merit_core.evaluation on a tiny GPT-2 with local lm-eval tasks, fully offline."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.eval.local_tasks import (
    HARBOUR_TEXT,
    LAMBADA_LINES,
    LOCAL_TASKS,
    WIKI_PAGES,
    eval_gpt2,
    lambada_yaml,
    set_offline,
    train_tokenizer,
    write_local_tasks,
)

TRAINER_STATE = {"step": 12, "optimizer": "merit", "global_batch_size": 8192, "seq_len": 64, "tokens": 6291456}


def _train(model, tokenizer, text: str, steps: int = 60) -> None:
    import torch

    ids = torch.tensor(tokenizer(text)["input_ids"])
    windows = ids[: len(ids) // 64 * 64].view(-1, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        batch = windows[torch.arange(8) * 7 % len(windows) + step % 2]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Offline HF env, a `merit train`-like run folder (untrained step_5, trained step_12) and local tasks."""
    import torch

    root = tmp_path_factory.mktemp("eval")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and immune to a busy machine
    with pytest.MonkeyPatch.context() as mp:
        set_offline(mp, root)
        corpus = root / "harbour.txt"
        corpus.write_text(HARBOUR_TEXT * 8, encoding="utf-8")
        tokenizer = train_tokenizer(corpus)

        run = root / "run"
        untrained = eval_gpt2(seed=0)
        trained = eval_gpt2(seed=0)
        _train(trained, tokenizer, HARBOUR_TEXT * 8)
        for step, model in ((5, untrained), (12, trained)):
            model.save_pretrained(run / f"step_{step}")
            tokenizer.save_pretrained(run / f"step_{step}")
            state = {**TRAINER_STATE, "step": step, "tokens": step * 8192 * 64}
            (run / f"step_{step}" / "trainer_state.json").write_text(json.dumps(state))
        (run / "step_20.tmp").mkdir()  # an unfinished save: must be ignored
        (run / "config.toml").write_text('[optim]\nname = "merit"\n')
        (run / "metrics.jsonl").write_text('{"step": 12, "loss": 3.0}\n')

        tasks = write_local_tasks(root / "tasks")
        yield {"root": root, "run": run, "tasks": tasks, "tokenizer": tokenizer}
    torch.set_num_threads(threads)


def _direct_lm_eval(model_dir: Path, tasks_dir: Path, **kw) -> dict:
    """What lm-eval itself reports for the saved model: simple_evaluate on an HFLM, no merit code involved."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    lm = HFLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(model_dir), batch_size=4)
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=LOCAL_TASKS, task_manager=manager, num_fewshot=0, log_samples=False, **kw
    )
    return out["results"]


def _invoke(*args: str):
    return CliRunner().invoke(cli, ["eval", *args], catch_exceptions=False)


def test_cli_matches_lm_eval_and_writes_json(world, tmp_path):
    run, tasks = world["run"], world["tasks"]
    out = tmp_path / "results" / "eval.json"
    result = _invoke(
        str(run),
        str(run / "step_5"),
        "--tasks",
        ",".join(LOCAL_TASKS),
        "--include-path",
        str(tasks),
        "--trust-task-code",
        "--batch-size",
        "4",
        "--bootstrap-iters",
        "100",
        "--device",
        "cpu",
        "-o",
        str(out),
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["eval.json"]  # no temp file left behind

    data = json.loads(out.read_text())
    assert list(data) == ["checkpoints"]
    first, second = data["checkpoints"]
    assert [set(c) for c in data["checkpoints"]] == [{"path", "results", "meta"}] * 2
    assert first["path"] == str((run / "step_12").resolve())  # a run folder means its latest step
    assert second["path"] == str((run / "step_5").resolve())
    for ckpt, step in ((first, 12), (second, 5)):
        meta = ckpt["meta"]
        assert (meta["optimizer"], meta["step"], meta["global_batch_size"], meta["seq_len"]) == (
            "merit",
            step,
            8192,
            64,
        )
        assert meta["source"] == "merit-train" and meta["model_type"] == "gpt2"
        assert meta["eval"]["tasks"] == LOCAL_TASKS and meta["eval"]["num_fewshot"] == 0
        assert meta["eval"]["dtype"] == "float32" and meta["eval"]["batch_size"] == 4

    # Exactly what lm-eval reports for the same model, stderrs included.
    direct = _direct_lm_eval(run / "step_12", tasks, bootstrap_iters=100)
    assert first["results"] == json.loads(json.dumps(direct))
    direct_untrained = _direct_lm_eval(run / "step_5", tasks, bootstrap_iters=100)
    assert second["results"] == json.loads(json.dumps(direct_untrained))  # tasks reused across checkpoints
    lam, wiki = first["results"]["harbour_lambada"], first["results"]["harbour_wiki"]
    assert set(lam) >= {"perplexity,none", "perplexity_stderr,none", "acc,none", "acc_stderr,none"}
    assert set(wiki) >= {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"}
    assert lam["sample_len"] == len(LAMBADA_LINES) and wiki["sample_len"] == len(WIKI_PAGES)

    # The trained step predicts its own sentences better than the untrained one, column by column.
    untrained = second["results"]
    assert wiki["bits_per_byte,none"] < 0.8 * untrained["harbour_wiki"]["bits_per_byte,none"]
    assert lam["perplexity,none"] < untrained["harbour_lambada"]["perplexity,none"]
    assert lam["acc,none"] > untrained["harbour_lambada"]["acc,none"]

    # One column per checkpoint in the table, with the value ± stderr.
    header = next(line for line in result.output.splitlines() if "task" in line and "metric" in line)
    assert "run/step_12" in header and "run/step_5" in header
    acc_line = next(line for line in result.output.splitlines() if "acc ↑" in line)
    assert f"{lam['acc,none']:.4f} ± {lam['acc_stderr,none']:.4f}" in acc_line


def test_library_limit_matches_lm_eval(world):
    from merit_core.evaluation import EvalSettings, evaluate_checkpoints

    events = []
    settings = EvalSettings(
        tasks=["harbour_wiki", "harbour_lambada"],
        include_path=str(world["tasks"]),
        device="cpu",
        batch_size=4,
        limit=3,
        bootstrap_iters=0,
    )
    (record,) = evaluate_checkpoints([str(world["run"] / "step_12")], settings, progress=events.append)
    direct = _direct_lm_eval(world["run"] / "step_12", world["tasks"], limit=3, bootstrap_iters=0)
    assert record.results == direct
    assert record.meta["eval"]["n-samples"]["harbour_wiki"] == {"original": len(WIKI_PAGES), "effective": 3}
    # Progress: tasks, model, then request counts up to the number of documents per request type.
    stages = [e.stage for e in events]
    assert stages[:3] == ["checking checkpoints", "loading tasks and datasets", "loading model"]
    assert stages[-1] == "done" and {e.item for e in events[2:]} == {"run/step_12"}
    finished = {e.stage: (e.done, e.total) for e in events if e.unit == "requests"}
    assert finished == {"loglikelihood requests": (3, 3), "loglikelihood_rolling requests": (3, 3)}


def test_dtype_is_applied_and_recorded(world):
    """--dtype float32 is exactly lm-eval on the fp32 model; bfloat16 loads bf16 weights (scores move a
    little) and says so in meta.eval.dtype."""
    from merit_core.evaluation import EvalSettings, evaluate_checkpoints

    common = dict(include_path=str(world["tasks"]), device="cpu", batch_size=4, limit=3, bootstrap_iters=0)
    ckpt = str(world["run"] / "step_12")
    (fp32,) = evaluate_checkpoints([ckpt], EvalSettings(tasks=LOCAL_TASKS, dtype="float32", **common))
    (bf16,) = evaluate_checkpoints([ckpt], EvalSettings(tasks=LOCAL_TASKS, dtype="bfloat16", **common))
    assert fp32.meta["eval"]["dtype"] == "float32" and bf16.meta["eval"]["dtype"] == "bfloat16"
    assert fp32.results == _direct_lm_eval(world["run"] / "step_12", world["tasks"], limit=3, bootstrap_iters=0)
    a, b = fp32.results["harbour_wiki"]["bits_per_byte,none"], bf16.results["harbour_wiki"]["bits_per_byte,none"]
    assert a != b and abs(a - b) < 0.05 * a  # bf16 weights: close, not equal


def test_aliases_resolve_from_known_folders(world):
    from merit_core.evaluation.tasks import resolve_tasks

    start = time.perf_counter()
    resolved = resolve_tasks("lambada,superglue,wikitext,harbour_wiki", include_path=world["tasks"])
    assert time.perf_counter() - start < 10  # no 15 s index of every built-in task
    assert resolved.index == "known-folders"
    assert resolved.names[:3] == ["lambada_openai", "lambada_standard", "boolq"] and "harbour_wiki" in resolved.names
    known = set(resolved.manager.all_tasks)
    assert set(resolved.names) <= known and "hellaswag" not in known
    entry = resolved.manager.task_index["lambada_openai"]
    assert entry.cfg["dataset_path"] == "EleutherAI/lambada_openai"  # lm-eval's own YAML, not a copy

    local = resolve_tasks(LOCAL_TASKS, include_path=world["tasks"])
    assert local.index == "include-path" and sorted(local.manager.all_tasks) == LOCAL_TASKS


def test_list_tasks_shows_aliases_and_local_tasks(world):
    result = _invoke("--list-tasks", "--include-path", str(world["tasks"]), "--trust-task-code")
    assert result.exit_code == 0, result.output
    for name in (
        "lambada",
        "lambada_openai",
        "lambada_standard",
        "wikitext",
        "superglue",
        "boolq",
        "sglue_rte",
        "harbour_lambada",
        "harbour_wiki",
    ):
        assert name in result.output


def test_builtin_task_offline_fails_fast_naming_the_dataset(world):
    start = time.perf_counter()
    result = _invoke(str(world["run"]), "--tasks", "lambada", "--device", "cpu")
    elapsed = time.perf_counter() - start
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert "EleutherAI/lambada_openai" in lines[0]
    assert "run once online" in lines[0] and "HF_DATASETS_CACHE" in lines[0] and "--include-path" in lines[0]
    assert elapsed < 10, elapsed


@pytest.fixture(scope="module")
def bad_checkpoints(world):
    """Folders that are not usable checkpoints."""
    import torch
    from transformers import BertConfig, BertModel

    root = world["root"] / "bad"
    no_tok = root / "no_tokenizer"
    eval_gpt2(seed=1).save_pretrained(no_tok)
    encoder = root / "encoder"
    torch.manual_seed(0)
    BertModel(
        BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ).save_pretrained(encoder)
    world["tokenizer"].save_pretrained(encoder)
    (root / "empty_run").mkdir()
    missing_data = root / "tasks"
    missing_data.mkdir()
    (missing_data / "gone.yaml").write_text(lambada_yaml("gone_lambada", root / "nowhere.jsonl"))
    return {"no_tok": no_tok, "encoder": encoder, "empty_run": root / "empty_run", "missing_data": missing_data}


BAD_INPUTS = {
    "unknown task": (
        lambda w, b: [str(w["run"]), "--tasks", "harbour_lambda", "--include-path", str(w["tasks"])],
        ["unknown task 'harbour_lambda'", "did you mean harbour_lambada"],
    ),
    "unknown alias-like task": (lambda w, b: [str(w["run"]), "--tasks", "superglu"], ["did you mean superglue"]),
    "missing checkpoint": (
        lambda w, b: [str(w["root"] / "no_such_run"), "--tasks", "harbour_wiki"],
        ["checkpoint not found"],
    ),
    "hub name, hub offline": (
        lambda w, b: ["merit-tests/no-such-model", "--tasks", "harbour_wiki"],
        ["merit-tests/no-such-model", "hub"],
    ),
    "bad device": (lambda w, b: [str(w["run"]), "--tasks", "harbour_wiki", "--device", "banana"], ["--device"]),
    "run folder without steps": (lambda w, b: [str(b["empty_run"]), "--tasks", "harbour_wiki"], ["no step_N/"]),
    "checkpoint without tokenizer": (lambda w, b: [str(b["no_tok"]), "--tasks", "harbour_wiki"], ["has no tokenizer"]),
    "encoder, not a causal LM": (
        lambda w, b: [str(b["encoder"]), "--tasks", "harbour_wiki"],
        ["BertModel", "not a causal language model"],
    ),
    "limit 0": (lambda w, b: [str(w["run"]), "--tasks", "harbour_wiki", "--limit", "0"], ["--limit"]),
    "batch size 0": (lambda w, b: [str(w["run"]), "--tasks", "harbour_wiki", "--batch-size", "0"], ["--batch-size"]),
    "no task": (lambda w, b: [str(w["run"])], ["no task given"]),
    "missing data file": (
        lambda w, b: [str(w["run"]), "--tasks", "gone_lambada", "--include-path", str(b["missing_data"])],
        ["gone_lambada", "nowhere.jsonl"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_2(world, bad_checkpoints, case):
    make_args, expected = BAD_INPUTS[case]
    args = make_args(world, bad_checkpoints)
    if "--include-path" not in args and case != "unknown alias-like task":
        args += ["--include-path", str(world["tasks"])]
    if "--include-path" in args:
        args.append("--trust-task-code")  # a task folder is code: trusted here, it is the test's own
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for text in expected:
        assert text in lines[0]
