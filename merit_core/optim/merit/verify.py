"""MERIT's backends against a float64 reference step on the user's device: the step rows of
`merit check` (:mod:`merit_core.check`) and its short form, :func:`verify_backend`.

Every MERIT backend that runs on the device takes one step of small groups of tensors from a
random state, and the result is compared with the same step computed by the readable reference
backend in float64 (:func:`step_rows`). The groups cover fp32 and bf16 parameters, 0-D to 3-D
tensors, a non-contiguous parameter (a backend that cannot take it must refuse it before any
state changes), zero-size tensors, a matrix taller and wider than one Triton tile (so the
maxima of several finalize chunks combine), a tensor of more than 2**31 elements when the device
has the memory, and the non-finite rule.

Tolerances are argued from the arithmetic, relative to the largest update of the tensor: the
step computes in fp32, so the update's own rounding is a few fp32 epsilons of it
(:data:`UPDATE_EPSILONS`, generous), and the new weight is rounded once to fp32 (half an ulp of
the largest new weight) and, for a bf16 parameter, once more to bf16 (one bf16 ulp: rounding to
nearest is half of one, and Triton's interpreter truncates). The moments are
within :data:`MOMENT_EPSILONS` fp32 epsilons of their largest entry. A kernel whose update is
off by a per cent is far outside the fp32 tolerance.

:func:`verify_backend` is the short form on the device's default fused backend (Triton on
CUDA, the C++ kernel on CPU), run once per machine, device, torch, Triton and merit kernel sources (the verdict is
cached in merit's cache folder); where the backend disagrees, MERIT's default choice uses
foreach instead and one warning says so. `merit train` calls it through :func:`guard_training`
before its first step. MERIT itself does not run it on first use: the first step may run inside
``torch.compile`` or a CUDA-graph capture, where a check that launches its own kernels and
reads their results on the host cannot run, and a library optimizer should not spend a check's
kernel compilations on a user's first step.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from merit_core import paths
from merit_core.errors import MeritError
from merit_core.optim.merit import cpu, functional
from merit_core.optim.merit.common import HYPER_KEYS, Hyper, state_dtype
from merit_core.optim.merit.optimizer import MERIT
from merit_core.optim.merit.reference import merit_reference

CHECK_VERSION = 1  # bump when the short form changes: cached verdicts are then redone
EPS32 = torch.finfo(torch.float32).eps
# The step's hyperparameters: MERIT's defaults (its constructor's) with every term switched on (decay,
# bias correction at step 5), |w| ~ 0.2 so that most |s*u| stay below the clip and the ratios decide.
_DEFAULTS = inspect.signature(MERIT).parameters
HYPER: dict[str, Any] = {
    **{key: _DEFAULTS[key].default for key in HYPER_KEYS},
    "lr": 0.02,
    "eps": 1e-8,
    "weight_decay": 0.1,
    "bias_correction": True,
}
NONFINITE_SHAPES = ((6, 5), (5,))  # the non-finite row's group
UPDATE_EPSILONS = 64  # the fp32 update's rounding bound, in fp32 epsilons of its largest entry (generous)
SKIPPED = "skipped"  # how the note of a row begins whose backend this machine lacks
MOMENT_EPSILONS = 8  # m and v: two roundings of a fused multiply-add per step, and the coefficient's


@dataclass(frozen=True)
class Row:
    """One line of the table; ``error`` and ``tolerance`` are relative (None where not numeric)."""

    check: str  # "step", "non-finite", "state_dict", "train"
    backend: str
    dtype: str
    shape: str
    error: float | None
    tolerance: float | None
    ok: bool
    note: str = ""

    @property
    def skipped(self) -> bool:
        """A row that did not run (its backend is not on this machine): neither ok nor failed."""
        return self.note.startswith(SKIPPED)


@dataclass
class CheckReport:
    """The rows and where they ran: the device and the versions of what computed them."""

    device: str
    versions: dict[str, str]
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def passed_line(self) -> str:
        """The last line of a check that passed: the rows that ran, and the skipped ones counted apart."""
        n_skipped = sum(r.skipped for r in self.rows)
        ran = len(self.rows) - n_skipped
        return f"all {ran} rows ok" if not n_skipped else f"{ran} rows ok, {n_skipped} skipped (not on this machine)"

    def failure(self) -> str | None:
        """The one line to report for the first failed row, or None when every row passed."""
        bad = next((r for r in self.rows if not r.ok), None)
        if bad is None:
            return None
        what = f"{bad.check} {bad.backend} {bad.dtype} {bad.shape}".strip()
        if bad.error is not None and bad.tolerance is not None:
            detail = f"max rel. error {bad.error:.3g} > tolerance {bad.tolerance:.3g}"
        else:
            detail = bad.note
        if bad.error is not None and bad.note:
            detail += f" ({bad.note})"
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        return f"merit check failed: {what}: {detail} [{versions}]"

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "device": self.device,
            "versions": self.versions,
            "seconds": round(self.seconds, 3),
            "failure": self.failure(),
            "rows": [asdict(r) for r in self.rows],
        }


def triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def backends_for(device: torch.device) -> dict[str, str | None]:
    """Every MERIT backend, with why it does not run on ``device`` (None where it does)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    out: dict[str, str | None] = {"reference": None, "foreach": None}
    if device.type == "cpu":
        out["cpu"] = cpu.unavailable([torch.zeros(1)], [torch.zeros(1)])
    else:
        out["cpu"] = "CPU tensors only"
    out["compile"] = None
    if triton_version() is None:
        out["triton"] = "triton is not installed"
    elif device.type == "cuda" or (device.type == "cpu" and interpreted):
        out["triton"] = None
    else:
        out["triton"] = "needs CUDA, or TRITON_INTERPRET=1 on CPU"
    return out


