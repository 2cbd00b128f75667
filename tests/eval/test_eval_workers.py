"""`merit eval --devices`: a run's checkpoints scored by worker processes, one per device, against the
one-process run of the same command (the reference: its JSON and lm-eval's files, key for key); and
lm-eval's model placement (`--model_args parallelize=True`, `--model vllm`) as merit passes it on."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.cli_runs import invoke, train_args

QUICK = ["--tasks", "builtin", "--limit", "3", "--bootstrap-iters", "10", "--batch-size", "4"]
# what differs between two runs of one command: lm-eval's clock readings
TIMES = ("date", "total_evaluation_time_seconds", "start_time", "end_time")


@pytest.fixture(scope="module")
def steps_run(model_cfg, data_dir, tmp_path_factory):
    """A `merit train` run with 4 checkpoints (step_2 .. step_8) and its one-process eval: the reference."""
    root = tmp_path_factory.mktemp("workers")
    run = root / "run"
    trained = invoke(train_args(model_cfg, data_dir, run, "--steps", "8"))
    assert trained.exit_code == 0, trained.output
    out = root / "one.json"
    res = _eval(str(run), "--steps", "all", *QUICK, "-o", str(out), "--output_path", str(root / "one"))
    assert res.exit_code == 0, res.output
    return {"root": root, "run": run, "json": json.loads(out.read_text()), "lm_eval": root / "one"}


def _eval(*args):
    return CliRunner().invoke(cli, ["eval", *args])


def _lm_eval_files(folder):
    """step folder name -> lm-eval's results file, its clock readings left out."""
    out = {}
    for path in sorted(folder.glob("*/results_*.json")):
        data = json.loads(path.read_text())
        out[path.parent.name] = {k: v for k, v in data.items() if k not in TIMES}
    return out


