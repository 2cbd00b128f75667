"""Long jobs on shared machines: preemption, one writer per run, user files, non-finite updates, compare workers."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from merit_cli.main import cli
from merit_core import durable_writes, errors
from merit_core.checkpoint import runs
from merit_core.checkpoint.tensors import load_trainer_state
from merit_core.metrics import read_metrics
from tests import cli_runs
from tests.cli_runs import invoke

TINY = dict(
    batch_size=4, micro_batch_size=2, seq_len=16, lr=3e-3, eval_every=3, save_every=4, log_every=1, eval_batches=1
)
REPO = Path(__file__).resolve().parents[2]


DATA_SENTENCES = 600  # the data_dir fixture's corpus (tests/conftest.py)


def train_args(model_cfg, data_dir, out, *extra):
    return cli_runs.train_args(model_cfg, data_dir, out, *extra, settings={**TINY, "eval_batch_size": 2})


def strip(records):
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


def subprocess_env():
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def reference(model_cfg, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "8"))
    assert result.exit_code == 0, result.output
    return out


def test_sigterm_mid_run_then_resume_equals_the_uninterrupted_run(model_cfg, data_dir, tmp_path, reference):
    from merit_core.train.callbacks import TrainCallbacks
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    class TermAtStep3(TrainCallbacks):
        def on_log(self, record):
            if record["step"] == 3:  # the signal arrives while step 3 is being logged
                os.kill(os.getpid(), signal.SIGTERM)

    out = tmp_path / "run"
    values = {**TINY, "eval_batch_size": 2, "model": str(model_cfg), "data": str(data_dir), "steps": 8, "out": str(out)}
    with pytest.raises(errors.RunInterrupted) as stopped:
        run_training(load_config(values=values), TermAtStep3())
    assert stopped.value.exit_code == 143 and "SIGTERM" in str(stopped.value)
    assert [s for s, _ in runs.checkpoints(out)] == [3]  # saved at the step it stopped after, not lost
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored

    result = invoke(["train", "--resume", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert strip(read_metrics(out)) == strip(read_metrics(reference))  # bit-exact losses, lrs, evals
    a = load_trainer_state(out / "step_8")["optimizer"]["state"]
    b = load_trainer_state(reference / "step_8")["optimizer"]["state"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i] if torch.is_tensor(a[i][k]))


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _max_step(out: Path) -> int:
    try:
        return max((r["step"] for r in read_metrics(out)), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize(("name", "code"), [("SIGINT", 130), ("SIGUSR1", 143)])
def test_sigint_and_sigusr1_stop_after_a_checkpoint_too(model_cfg, data_dir, tmp_path, name, code):
    from merit_core.train.callbacks import TrainCallbacks
    from merit_core.train.config import load_config
    from merit_core.train.training_run import run_training

    class SignalAtStep2(TrainCallbacks):
        def on_log(self, record):
            if record["step"] == 2:
                os.kill(os.getpid(), getattr(signal, name))

    out = tmp_path / "run"
    values = {**TINY, "eval_batch_size": 2, "model": str(model_cfg), "data": str(data_dir), "steps": 6, "out": str(out)}
    # a terminal's disposition, whatever this suite was started with (`pytest &` ignores SIGINT, which merit keeps)
    sig = getattr(signal, name)
    started_with = signal.signal(sig, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    try:
        with pytest.raises(errors.RunInterrupted) as stopped:
            run_training(load_config(values=values), SignalAtStep2())
    finally:
        signal.signal(sig, started_with)
    assert stopped.value.exit_code == code and stopped.value.checkpoint == out / "step_2"
    assert [s for s, _ in runs.checkpoints(out)] == [2]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143)])
def test_a_signal_to_merit_train_checkpoints_and_exits_with_its_code(model_cfg, data_dir, tmp_path, sig, code):
    out = tmp_path / "run"
    args = train_args(model_cfg, data_dir, out, "--steps", "100000", "--set", "save_every=0", "--set", "eval_every=0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "merit_cli", *args[0:]],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: _max_step(out) >= 2, 120, "training to start")
        sent = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == code, err
    (step, ckpt), *_ = runs.checkpoints(out)
    assert step >= 2 and f"stopped by {signal.Signals(sig).name} after step {step}" in err
    assert "Traceback" not in err and took < 30
    assert not (out / runs.LOCK_FILE).exists()  # the lock went with the process


def test_a_second_writer_is_refused_and_a_dead_holder_is_taken_over(model_cfg, data_dir, tmp_path, reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from merit_core.checkpoint.runs import lock_run; lock_run(sys.argv[1]); print('held', flush=True); "
            "time.sleep(120)",
            str(run),
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != runs.LOCK_FILE}
        started = time.monotonic()
        result = CliRunner().invoke(cli, ["train", "--resume", "--out", str(run), "--steps", "10"])
        assert result.exit_code == 2 and time.monotonic() - started < 30
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and f"in use by merit process {holder.pid}" in lines[0]
        assert {p: p.read_bytes() for p in before} == before
        result = CliRunner().invoke(cli, train_args(data_dir.parent, data_dir, run))  # a new run on it: refused too
        assert result.exit_code == 2
    finally:
        holder.kill()
        holder.wait()
    assert (run / runs.LOCK_FILE).exists()  # left by the killed holder: stale
    result = invoke(["train", "--resume", "--out", str(run), "--steps", "9"])
    assert result.exit_code == 0, result.output  # taken over
    assert [s for s, _ in runs.checkpoints(run)][-1] == 9 and not (run / runs.LOCK_FILE).exists()


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).digest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_out_on_a_folder_of_user_files_leaves_them_byte_identical(model_cfg, data_dir, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    (mine / ".tmp-step_3").mkdir(parents=True)  # named like merit's staging folders, but not merit's
    (mine / ".tmp-step_3" / "notes.txt").write_text("keep")
    (mine / "config.toml").write_text("# my settings\n")
    (mine / "metrics.jsonl").write_text('{"mine": true}\n')
    (mine / "curves.png").write_bytes(b"mine")
    before = _tree(mine)
    monkeypatch.chdir(mine)
    for out in (".", str(mine)):
        result = CliRunner().invoke(cli, train_args(model_cfg, data_dir, out, "--steps", "2"))
        assert result.exit_code == 2 and "not a merit run" in result.stderr
        assert _tree(mine) == before and sorted(p.name for p in mine.iterdir()) == sorted(
            [".tmp-step_3", "config.toml", "metrics.jsonl", "curves.png"]
        )


def test_a_nan_update_is_never_the_last_good_checkpoint(model_cfg, data_dir, tmp_path, monkeypatch):
    from merit_core.train.trainer import Trainer

    original = Trainer.train_step

    def poisoned(self):
        out = original(self)
        if self.step == 4:  # the update of step 4 writes a nan; its loss (computed before) is finite
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("nan")
        return out

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    out = tmp_path / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "8", "--set", "save_every=2"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "parameters became non-finite by step 4" in lines[0] and str(out / "step_2") in lines[0]
    assert [s for s, _ in runs.checkpoints(out)] == [2]
    assert not any(p.name.startswith(".tmp-") for p in out.iterdir())


def test_resume_falls_back_to_the_newest_checkpoint_that_loads(model_cfg, data_dir, tmp_path, reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "step_8" / "trainer_state.pt").write_bytes(b"")  # the latest is corrupt
    result = invoke(["train", "--resume", "--out", str(run)])
    assert result.exit_code == 0, result.output
    note = [line for line in result.output.splitlines() if "does not load" in line]
    assert len(note) == 1 and "resuming from" in note[0] and "step_4" in note[0]
    assert strip(read_metrics(run)) == strip(read_metrics(reference))  # retrained 5..8 identically
    result = invoke(["train", "--resume-from", "step_4", "--out", str(run)])
    assert result.exit_code == 0 and strip(read_metrics(run)) == strip(read_metrics(reference))


def test_files_get_the_users_umask(model_cfg, data_dir, tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        assert invoke(train_args(model_cfg, data_dir, out, "--steps", "2")).exit_code == 0
        report = tmp_path / "report.json"
        assert invoke(["inspect", str(out / "step_2"), "--no-logits", "-o", str(report)]).exit_code == 0
    finally:
        os.umask(old)
    files = [report, *[p for p in out.rglob("*") if p.is_file()]]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o644" for p in files}


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_compare_workers_die_with_their_parent(model_cfg, data_dir, tmp_path, how):
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--optimizers",
        "adamw,merit",
        "--batch-sizes",
        "2",
        "--lrs",
        "1e-3",
        "--tokens",
        "3200000",
        "--model",
        str(model_cfg),
        "--data",
        str(data_dir),
        "--seq-len",
        "16",
        "--jobs",
        "2",
        "--out",
        str(out),
        "--set",
        "eval_every=0",
        "--set",
        "save_every=0",
        "--set",
        "eval_batches=1",
        "--set",
        "eval_batch_size=2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "merit_cli", *args],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[int] = []
    try:
        run_dirs = lambda: sorted((out / "runs").glob("*")) if (out / "runs").is_dir() else []  # noqa: E731
        _wait_for(lambda: len(run_dirs()) == 2 and all(_max_step(d) >= 1 for d in run_dirs()), 180, "both workers")
        workers = _children(proc.pid)
        assert len(workers) == 2
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=120)
        _wait_for(lambda: not any(_alive(w) for w in workers), 60, "the workers to exit")
    finally:
        proc.kill()
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
    if how == "SIGTERM":
        assert proc.returncode == 143, proc.stderr.read()
    for run_dir in run_dirs():  # each worker saved where it stopped, and no run has two writers' records
        assert runs.checkpoints(run_dir), run_dir
        steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
        assert steps == sorted(set(steps))


def test_disk_full_is_one_line_naming_the_last_complete_checkpoint(model_cfg, data_dir, tmp_path, monkeypatch):
    import errno

    import merit_core.checkpoint.writer as checkpoint

    original = checkpoint.torch.save

    def full_at_step_4(obj, path, *args, **kwargs):
        if "step_4" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", full_at_step_4)
    out = tmp_path / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "6", "--set", "save_every=2"))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"disk full while writing {out / 'step_4'}" in lines[0]
    assert f"the last complete checkpoint is {out / 'step_2'}" in lines[0]
    assert [s for s, _ in runs.checkpoints(out)] == [2] and not any(p.name.startswith(".tmp-") for p in out.iterdir())


def test_atomic_write_disk_full_leaves_the_old_file(tmp_path, monkeypatch):
    import errno

    target = tmp_path / "summary.json"
    target.write_text("old")

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runs.os, "write", full)
    with pytest.raises(errors.DiskFull, match="disk full while writing"):
        durable_writes.atomic_write_json(target, {"new": 1})
    monkeypatch.undo()
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_prepare_cleans_only_its_own_stale_temp_folders_and_locks(tmp_path):
    from merit_core.data.prepare import prepare_corpus

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"document {i}: the cat sees the moon again and again." for i in range(300)))
    ours = tmp_path / ".merit-tmp-prepared-abc123"
    ours.mkdir()
    (ours / "all.bin").write_bytes(b"\0" * 1000)
    (ours / runs.STAGING_MARKER).write_text(f"{dead.pid}\n")
    live = tmp_path / ".merit-tmp-prepared-live"
    live.mkdir()
    (live / runs.STAGING_MARKER).write_text(f"{os.getpid()}\n")  # a prepare still running
    foreign = tmp_path / ".merit-tmp-prepared-user"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")  # no marker: not merit's
    (tmp_path / ".prepared.lock").write_text("12345\n")  # left by a killed prepare; nobody holds it
    prepare_corpus(str(corpus), tmp_path / "prepared", vocab_size=300)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["corpus.txt", "prepared", live.name, foreign.name])
    assert (foreign / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "prepared" / runs.STAGING_MARKER).exists()
    assert oct((tmp_path / "prepared" / "train.bin").stat().st_mode & 0o777) == oct(durable_writes.file_mode())


def test_run_lock_never_follows_a_planted_link(tmp_path):
    """A link planted at the lock's name is refused; the file it points to is left as it was."""
    from merit_core.checkpoint.runs import LOCK_FILE, lock_run
    from merit_core.errors import MeritError

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(victim)
    with pytest.raises(MeritError, match="symbolic link"):
        lock_run(run)
    assert victim.read_text() == "keep me\n"