def fused_default(device: torch.device) -> str | None:
    """The fused backend MERIT's default choice takes on ``device``, which :func:`verify_backend`
    proves: ``"triton"`` on CUDA with triton installed, ``"cpu"`` (the C++ kernel) on CPU, else None."""
    if device.type == "cuda" and triton_version() is not None:
        return "triton"
    return "cpu" if device.type == "cpu" else None


# --- the step cases --------------------------------------------------------------------------


@dataclass
class Case:
    """A group of tensors in one dtype; ``views`` makes a parameter non-contiguous."""

    name: str
    shapes: list[tuple[int, ...]]
    transposed: tuple[int, ...] = ()  # indices of 2-D shapes given as the transpose of a contiguous tensor

    def label(self) -> str:
        return " ".join(
            ("x".join(map(str, s)) or "()") + ("(T)" if i in self.transposed else "") for i, s in enumerate(self.shapes)
        )


def _tile() -> tuple[int, int, int]:
    """(tile rows, tile columns, row tiles per finalize chunk) of the Triton backend's default tiling,
    from its plan module when triton can be imported (else its documented defaults)."""
    if triton_version() is None:
        return 32, 128, 64
    t = importlib.import_module("merit_core.optim.merit.triton.plan").DEFAULT_TILING  # imports triton: by name
    return t.rows, t.cols, t.fin_row_tiles


def cases(device: torch.device, quick: bool, backends: list[str]) -> list[tuple[Case, torch.dtype]]:
    """The step cases, each in the dtypes it runs in.

    The compile backend off CUDA takes one fp32 case of the non-finite row's shapes: each distinct
    shape compiles two graphs, and a cold Inductor cache on a small CPU spends most of a check there."""
    if backends == ["compile"] and device.type != "cuda":
        return [(Case("matrix", list(NONFINITE_SHAPES)), torch.float32)]
    out: list[tuple[Case, torch.dtype]] = []
    matrix = Case("matrix", [(67, 45), (45,), (3, 5, 4), ()])
    out += [(matrix, torch.float32), (matrix, torch.bfloat16)]
    out.append((Case("non-contiguous", [(45, 67), (9,)], transposed=(0,)), torch.float32))
    out.append((Case("zero-size", [(0, 7), (5, 0), (0,), (6, 4)]), torch.float32))
    interpreted_triton = "triton" in backends and device.type == "cpu"
    if not quick or device.type == "cuda":
        if not interpreted_triton or not quick:
            rows, cols, chunk = _tile()
            tall = Case("multi-chunk", [(rows * chunk + rows + 5, cols + 3)])  # 2 finalize chunks, 2 tile columns
            out.append((tall, torch.float32))
            if device.type == "cuda":
                out.append((tall, torch.bfloat16))
    return out


