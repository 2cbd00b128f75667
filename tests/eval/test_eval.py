"""`merit eval` and merit_core.evaluation on a tiny GPT-2 with local lm-eval tasks, fully offline."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from merit_cli.main import cli

HARBOUR_TEXT = """\
The harbour town wakes before the sun, when the fishing boats leave the quay.
Mara runs the bakery by the harbour, and every morning she bakes rye bread.
The baker sells warm rye bread to the fishermen before they sail.
At noon the ferry crosses the bay to the island with mail and tourists.
The ferry captain rings a brass bell when the ferry leaves the pier.
Old Tomas repairs nets on the quay and tells stories about the storm.
Children watch the gulls circle over the fish market near the pier.
In winter the wind from the north freezes the ropes on the boats.
The lighthouse on the cape flashes twice every ten seconds at night.
The keeper of the lighthouse writes the weather in a thick logbook.
On Sundays the town band plays old songs in the square by the fountain.
The train from the capital arrives at six and leaves again at seven.
Tourists buy postcards of the lighthouse and the harbour at the kiosk.
When the tide is low, the children collect shells along the sandy beach.
"""

LAMBADA_LINES = [
    "Every morning Mara bakes rye bread in the bakery by the harbour",
    "The ferry captain rings a brass bell when the ferry leaves the pier",
    "Old Tomas repairs nets on the quay and tells stories about the storm",
    "The lighthouse on the cape flashes twice every ten seconds at night",
    "On Sundays the town band plays old songs in the square by the fountain",
    "The train from the capital arrives at six and leaves again at seven",
    "Children watch the gulls circle over the fish market near the pier",
    "When the tide is low the children collect shells along the sandy beach",
    "The keeper of the lighthouse writes the weather in a thick logbook",
    "Tourists buy postcards of the lighthouse and the harbour at the kiosk",
]

WIKI_PAGES = [
    " = The Harbour = \n The harbour town wakes before the sun . The fishing boats leave the quay at dawn . ",
    " = The Bakery = \n Mara runs the bakery by the harbour . She bakes rye bread every morning . ",
    " = The Ferry = \n The ferry crosses the bay at noon . The captain rings a brass bell when it leaves the pier . ",
    " = The Lighthouse = \n " + "The lighthouse on the cape flashes twice every ten seconds at night . " * 12,
    " = Winter = \n In winter the wind from the north freezes the ropes on the boats . ",
    " = The Square = \n On Sundays the town band plays old songs in the square by the fountain . ",
]


def _task_yaml(name: str, data: Path, output_type: str, text: str, target: str, metrics: dict) -> str:
    """An lm-eval task config over a local JSONL file (written as JSON, which YAML reads)."""
    return json.dumps(
        {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "output_type": output_type,
            "test_split": "test",
            "doc_to_text": text,
            "doc_to_target": target,
            "metric_list": [
                {"metric": m, "aggregation": agg, "higher_is_better": hib} for m, (agg, hib) in metrics.items()
            ],
            "metadata": {"version": 1.0},
        },
        indent=1,
    )


def lambada_yaml(name: str, data: Path) -> str:
    """Last-word prediction: the context is the line but its last word, the target is that word."""
    return _task_yaml(
        name,
        data,
        "loglikelihood",
        "{{text.split(' ')[:-1]|join(' ')}}",
        "{{' '+text.split(' ')[-1]}}",
        {"perplexity": ("perplexity", False), "acc": ("mean", True)},
    )


def wiki_yaml(name: str, data: Path) -> str:
    """Rolling log-likelihood of whole pages."""
    return _task_yaml(
        name,
        data,
        "loglikelihood_rolling",
        "",
        "{{page}}",
        {
            "word_perplexity": ("weighted_perplexity", False),
            "byte_perplexity": ("weighted_perplexity", False),
            "bits_per_byte": ("bits_per_byte", False),
        },
    )


LOCAL_TASKS = ["harbour_lambada", "harbour_wiki"]
TRAINER_STATE = {"step": 12, "optimizer": "merit", "global_batch_size": 8192, "seq_len": 64, "tokens": 6291456}


def _set_offline(mp: pytest.MonkeyPatch, root: Path) -> None:
    """HF libraries offline with caches under `root`, also when another test imported them already."""
    env = {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(root / "hf"),
        "HF_DATASETS_CACHE": str(root / "hf" / "datasets"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "DISABLE_MULTIPROC": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in env.items():
        mp.setenv(key, value)
    if "huggingface_hub" in sys.modules:
        mp.setattr(sys.modules["huggingface_hub"].constants, "HF_HUB_OFFLINE", True)
    if "datasets" in sys.modules:
        config = sys.modules["datasets"].config
        mp.setattr(config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(config, "HF_HUB_OFFLINE", True, raising=False)
        mp.setattr(config, "HF_DATASETS_CACHE", root / "hf" / "datasets")


def _tokenizer(corpus: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=64,
    )


def _tiny_gpt2(seed: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    )


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
        _set_offline(mp, root)
        corpus = root / "harbour.txt"
        corpus.write_text(HARBOUR_TEXT * 8, encoding="utf-8")
        tokenizer = _tokenizer(corpus)

        run = root / "run"
        untrained = _tiny_gpt2(seed=0)
        trained = _tiny_gpt2(seed=0)
        _train(trained, tokenizer, HARBOUR_TEXT * 8)
        for step, model in ((5, untrained), (12, trained)):
            model.save_pretrained(run / f"step_{step}")
            tokenizer.save_pretrained(run / f"step_{step}")
            state = {**TRAINER_STATE, "step": step, "tokens": step * 8192 * 64}
            (run / f"step_{step}" / "trainer_state.json").write_text(json.dumps(state))
        (run / "step_20.tmp").mkdir()  # an unfinished save: must be ignored
        (run / "config.toml").write_text('[optim]\nname = "merit"\n')
        (run / "metrics.jsonl").write_text('{"step": 12, "loss": 3.0}\n')

        tasks = root / "tasks"
        tasks.mkdir()
        with open(tasks / "harbour_lambada.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": line}) + "\n" for line in LAMBADA_LINES)
        with open(tasks / "harbour_wiki.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"page": page}) + "\n" for page in WIKI_PAGES)
        (tasks / "harbour_lambada.yaml").write_text(lambada_yaml("harbour_lambada", tasks / "harbour_lambada.jsonl"))
        (tasks / "harbour_wiki.yaml").write_text(wiki_yaml("harbour_wiki", tasks / "harbour_wiki.jsonl"))
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
    _tiny_gpt2(seed=1).save_pretrained(no_tok)
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