# -- one timeline, a recoverable rewrite, disk full from any writer ------------------------------------
def _weights(ckpt: Path) -> bytes:
    return (ckpt / runs.WEIGHTS_NAME).read_bytes()


def test_resume_from_an_older_step_never_prunes_the_new_timeline(model_cfg, data_dir, tmp_path):
    """--resume-from step_1 with keep_checkpoints=2 on step_1..step_4: the new step_2..4 are kept (the
    highest steps are the new timeline's) and the abandoned step_2..4 are moved aside, named in a note."""
    run = tmp_path / "run"
    args = train_args(model_cfg, data_dir, run, "--steps", "4", "--set", "save_every=1", "--set", "eval_every=0")
    assert invoke(args).exit_code == 0
    old = {n: _weights(p) for n, p in runs.checkpoints(run)}
    result = invoke(
        ["train", "--resume-from", "step_1", "--out", str(run), "--lr", "1e-2", "--set", "keep_checkpoints=2"]
    )
    assert result.exit_code == 0, result.output
    note = [line for line in result.output.splitlines() if "abandoned timeline" in line]
    assert len(note) == 1 and "step_2, step_3, step_4" in note[0]
    assert [s for s, _ in runs.checkpoints(run)] == [3, 4]
    assert all(_weights(run / f"step_{s}") != old[s] for s in (3, 4))  # the new timeline's (another lr)
    (aside,) = [p for p in run.iterdir() if p.name.startswith("abandoned-after-step_1")]
    assert sorted(p.name for p in aside.iterdir()) == ["step_2", "step_3", "step_4"]
    assert all(_weights(aside / f"step_{s}") == old[s] for s in (2, 3, 4))
    result = invoke(["train", "--resume", "--out", str(run), "--steps", "5", "--lr", "1e-2"])
    assert result.exit_code == 0 and f"Resuming from {run / 'step_4'}" in " ".join(result.output.split())


