"""The watcher decides, the run acts: under 2 CPU processes (gloo; --parallel ddp and fsdp) a planted
divergence stopped with `--on-instability stop` leaves exactly the checkpoints a rewind goes back
to, and `--on-instability rewind` continues exactly as `--resume-from` that checkpoint with the
lower lr does: every checkpoint file, metrics.jsonl and config.toml bit for bit the same (one
torchrun launch, tests/dist_scripts/watch_decisions.py)."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from merit_core.checkpoint import runs
from merit_core.metric_names import TOKENS_PER_S, WATCH_REWIND
from merit_core.metrics import read_metrics
from tests.prepared_data import write_prepared, write_tiny_model_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "watch_decisions.py"
LR = 3e-3  # the script's configured lr (its LR)
# DCP's index of the optimizer shards records the folder it was written to (rewind-P/ or stopped-P/),
# and trainer_state.json that index's checksum; the shards themselves are compared byte for byte
# (under ddp every file is).
NAMES_THEIR_FOLDER = {"optimizer/.metadata", runs.STATE_JSON}
SEALS = {"checksums", "state_sha256"}  # trainer_state.json's digests of the files (and of itself)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The folder the torchrun launch filled: rewind-P/, stopped-P/ and results.json for P in ddp, fsdp."""
    work = tmp_path_factory.mktemp("watch")
    write_prepared(work / "data", n_sentences=1500)
    write_tiny_model_config(work / "model")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TMPDIR": str(work)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    proc = subprocess.run([*cmd, str(work)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return work


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()}


def _rewind(run: Path) -> dict:
    (rewind,) = [r[WATCH_REWIND] for r in read_metrics(run) if WATCH_REWIND in r]
    return rewind


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_stop_leaves_the_checkpoints_a_rewind_goes_back_to(work, parallel):
    stop = json.loads((work / "results.json").read_text())[parallel]
    rewound, stopped = work / f"rewind-{parallel}", work / f"stopped-{parallel}"
    rewind = _rewind(rewound)
    assert (rewind["lr_before"], rewind["lr_after"]) == (LR, LR / 2) and rewind["to_step"] < rewind["from_step"]
    assert Path(stop["checkpoint"]) == runs.step_path(stopped, rewind["to_step"])
    assert f"--resume-from {runs.step_name(rewind['to_step'])} --lr {LR / 2:g}" in stop["message"]
    assert f"instability warning at step {rewind['from_step']}" in stop["message"]
    saved = sorted(runs.step_name(s) for s, _ in runs.checkpoints(rewound) if s <= rewind["to_step"])
    assert stop["left"] == saved


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_rewind_continues_bit_for_bit_as_a_resume_with_the_lower_lr(work, parallel):
    rewound, resumed = work / f"rewind-{parallel}", work / f"stopped-{parallel}"
    steps = [s for s, _ in runs.checkpoints(rewound)]
    assert steps == [s for s, _ in runs.checkpoints(resumed)] and steps[-1] > _rewind(rewound)["to_step"]
    for step in steps:
        a, b = _files(runs.step_path(rewound, step)), _files(runs.step_path(resumed, step))
        assert a.keys() == b.keys(), step
        assert runs.WEIGHTS_NAME in a and runs.STATE_PT in a
        assert {n for n in a if a[n] != b[n]} <= (NAMES_THEIR_FOLDER if parallel == "fsdp" else set()), step
        sa, sb = json.loads(a[runs.STATE_JSON]), json.loads(b[runs.STATE_JSON])
        assert {k: v for k, v in sa.items() if k not in SEALS} == {k: v for k, v in sb.items() if k not in SEALS}
        assert {k: v for k, v in sa["checksums"].items() if k not in NAMES_THEIR_FOLDER} == {
            k: v for k, v in sb["checksums"].items() if k not in NAMES_THEIR_FOLDER
        }

    def records(run):  # the rewind's own record aside, and the throughput (a time)
        return [{k: v for k, v in r.items() if k != TOKENS_PER_S} for r in read_metrics(run) if WATCH_REWIND not in r]

    assert records(rewound) == records(resumed)

    def config(run):  # the run folders differ
        return {k: v for k, v in tomllib.loads((run / "config.toml").read_text()).items() if k != "out"}

    assert config(rewound) == config(resumed) and config(rewound)["lr"] == LR / 2
