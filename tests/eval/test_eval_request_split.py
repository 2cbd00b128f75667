"""`merit eval CKPT --devices cpu,cpu`: one checkpoint's requests shared over two worker processes
(`--share requests`, the default for fewer checkpoints than devices), against the one-process run of
the same command (the reference: its JSON and lm-eval's files, key for key); a worker that dies; the
shares the requests are cut into."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner

from merit_cli.main import cli
from tests.cli_runs import invoke, train_args

# --batch-size 1: each request is one forward pass of its own tokens, unpadded, whichever process
# scores it; with one torch thread in every process (below) each answer is then the same arithmetic
# as in the one-process run, so the scores and stderrs are compared exactly.
QUICK = ["--tasks", "builtin", "--limit", "3", "--bootstrap-iters", "10", "--batch-size", "1"]
TIMES = ("date", "total_evaluation_time_seconds", "start_time", "end_time")  # lm-eval's clock readings


@pytest.fixture(scope="module")
def checkpoint(model_cfg, data_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("split") / "run"
    trained = invoke(train_args(model_cfg, data_dir, run, "--steps", "2"))
    assert trained.exit_code == 0, trained.output
    return run / "step_2"


@pytest.fixture
def one_thread(monkeypatch):
    """One torch thread in this process and in each worker, whatever the machine's core count."""
    import torch

    from merit_core.evaluation import worker_processes

    monkeypatch.setattr(worker_processes, "thread_share", lambda workers, cores=None: 1)
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _eval(*args):
    return CliRunner().invoke(cli, ["eval", *args])


def _lm_eval_file(folder):
    (path,) = folder.glob("*/results_*.json")
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if k not in TIMES}