_KILL_IN_REWRITE = """
import os, shutil, signal, sys
from pathlib import Path
from merit_core.checkpoint import runs

run, step = Path(sys.argv[1]), int(sys.argv[2])
final = runs.step_path(run, step)
tmp = runs.begin_staging(run, step)
for item in final.iterdir():
    shutil.copy(item, tmp / item.name)
real = runs.os.replace

def replace(src, dst):
    real(src, dst)
    if Path(dst).name.startswith(".tmp-old-"):
        os.kill(os.getpid(), signal.SIGKILL)  # between the two renames of the rewrite

runs.os.replace = replace
runs.publish_folder(tmp, final)
"""


def test_a_kill_between_the_renames_of_a_rewrite_loses_no_checkpoint(model_cfg, data_dir, tmp_path, reference):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = (run / "step_8" / "model.safetensors").read_bytes()
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_IN_REWRITE, str(run), "8"], env=subprocess_env(), capture_output=True, text=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not (run / "step_8").exists() and (run / ".tmp-old-step_8").is_dir()  # the window itself
    result = invoke(["train", "--resume", "--out", str(run), "--steps", "9"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "restored step_8 from .tmp-old-step_8" in text and f"Resuming from {run / 'step_8'}" in text
    assert (run / "step_8" / "model.safetensors").read_bytes() == before
    assert [s for s, _ in runs.checkpoints(run)] == [4, 8, 9]
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp-")]
    assert not list(run.glob(f"step_*/{runs.STAGING_MARKER}"))


@pytest.mark.parametrize(
    ("writer", "error"),
    [
        ("torch", "[enforce fail at inline_container.cc:664] . unexpected pos 1472 vs 1386"),
        (
            "safetensors",
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })',
        ),
    ],
)
def test_disk_full_is_recognised_whichever_library_reports_it(
    model_cfg, data_dir, tmp_path, monkeypatch, writer, error
):
    import merit_core.checkpoint.writer as checkpoint

    if writer == "torch":
        original = checkpoint.torch.save

        def full(obj, path, *args, **kwargs):
            if "step_4" in str(path):
                raise RuntimeError(error)
            return original(obj, path, *args, **kwargs)

        monkeypatch.setattr(checkpoint.torch, "save", full)
    else:
        import transformers.modeling_utils as modeling_utils
        from safetensors import SafetensorError

        original = modeling_utils.safe_save_file

        def full(tensors, filename, *args, **kwargs):
            if "step_4" in str(filename):
                raise SafetensorError(error)
            return original(tensors, filename, *args, **kwargs)

        monkeypatch.setattr(modeling_utils, "safe_save_file", full)
    out = tmp_path / "run"
    result = invoke(train_args(model_cfg, data_dir, out, "--steps", "6", "--set", "save_every=2"))
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"disk full while writing {out / 'step_4'}" in lines[0], lines
    assert [s for s, _ in runs.checkpoints(out)] == [2] and not any(p.name.startswith(".tmp-") for p in out.iterdir())


