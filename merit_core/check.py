"""`merit check`: does MERIT compute the paper's algorithm on this device, with this torch and Triton?

The table: every MERIT backend that runs on the device against a float64 reference step
(:func:`merit_core.optim.merit.verify.step_rows`: fp32 and bf16, non-contiguous and zero-size
tensors, a matrix of several Triton tiles and finalize chunks, a tensor past 2**31 elements
when memory allows, the non-finite rule), then a state_dict round trip through
``torch.load(weights_only=True)`` and one training step of a tiny GPT-2 under the default
``compile=auto``. What each row means: docs/CHECK.md.

``python -m merit_core.check [--quick] [--json] [--device D] [--backend B]`` prints it as plain
text; `merit check` renders it with rich. Exit status 1 on any failed row, with the one line to
report; 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from merit_core.devices import resolve_device
from merit_core.errors import MeritError
from merit_core.optim.merit import MERIT, functional
from merit_core.optim.merit.verify import CheckReport, Row, _guarded, step_rows, triton_version
from merit_core.optim.registry import build_optimizer
from merit_core.train.compiling import resolve_compile
from merit_core.train.hardware import cpu_name
from merit_core.version import __version__


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
    if device.type == "cpu":
        return f"{cpu_name()} ({os.cpu_count()} cores)"
    return str(device)


def environment(device: torch.device) -> tuple[str, dict[str, str]]:
    """(the device's name, the versions that compute MERIT there: driver, torch, triton, merit)."""
    versions: dict[str, str] = {}
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            driver = torch._C._cuda_getDriverVersion()  # type: ignore[attr-defined]
            versions["CUDA driver"] = f"{driver // 1000}.{driver % 1000 // 10}"
        versions["CUDA"] = str(torch.version.cuda)
    versions["torch"] = torch.__version__
    versions["triton"] = triton_version() or "not installed"
    versions["merit"] = __version__
    return _device_name(device), versions


def state_dict_row(device: torch.device) -> Row:
    """MERIT (default backend) state through torch.save / torch.load(weights_only=True): the next
    step of the loaded optimizer equals the original's bit for bit."""
    gen = torch.Generator().manual_seed(4)
    shapes = [(8, 6), (6,)]
    params = [torch.nn.Parameter((0.2 * torch.randn(s, generator=gen)).to(device)) for s in shapes]
    opt = MERIT(params, lr=0.02, bias_correction=True)
    grads = [[torch.randn(s, generator=gen).to(device) for s in shapes] for _ in range(3)]
    for g in grads[:2]:
        for p, x in zip(params, g):
            p.grad = x
        opt.step()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = MERIT(clones, lr=0.5)  # the hyperparameters come from the state dict
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    opt2.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for ps, o in ((params, opt), (clones, opt2)):
        for p, x in zip(ps, grads[2]):
            p.grad = x
        o.step()
    same = all(torch.equal(p, q) for p, q in zip(params, clones))
    tensors: list[torch.Tensor] = list(params)
    name = functional.choose(None, tensors, [p.grad for p in params if p.grad is not None])[0]
    note = "" if same else "the loaded optimizer's next step differs"
    return Row("state_dict", name, "float32", " ".join("x".join(map(str, s)) for s in shapes), None, None, same, note)


def train_row(device: torch.device) -> Row:
    """One training step of a tiny GPT-2 with MERIT under the default ``compile=auto``."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model: torch.nn.Module = GPT2LMHeadModel(config)
    model.to(device)
    compiled = resolve_compile("auto", device)
    forward = torch.compile(model) if compiled else model
    optimizer = build_optimizer("merit", model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    tokens = torch.randint(0, 64, (2, 16), device=device)
    loss = forward(input_ids=tokens, labels=tokens).loss
    loss.backward()
    loss = loss.detach()
    optimizer.step()
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    moved = sum(not torch.equal(p, q) for p, q in zip(model.parameters(), before))
    groups = [p for g in optimizer.param_groups for p in g["params"]]
    name = functional.choose(None, groups, [p.grad for p in groups if p.grad is not None])[0]
    ok = finite and moved == len(before)
    note = f"compile={'on' if compiled else 'off'} (auto), loss {loss.item():.3f}"
    if not ok:
        note += f"; {moved} of {len(before)} tensors moved, finite: {finite}"
    return Row("train", name, "float32", "gpt2 1 layer", None, None, ok, note)


def run_check(
    device: str | torch.device | None = None,
    *,
    quick: bool = False,
    backends: list[str] | None = None,
    progress: Callable[[Row], None] | None = None,
) -> CheckReport:
    """The table for ``device`` (default: CUDA when available, else CPU).

    ``quick``: the short form of :func:`~merit_core.optim.merit.verify.step_rows`, without the
    state_dict and training rows. ``backends``: only these. ``progress`` sees each row as it is made.
    Raises ValueError for an unknown backend or device."""
    start = time.perf_counter()
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, versions = environment(dev)
    report = CheckReport(device=name, versions=versions)

    def add(row: Row) -> None:
        report.rows.append(row)
        if progress is not None:
            progress(row)

    step_rows(dev, quick=quick, backends=backends, add=add)
    if not quick:
        add(_guarded("state_dict", "default", lambda: state_dict_row(dev)))
        add(_guarded("train", "default", lambda: train_row(dev)))
    report.seconds = time.perf_counter() - start
    return report


# --- python -m merit_core.check ---------------------------------------------------------------


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def table_lines(report: CheckReport) -> Iterator[str]:
    """The report as plain text: a header, one aligned line per row, the verdict."""
    yield f"device: {report.device}"
    yield "versions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items())
    head = ("check", "backend", "dtype", "shape", "max rel. error", "tolerance", "ok", "note")
    cells = [head] + [
        (
            r.check,
            r.backend,
            r.dtype,
            r.shape,
            _cell(r.error),
            _cell(r.tolerance),
            ("skipped" if r.skipped else "ok") if r.ok else "FAIL",
            r.note,
        )
        for r in report.rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    for c in cells:
        yield "  ".join(x.ljust(w) for x, w in zip(c, widths)) + "  " + c[-1]
    yield report.failure() or f"{report.passed_line()} in {report.seconds:.1f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m merit_core.check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="auto", help="auto (default: CUDA when visible, else CPU), cpu, cuda or cuda:N"
    )
    parser.add_argument("--quick", action="store_true", help="the short form (what merit train runs on CUDA)")
    parser.add_argument("--backend", action="append", help="only this backend (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        report = run_check(resolve_device(args.device), quick=args.quick, backends=args.backend)
    except (ValueError, MeritError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for line in table_lines(report):
            print(line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