def _samples(folder):
    """task -> lm-eval's per-document records (--log_samples), in its order: each request's answer."""
    out = {}
    for path in sorted(folder.glob("*/samples_*.jsonl")):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        out[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return out


def _without_devices(record):
    """A record with the devices that scored it left out (meta.eval's device and devices)."""
    evaluated = {k: v for k, v in record["meta"]["eval"].items() if k not in ("device", "devices")}
    return {**record, "meta": {**record["meta"], "eval": evaluated}}


@pytest.mark.slow
def test_two_workers_sharing_the_requests_equal_the_one_process_run_key_for_key(
    checkpoint, tmp_path, one_thread, monkeypatch
):
    from merit_core.evaluation import request_split

    cut = request_split.contiguous_shares
    shares = []
    monkeypatch.setattr(
        request_split, "contiguous_shares", lambda sizes, parts: shares.append(cut(sizes, parts)) or shares[-1]
    )
    one_json, two_json = tmp_path / "one.json", tmp_path / "two.json"
    one = _eval(str(checkpoint), *QUICK, "-o", str(one_json), "--output_path", str(tmp_path / "one"), "--log_samples")
    assert one.exit_code == 0, one.output
    two = _eval(
        str(checkpoint), *QUICK, "--devices", "cpu,cpu", "-o", str(two_json), "--output_path", str(tmp_path / "two"),
        "--log_samples",
    )  # fmt: skip  # one checkpoint on two devices: the requests are split without --share
    assert two.exit_code == 0, two.output
    (reference,) = json.loads(one_json.read_text())["checkpoints"]
    split = json.loads(two_json.read_text())
    (record,) = split["checkpoints"]
    assert record["results"] == reference["results"]  # scores and stderrs, exactly
    assert _without_devices(record) == _without_devices(reference)  # and the rest of the meta
    assert split["devices"] == {"split": "requests", "workers": ["cpu", "cpu"]}
    assert record["meta"]["eval"]["devices"] == split["devices"] and record["meta"]["eval"]["device"] == "cpu,cpu"
    assert "devices" not in reference["meta"]["eval"] and reference["meta"]["eval"]["device"] == "cpu"
    one_file, two_file = _lm_eval_file(tmp_path / "one"), _lm_eval_file(tmp_path / "two")
    assert two_file["config"].pop("device") == "cpu,cpu" and one_file["config"].pop("device") == "cpu"
    assert two_file == one_file  # lm-eval's file: every key, the model's name, size, dtype, tokenizer
    one_samples, two_samples = _samples(tmp_path / "one"), _samples(tmp_path / "two")
    assert sorted(two_samples) == ["builtin_lastword", "builtin_perplexity"]
    assert all(len(docs) == 3 for docs in two_samples.values())
    assert len(shares) == 2 and all(len(a) and len(b) for a, b in shares)  # each request type: both workers scored
    assert two_samples == one_samples  # each document's answer, in lm-eval's order


@pytest.mark.slow
def test_a_worker_that_dies_is_one_line_naming_its_device_and_nothing_is_written(checkpoint, tmp_path, monkeypatch):
    from merit_core.evaluation import request_split

    ask = request_split.RequestPool._ask
    killed = []

    def kill_the_second_before_it_scores(self, messages, doing):
        if messages[1] is not None and messages[1][0] == "score" and not killed:
            killed.append(self.workers[1].proc.pid)
            os.kill(self.workers[1].proc.pid, signal.SIGKILL)
            self.workers[1].proc.join()
        return ask(self, messages, doing)

    monkeypatch.setattr(request_split.RequestPool, "_ask", kill_the_second_before_it_scores)
    out = tmp_path / "lost.json"
    res = _eval(
        str(checkpoint), *QUICK, "--devices", "cpu,cpu", "--share", "requests", "-o", str(out),
        "--output_path", str(tmp_path / "lm"),
    )  # fmt: skip
    lines = res.output.strip().splitlines()
    assert killed and res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert lines[-1] == (
        "error: run/step_2: the worker on cpu (2 of 2) stopped (signal 9) while scoring its share of the requests"
    ), lines[-1]
    assert not out.exists() and not (tmp_path / "lm").exists()  # nothing half-written
    assert [line for line in lines if line.startswith("error")] == lines[-1:]


def test_shares_are_contiguous_cover_every_request_in_order_and_split_the_text_evenly():
    from merit_core.evaluation.request_split import contiguous_shares

    sizes = [5, 1, 1, 1, 1, 1, 9, 1, 1, 1, 1, 1]  # 24 characters
    shares = contiguous_shares(sizes, 2)
    assert [i for share in shares for i in share] == list(range(len(sizes)))
    assert [sum(sizes[i] for i in share) for share in shares] == [10, 14]  # the cut nearest half (12)
    assert contiguous_shares([3, 3, 3], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert contiguous_shares([7], 2) == [range(0, 1), range(1, 1)]  # fewer requests than workers: one idle
    assert contiguous_shares([], 2) == [range(0, 0), range(0, 0)]
    assert contiguous_shares([0, 0, 0, 0], 2) == [range(0, 2), range(2, 4)]  # an empty string counts as one


def test_the_default_split_by_the_number_of_checkpoints():
    from merit_core.errors import ConfigError
    from merit_core.evaluation.worker_processes import CHECKPOINTS, REQUESTS, choose_split

    assert [choose_split(None, n, 2) for n in (1, 2, 5)] == [REQUESTS, CHECKPOINTS, CHECKPOINTS]
    assert choose_split(None, 3, 8) == REQUESTS and choose_split(REQUESTS, 5, 2) == REQUESTS
    with pytest.raises(ConfigError, match="--share layers: give checkpoints or requests"):
        choose_split("layers", 1, 2)


def test_a_worker_that_fails_stops_the_eval_with_one_line_naming_its_device():
    """A worker's exception crosses the pipe as its first line; the pool raises RunFailed naming the
    checkpoint and the device (the pipes here stand in for two worker processes)."""
    import multiprocessing

    from merit_core.errors import RunFailed
    from merit_core.evaluation.request_split import RequestPool
    from merit_core.evaluation.worker_processes import Worker

    pool = RequestPool.__new__(RequestPool)
    pairs = [multiprocessing.Pipe() for _ in range(2)]
    pool.workers = [Worker(device, mine, None) for device, (mine, _) in zip(("cuda:0", "cuda:1"), pairs)]
    pool.label = "run/step_8"
    pairs[0][1].send(("answers", {"answers": [(-1.5, True)], "batch_sizes": {}}))
    pairs[1][1].send(("failed", "CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(RunFailed) as caught:
        pool.answer("loglikelihood", [("a", " b"), ("c", " d")])
    assert str(caught.value) == (
        "run/step_8: the worker on cuda:1 (2 of 2) failed while scoring its share of the requests: "
        "CUDA out of memory. Tried to allocate 2.00 GiB"
    )
    assert [end.recv()[0] for _, end in pairs] == ["score", "score"]  # each was sent its share