@pytest.mark.slow
def test_two_workers_equal_the_one_process_run_key_for_key(steps_run, tmp_path):
    out = tmp_path / "two.json"
    res = _eval(
        str(steps_run["run"]), "--steps", "all", *QUICK, "--devices", "cpu,cpu", "-o", str(out), "--output_path",
        str(tmp_path / "two"),
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    two = json.loads(out.read_text())
    assert [c["meta"]["step"] for c in two["checkpoints"]] == [2, 4, 6, 8]  # step order, whoever scored first
    assert two["checkpoints"] == steps_run["json"]["checkpoints"]  # scores, stderrs, meta (no clock in it)
    assert two["devices"] == {"split": "checkpoints", "workers": ["cpu", "cpu"]} and "missing" not in two
    one_files, two_files = _lm_eval_files(steps_run["lm_eval"]), _lm_eval_files(tmp_path / "two")
    assert len(two_files) == 4 and all(name.endswith(f"step_{s}") for name, s in zip(two_files, (2, 4, 6, 8)))
    assert two_files == one_files
    assert {f["config"]["device"] for f in two_files.values()} == {"cpu"}  # the device that scored each


@pytest.mark.slow
def test_a_killed_worker_leaves_the_others_results_and_names_its_checkpoint(steps_run, tmp_path, monkeypatch):
    from merit_core.evaluation import workers

    handle = workers._Pool._handle
    killed = []

    def kill_while_loading_step_4(self, slot, message):
        """SIGKILL the worker that starts loading the second checkpoint (step_4), mid-way through the list."""
        if message[0] == "progress" and message[1]["index"] == 1 and not killed:
            killed.append(slot)
            os.kill(self.workers[slot].proc.pid, signal.SIGKILL)
        return handle(self, slot, message)

    monkeypatch.setattr(workers._Pool, "_handle", kill_while_loading_step_4)
    out = tmp_path / "lost.json"
    res = _eval(str(steps_run["run"]), "--steps", "all", *QUICK, "--devices", "cpu,cpu", "-o", str(out))
    assert killed and res.exit_code == 2
    last = res.output.strip().splitlines()[-1]
    assert last == "error: not scored: run/step_4: the worker on cpu stopped (signal 9) while scoring it", last
    lost = json.loads(out.read_text())
    one = {c["meta"]["step"]: c for c in steps_run["json"]["checkpoints"]}
    assert [c["meta"]["step"] for c in lost["checkpoints"]] == [2, 6, 8]
    assert lost["checkpoints"] == [one[2], one[6], one[8]]
    assert lost["missing"] == [
        {"path": str(steps_run["run"] / "step_4"), "error": last.removeprefix("error: not scored: ")}
    ]


def test_parallelize_reaches_lm_eval_with_a_cpu_device_map(steps_run, tmp_path, monkeypatch):
    """parallelize=True: lm-eval's HFLM loads the checked folder through accelerate's device map (here the
    CPU, within max_cpu_memory), with merit's dtype and safetensors only; the scores are the one-device run's."""
    import transformers
    from lm_eval.models import huggingface

    seen, loads = [], []
    init, load = huggingface.HFLM.__init__, transformers.AutoModelForCausalLM.from_pretrained

    def recording(self, *args, **kwargs):
        seen.append(kwargs)
        init(self, *args, **kwargs)

    def loading(*args, **kwargs):
        loads.append({**kwargs, "max_memory": dict(kwargs.get("max_memory") or {})})  # as given (it is read in place)
        return load(*args, **kwargs)

    monkeypatch.setattr(huggingface.HFLM, "__init__", recording)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loading)
    step = steps_run["run"] / "step_8"
    out = tmp_path / "split.json"
    offload = tmp_path / "offload"
    model_args = f"pretrained={step},parallelize=True,max_cpu_memory=2GiB,offload_folder={offload}"
    res = _eval("--model", "hf", "--model_args", model_args, *QUICK, "-o", str(out), "--output_path", str(tmp_path))
    assert res.exit_code == 0, res.output
    ((kwargs),) = seen
    assert kwargs["pretrained"] == str(step) and kwargs["parallelize"] is True
    assert (kwargs["max_cpu_memory"], kwargs["offload_folder"]) == ("2GiB", str(offload))
    assert (kwargs["dtype"], kwargs["use_safetensors"]) == ("float32", True)
    ((loaded),) = loads  # lm-eval's own load: accelerate's device map over no GPU, then the host's 2GiB
    assert (loaded["device_map"], loaded["max_memory"], loaded["offload_folder"]) == (
        "auto",
        {"cpu": "2GiB"},
        str(offload),
    )
    assert loaded["use_safetensors"] is True and str(loaded["dtype"]) == "torch.float32"
    (record,) = json.loads(out.read_text())["checkpoints"]
    (one,) = [c for c in steps_run["json"]["checkpoints"] if c["meta"]["step"] == 8]
    assert record["results"] == one["results"]
    assert record["meta"]["eval"]["model"] == {
        "backend": "hf", "parallelize": True, "max_cpu_memory": "2GiB", "offload_folder": str(offload)
    }  # fmt: skip
    (lm_file,) = tmp_path.glob("*step_8/results_*.json")
    assert json.loads(lm_file.read_text())["config"]["model_args"]["parallelize"] is True  # as lm-eval records it


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "vllm"], "--model vllm: vLLM is not installed here"),
        (["--model_args", "pretrained=x,tensor_parallel_size=2"], "--model hf takes parallelize"),
        (["--model_args", "pretrained=x,parallelize=maybe"], "parallelize=maybe: give True or False"),
        (["x", "--devices", "cuda:3"], "--devices cuda:3"),
        (["x", "--devices", "all"], "--devices all: no CUDA GPU is visible"),
        (["x", "--devices", "cpu,cpu", "--device", "cpu"], "not both"),
        (["x", "--share", "requests"], "--share requests is what the --devices workers share: give --devices too"),
    ],
)
def test_placement_input_errors_are_one_line_exit_2(args, words):
    pytest.importorskip("torch")
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is not None and "vllm" in args or torch.cuda.is_available() and "all" in args:
        pytest.skip("this machine has what the refusal is about")
    res = _eval(*args, "--tasks", "builtin")
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert words in lines[0], lines[0]


def test_devices_and_thread_shares():
    from merit_core.evaluation.worker_processes import parse_devices, thread_share

    assert parse_devices("cpu, cpu") == ("cpu", "cpu")
    assert [thread_share(n, cores=16) for n in (1, 2, 3, 8, 32)] == [16, 8, 5, 2, 1]