def _make(case: Case, dtype: torch.dtype, device: torch.device, seed: int) -> dict[str, list[Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    params, grads, ms, vs = [], [], [], []
    for i, shape in enumerate(case.shapes):
        store = tuple(reversed(shape)) if i in case.transposed else shape
        w = (0.2 * torch.randn(store, generator=gen)).to(dtype)
        g = torch.randn(store, generator=gen).to(dtype)
        m = 0.1 * torch.randn(store, generator=gen)
        v = 0.01 * torch.rand(store, generator=gen)
        if i in case.transposed:
            w, g, m, v = w.t(), g.t(), m.t(), v.t()
        params.append(w.to(device))
        grads.append(g.to(device))
        ms.append(m.to(device, state_dtype(w)))
        vs.append(v.to(device, state_dtype(w)))
    return {"params": params, "grads": grads, "exp_avgs": ms, "exp_avg_sqs": vs}


def _reference64(t: dict[str, list[Tensor]], step: float) -> dict[str, list[Tensor]]:
    ref = {k: [x.detach().to("cpu", torch.float64) for x in v] for k, v in t.items()}
    merit_reference(
        ref["params"], ref["grads"], ref["exp_avgs"], ref["exp_avg_sqs"],
        [torch.tensor(step + 1, dtype=torch.float64)] * len(ref["params"]), Hyper.of(**HYPER),
    )  # fmt: skip
    return ref


def _ulp(dtype: torch.dtype, x: float) -> float:
    """The spacing of ``dtype``'s numbers at magnitude ``x``."""
    if x == 0:
        return 0.0
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}[dtype]
    return 2.0 ** (math.floor(math.log2(x)) - mantissa)


def _compare(name: str, case: Case, dtype: torch.dtype, got: dict, old: dict, ref: dict) -> Row:
    """The worst tensor's update error (relative to its largest update) against its tolerance, and
    the moments against theirs."""
    worst: tuple[float, float, float] = (-1.0, 0.0, 0.0)  # (error / tolerance, error, tolerance)
    notes = []
    for n, (w, w0, wr) in enumerate(zip(got["params"], old["params"], ref["params"])):
        if w.shape != wr.shape:
            notes.append(f"tensor {n} changed shape")
            continue
        if not w.numel():
            continue
        w, w0 = w.detach().cpu().double(), w0.cpu().double()
        if not bool(torch.isfinite(w).all()):
            notes.append(f"tensor {n} not finite")
            continue
        top_update = float((wr - w0).abs().max())
        top_weight = float(wr.abs().max())
        rounding = 0.5 * _ulp(torch.float32, top_weight)  # the fp32 result, rounded to nearest
        if dtype != torch.float32:  # then to the parameter's dtype: one ulp (Triton's interpreter truncates)
            rounding += _ulp(dtype, top_weight)
        tol_abs = rounding
        tol_abs += UPDATE_EPSILONS * EPS32 * top_update
        err_abs = float((w - wr).abs().max())
        scale = top_update or 1.0
        if err_abs / tol_abs > worst[0]:
            worst = (err_abs / tol_abs, err_abs / scale, tol_abs / scale)
        for key in ("exp_avgs", "exp_avg_sqs"):
            x, xr = got[key][n].detach().cpu().double(), ref[key][n]
            top = float(xr.abs().max()) or 1.0
            if float((x - xr).abs().max()) > MOMENT_EPSILONS * EPS32 * top:
                notes.append(f"{key[:-1]} of tensor {n} off by {float((x - xr).abs().max()) / top:.2g}")
    error, tolerance = (worst[1], worst[2]) if worst[0] >= 0 else (None, None)
    ok = not notes and (worst[0] <= 1.0)
    return Row("step", name, _dtype_name(dtype), case.label(), error, tolerance, ok, "; ".join(notes))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _run(t: dict[str, list[Tensor]], steps: list[Tensor], name: str) -> None:
    """One step of backend ``name`` on the tensors of ``t`` through the functional core (its checks included)."""
    functional.merit(
        t["params"], t["grads"], t["exp_avgs"], t["exp_avg_sqs"], steps, **HYPER, backend=name
    )  # fmt: skip


def step_row(name: str, case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Row:
    """One step of ``case`` by backend ``name`` against the float64 reference step."""
    t = _make(case, dtype, device, seed)
    old = {k: [x.detach().clone() for x in v] for k, v in t.items()}
    ref = _reference64(t, 4.0)
    steps = [torch.tensor(4.0) for _ in t["params"]]
    try:
        _run(t, steps, name)
    except ValueError as exc:  # a backend that cannot take these tensors must say so with nothing changed
        unchanged = all(float(s) == 4.0 for s in steps) and all(
            torch.equal(a, b) for k in t for a, b in zip(t[k], old[k])
        )
        note = (
            f"refused, nothing changed: {str(exc).split(': ', 1)[-1]}"
            if unchanged
            else f"refused AFTER changing state: {exc}"
        )
        return Row("step", name, _dtype_name(dtype), case.label(), None, None, unchanged, note)
    if any(float(s) != 5.0 for s in steps):
        return Row("step", name, _dtype_name(dtype), case.label(), None, None, False, "step counters not advanced by 1")
    return _compare(name, case, dtype, t, old, ref)


def big_row(name: str, device: torch.device) -> Row:
    """A matrix of more than 2**31 elements (64-bit offsets) with identical rows, so that a two-row
    float64 reference step gives every row's answer; run where the device has the memory."""
    cols = 2048
    rows = (1 << 31) // cols + 64
    need = 5 * rows * cols * 4 + (2 << 30)  # w, g, m, v and a row comparison's temporaries, fp32
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else _host_available()
    shape = f"{rows}x{cols}"
    if free < need:
        note = f"not run: needs ~{need / 2**30:.0f} GiB free, {free / 2**30:.0f} GiB free"
        return Row("step", name, "float32", shape, None, None, True, note)
    gen = torch.Generator().manual_seed(1)
    w_row, g_row = 0.2 * torch.randn(1, cols, generator=gen), torch.randn(1, cols, generator=gen)
    m_row, v_row = 0.1 * torch.randn(1, cols, generator=gen), 0.01 * torch.rand(1, cols, generator=gen)
    small = {"params": [w_row.expand(2, cols)], "grads": [g_row.expand(2, cols)],
             "exp_avgs": [m_row.expand(2, cols)], "exp_avg_sqs": [v_row.expand(2, cols)]}  # fmt: skip
    ref = _reference64(small, 4.0)
    big = {k: [x[0][:1].to(device).expand(rows, cols).contiguous()] for k, x in small.items()}
    _run(big, [torch.tensor(4.0)], name)
    w = big["params"][0]
    picks = (0, rows // 2, (1 << 31) // cols - 1, (1 << 31) // cols, rows - 1)  # both sides of 2**31
    got = {"params": [w[list(picks)]], "exp_avgs": [big["exp_avgs"][0][list(picks)]],
           "exp_avg_sqs": [big["exp_avg_sqs"][0][list(picks)]]}  # fmt: skip
    want = {k: [ref[k][0][:1].expand(len(picks), cols)] for k in ("params", "exp_avgs", "exp_avg_sqs")}
    old = {"params": [w_row.expand(len(picks), cols)]}
    row = _compare(name, Case("big", [(rows, cols)]), torch.float32, got, old, want)
    same = bool((w == w[:1]).all())
    del big, w
    return row if same else Row("step", name, "float32", shape, row.error, row.tolerance, False, "rows differ")


def _host_available() -> int:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def nonfinite_row(name: str, device: torch.device) -> Row:
    """The non-finite rule: a NaN gradient entry makes its parameter NaN everywhere, its moments NaN
    exactly there, and leaves the other parameter's step exact."""
    case = Case("non-finite", list(NONFINITE_SHAPES))
    t = _make(case, torch.float32, device, 3)
    t["grads"][0][2, 3] = torch.nan
    clean = {k: [v[1]] for k, v in t.items()}
    ref = _reference64(clean, 4.0)
    old = [t["params"][1].detach().clone()]
    _run(t, [torch.tensor(4.0), torch.tensor(4.0)], name)
    problems = []
    if not bool(t["params"][0].isnan().all()):
        problems.append("poisoned tensor not NaN everywhere")
    for key in ("exp_avgs", "exp_avg_sqs"):
        bad = ~torch.isfinite(t[key][0])
        if int(bad.sum()) != 1 or not bool(bad[2, 3]):
            problems.append(f"{key[:-1]} not non-finite exactly at the NaN gradient")
    other = _compare(name, case, torch.float32, {k: [v[1]] for k, v in t.items()}, {"params": old}, ref)
    if not other.ok:
        problems.append("the other tensor's step is off")
    return Row(
        "non-finite", name, "float32", case.label(), other.error, other.tolerance, not problems, "; ".join(problems)
    )


def _guarded(check: str, backend: str, run: Callable[[], Row]) -> Row:
    """A row's result, or a failed row carrying the first line of the exception it raised."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a broken backend is what the check reports
        line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Row(check, backend, "", "", None, None, False, f"{type(exc).__name__}: {line}"[:300])


def step_rows(
    device: torch.device,
    *,
    quick: bool = False,
    backends: list[str] | None = None,
    add: Callable[[Row], None],
) -> None:
    """The step and non-finite rows of ``backends`` (default: every backend; those that do not run
    on ``device`` as skipped rows with the reason), handed to ``add`` one by one.

    ``quick``: the short form (no tensor past 2**31 elements; off CUDA no multi-chunk case, and
    no compile backend unless asked for: compiling every shape is most of a CPU check's time)."""
    available = backends_for(device)
    unknown = [b for b in (backends or []) if b not in available]
    if unknown:
        raise ValueError(f"merit check: unknown backend {', '.join(unknown)}; one of {', '.join(available)}")
    chosen = backends or list(available)
    run = [b for b in chosen if available[b] is None]
    if quick and device.type != "cuda" and backends is None:
        run = [b for b in run if b != "compile"]
    for b in chosen:
        if available[b] is not None:
            add(Row("step", b, "", "", None, None, True, f"{SKIPPED}: {available[b]}"))
    for b in run:
        for case, dtype in cases(device, quick, [b]):
            add(_guarded("step", b, partial(step_row, b, case, dtype, device)))
        if not quick and b in ("triton", "cpu"):
            add(_guarded("step", b, partial(big_row, b, device)))
        add(_guarded("non-finite", b, partial(nonfinite_row, b, device)))


# --- the short form, once per machine, device and versions -------------------------------------


def _sources_digest() -> str:
    """A digest of merit's MERIT sources (the backends and kernels): a changed kernel is checked anew."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp") and p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _device_key(device: torch.device) -> list[Any]:
    """What a verdict depends on: the machine, the device, the driver and the versions that compute MERIT."""
    key: list[Any] = [CHECK_VERSION, platform.node(), platform.machine(), str(device), torch.__version__]
    key += [triton_version(), _sources_digest()]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        key += [props.name, props.major, props.minor, torch.version.cuda]
        with contextlib.suppress(Exception):
            key.append(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
    return key


def _cache_file(device: torch.device, backend: str) -> Path:
    key = json.dumps([*_device_key(device), backend], default=str)
    return paths.cache_dir("checks") / f"{backend}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


def _save(path: Path, verdict: dict[str, Any]) -> None:
    """The verdict written whole or not at all (a temp file in the folder, fsynced, renamed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(verdict, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class _Verdict(Exception):
    """Raised by verify_backend's row collector at the first failed row."""


def verify_backend(device: str | torch.device, backend: str | None = None) -> tuple[str | None, str | None]:
    """(the backend MERIT's default takes on ``device``, a warning line or None).

    Runs :func:`step_rows`' short form on ``backend`` (default: :func:`fused_default`; nothing to
    do where there is none or it does not run here) once per machine, device and versions, the verdict
    cached in merit's cache folder. Where the backend disagrees with the reference (or raises),
    MERIT's default choice uses foreach instead for the rest of the process and the warning, one
    line, is also issued as a ``RuntimeWarning``; where it agrees, a previous replacement is undone."""
    dev = torch.device(device)
    name = backend or fused_default(dev)
    if name is None or backends_for(dev).get(name, "unknown") is not None:
        return None, None  # nothing fused to prove here (the default does not take it either)
    try:
        path: Path | None = _cache_file(dev, name)
    except (OSError, MeritError):  # no usable cache folder: check in every process
        path = None
    verdict = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        verdict = json.loads(path.read_text())  # type: ignore[union-attr]
        if not isinstance(verdict, dict) or not isinstance(verdict.get("ok"), bool):
            verdict = None
    if verdict is None:
        report = CheckReport(device=str(dev), versions={"torch": torch.__version__, "triton": str(triton_version())})

        def add(row: Row) -> None:
            report.rows.append(row)
            if not row.ok:
                raise _Verdict  # one failed row decides

        with contextlib.suppress(_Verdict):
            step_rows(dev, quick=True, backends=[name], add=add)
        verdict = {"ok": report.ok, "line": report.failure()}
        if path is not None:
            with contextlib.suppress(OSError):
                _save(path, verdict)
    if verdict["ok"]:
        functional.replace_default(name, None)
        return name, None
    functional.replace_default(name, "foreach")
    line = str(verdict.get("line") or "").removeprefix("merit check failed: ")
    warning = (
        f"MERIT: the {name} backend disagrees with the float64 reference step on this device ({line}); "
        "MERIT uses foreach instead (`merit check` shows the table)"
    )
    warnings.warn(warning, RuntimeWarning, stacklevel=2)
    return "foreach", warning


def guard_training(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """What `merit train` calls before its first step: :func:`verify_backend` on ``device`` when
    ``optimizer`` has a MERIT param group that leaves the backend to the default choice; the
    warning line or None."""
    if not any(g.get("implementation", "") is None and "elementwise" in g for g in optimizer.param_groups):
        return None
    return verify_backend(device)[1]