def test_the_lock_never_writes_through_a_link_and_release_removes_only_its_own_file(tmp_path):
    from merit_core.errors import UnsafePath
    from merit_core.file_locks import FileLock

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    os.symlink(victim, tmp_path / "lock")
    with pytest.raises(UnsafePath, match="symbolic link"):
        FileLock(tmp_path / "lock").acquire()
    assert victim.read_text() == "mine"
    lock = FileLock(tmp_path / "own")
    assert lock.acquire()
    os.replace(tmp_path / "lock", tmp_path / "own")  # someone swaps a link in while it is held
    lock.release()
    assert os.path.islink(tmp_path / "own") and victim.read_text() == "mine"  # not ours: left alone


def test_atomic_writes_never_go_through_a_link_planted_at_the_temp_name(tmp_path):
    """The temp name of an atomic write is guessable (.tmp-<name>.<pid>): a link planted there is refused,
    and neither its target nor the file being replaced is touched."""
    from merit_core.durable_writes import atomic_path, atomic_write
    from merit_core.errors import UnsafePath

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    target = tmp_path / "config.toml"
    target.write_text("old")
    os.symlink(victim, tmp_path / f".tmp-config.toml.{os.getpid()}")
    with pytest.raises(UnsafePath, match="symbolic link"):
        atomic_write(target, "new")
    with pytest.raises(UnsafePath, match="symbolic link"):
        with atomic_path(target) as tmp:
            tmp.write_text("new")
    assert victim.read_text() == "mine" and target.read_text() == "old"
    assert os.path.islink(tmp_path / f".tmp-config.toml.{os.getpid()}")  # not merit's: not removed either


def test_a_rewritten_log_never_goes_through_a_planted_link_or_fifo(tmp_path):
    """durable_writes.open_truncated (compare's per-run logs): a link or FIFO at the name is refused and the
    file it points at stays untouched; a regular file is emptied and rewritten."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine\n")
    link = tmp_path / "run.log"
    link.symlink_to(victim)
    with pytest.raises(errors.UnsafePath, match="symbolic link"):
        durable_writes.open_truncated(link)
    assert victim.read_text() == "mine\n"
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    with pytest.raises(errors.UnsafePath, match="FIFO"):
        durable_writes.open_truncated(fifo)  # opening it for writing would block until a reader came
    log = tmp_path / "plain.log"
    log.write_text("an old run's log, longer than the new one\n")
    with os.fdopen(durable_writes.open_truncated(log), "w") as fh:
        fh.write("new\n")
    assert log.read_text() == "new\n"
