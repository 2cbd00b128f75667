"""`merit check` and its short form: the table passes on this CPU, and a planted wrong kernel (its
update scaled by 1.01) fails it with one line, and makes `merit train` fall back to foreach with
one warning.

The C++ kernel is the CPU's fused default, so its rows run here; the Triton kernel's run in a child
pytest under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported, see
tests/interpreted.py). The full `merit check` (compile backend, state_dict and training rows)
takes tens of seconds on a 2-core CPU, so the suite runs the short form; its wall time is in
benchmarks/README.md.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from merit_core import check, paths
from merit_core.optim.merit import MERIT, cpu, functional, verify
from merit_core.optim.merit.cpu import merit_cpu
from tests.cli_runs import invoke, train_args

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SCALE = 1.01  # the planted kernel's update, relative to the right one


def _wrong(real):
    """A backend step whose update is ``SCALE`` times the real backend's."""

    def step(params, grads, exp_avgs, exp_avg_sqs, state_steps, h, **kw):
        before = [p.detach().clone() for p in params]
        real(params, grads, exp_avgs, exp_avg_sqs, state_steps, h, **kw)
        for p, b in zip(params, before):
            p.copy_(b + SCALE * (p - b))

    return step


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """A cache folder of the test's own (no verdict of another test or of the user) and no
    replacement of a default backend left behind."""
    kernels = os.environ.get("MERIT_KERNEL_CACHE") or str(paths.cache_dir("kernels"))  # the session's C++ build
    monkeypatch.setenv("MERIT_KERNEL_CACHE", kernels)
    monkeypatch.setenv("MERIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(functional, "_VERIFIED", {})


@pytest.fixture
def wrong_cpu_kernel(monkeypatch):
    monkeypatch.setitem(functional.BACKENDS, "cpu", functional.Backend("cpu", _wrong(merit_cpu), functional._cpu))


if not INTERPRETED:

    def test_the_short_check_passes_on_this_cpu_and_names_every_backend():
        report = check.run_check("cpu", quick=True)
        assert report.ok, report.failure()
        ran = {r.backend for r in report.rows if not r.note.startswith("skipped")}
        assert {"reference", "foreach", "cpu"} <= ran
        labels = {(r.backend, r.dtype, r.shape) for r in report.rows}
        assert ("cpu", "bfloat16", "67x45 45 3x5x4 ()") in labels
        assert ("cpu", "float32", "0x7 5x0 0 6x4") in labels and ("cpu", "float32", "45x67(T) 9") in labels
        steps = [r for r in report.rows if r.check == "step" and r.error is not None]
        assert steps and all(r.error <= r.tolerance for r in steps)
        assert {r.check for r in report.rows} == {"step", "non-finite"}  # the short form
        if cpu.kernel_loaded():
            assert not any(r.backend == "cpu" and r.note.startswith("skipped") for r in report.rows)

    def test_merit_check_prints_json_and_exits_zero():
        result = invoke(["check", "--quick", "--device", "cpu", "--json", "--backend", "reference"])
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        assert data["ok"] is True and data["failure"] is None and data["versions"]["torch"] == torch.__version__
        assert {r["backend"] for r in data["rows"]} == {"reference"}

    def test_an_unknown_backend_is_one_line_and_exit_2():
        result = invoke(["check", "--quick", "--device", "cpu", "--backend", "cuda-fast"])
        assert result.exit_code == 2 and "unknown backend cuda-fast" in result.output

    def test_a_wrong_cpu_kernel_fails_merit_check_with_one_line(wrong_cpu_kernel, capsys):
        result = invoke(["check", "--quick", "--device", "cpu", "--backend", "cpu"])
        assert result.exit_code == 1
        lines = [line for line in result.output.splitlines() if line.startswith("merit check failed")]
        assert len(lines) == 1 and lines[0].startswith("merit check failed: step cpu float32 67x45"), result.output
        assert check.main(["--quick", "--device", "cpu", "--backend", "cpu"]) == 1
        assert capsys.readouterr().out.splitlines()[-1].startswith("merit check failed: step cpu float32")

    def test_verify_backend_caches_its_verdict_and_only_the_default_changes(wrong_cpu_kernel, monkeypatch):
        with pytest.warns(RuntimeWarning, match=r"^MERIT: the cpu backend disagrees .*; MERIT uses foreach") as got:
            name, warning = verify.verify_backend("cpu")
        assert name == "foreach" and len(got) == 1 and "\n" not in warning
        monkeypatch.setattr(verify, "step_rows", lambda *a, **k: pytest.fail("the cached verdict was not used"))
        with pytest.warns(RuntimeWarning, match="disagrees"):
            assert verify.verify_backend("cpu")[0] == "foreach"
        params = [torch.nn.Parameter(torch.randn(4, 3))]
        params[0].grad = torch.randn(4, 3)
        assert functional.choose(None, params, [params[0].grad])[0] == "foreach"
        assert functional.choose("cpu", params, [params[0].grad])[0] == "cpu"  # explicit still runs it

    def test_a_right_kernel_is_verified_once_and_kept(monkeypatch):
        calls = []
        real = verify.step_rows
        monkeypatch.setattr(verify, "step_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            assert verify.verify_backend("cpu") == ("cpu", None)
            assert verify.verify_backend("cpu") == ("cpu", None)
        assert calls == [1] and functional._VERIFIED == {}
        opt = MERIT([torch.nn.Parameter(torch.randn(2, 2))], implementation="foreach")
        assert verify.guard_training(opt, torch.device("cpu")) is None  # an explicit backend: nothing to prove
        assert calls == [1]

    def test_merit_train_falls_back_to_foreach_with_one_warning(wrong_cpu_kernel, model_cfg, data_dir, tmp_path):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = invoke(train_args(model_cfg, data_dir, tmp_path / "run", "--steps", "2", "--device", "cpu"))
        assert result.exit_code == 0, result.output
        ours = [w for w in caught if "backend disagrees" in str(w.message)]
        assert len(ours) == 1 and str(ours[0].message).startswith("MERIT: the cpu backend disagrees")
        assert functional._VERIFIED == {"cpu": "foreach"}

    @pytest.mark.slow
    def test_the_triton_rows_pass_and_a_wrong_triton_kernel_is_caught_under_the_interpreter():
        pytest.importorskip("triton", reason="the triton rows need triton (pip install triton)")
        pytest.importorskip("numpy", reason="Triton's interpreter needs numpy")
        from tests.interpreted import run_under_interpreter

        summary, report = run_under_interpreter(__file__)
        assert "2 passed" in summary, report

else:  # the child, TRITON_INTERPRET=1: the triton backend's kernels run interpreted on CPU tensors

    def test_the_short_check_of_triton_passes():
        report = check.run_check("cpu", quick=True, backends=["triton"])
        assert report.ok, report.failure()
        refused = [r for r in report.rows if r.note.startswith("refused, nothing changed")]
        assert [r.shape for r in refused] == ["45x67(T) 9"]  # the non-contiguous case, before any state changed
        assert sum(r.error is not None for r in report.rows) >= 4

    def test_a_wrong_triton_kernel_fails_the_short_check_and_the_default_falls_back(monkeypatch):
        real = functional.BACKENDS["triton"].load()
        monkeypatch.setitem(functional._LOADED, "triton", _wrong(real))
        with pytest.warns(RuntimeWarning, match="^MERIT: the triton backend disagrees"):
            assert verify.verify_backend("cpu", backend="triton")[0] == "foreach"
        assert functional._VERIFIED == {"triton": "foreach"}
