"""The CPU MERIT backend: a fused two-pass C++/OpenMP kernel, built once per machine and cached,
called through one ``torch.library.custom_op`` per param group.

The kernel (``csrc/merit_cpu.cpp``, shipped as package data) is plain C++ without torch headers,
so a cold build is quick, where ``torch.utils.cpp_extension`` would compile all of
``torch/extension.h`` (build times are in benchmarks/README.md). It is compiled with the system C++ compiler (``$CXX``, else
``g++``/``c++``) into a user cache directory (``$MERIT_KERNEL_CACHE``, else the ``kernels``
folder of merit's cache: ``$MERIT_CACHE_DIR``, ``$XDG_CACHE_HOME/merit`` or ``~/.cache/merit``),
keyed by a hash of the source, the compiler and the CPU, and loaded with :mod:`ctypes`. If it
cannot be built, :func:`load_kernel` returns ``None`` and says why once (``RuntimeWarning``);
the default backend choice then falls back to the foreach backend, and an explicit
``implementation="cpu"`` raises ``ValueError``.

Per parameter the kernel makes two passes over memory (see the C++ file); extra memory is
O(rows + threads * columns), nothing of the parameter's size. Any number of dims (3-D+ as one
matrix per trailing index), fp32/fp64/bf16 and fp16 (where the compiler has ``_Float16``);
non-contiguous tensors are updated through contiguous copies.

The whole group's update is one custom op, ``merit::cpu_step``, so ``torch.compile`` of a
training step that includes ``opt.step()`` sees one opaque call per param group: no graph break
per parameter, no guard per ctypes call. The sharded backend uses the two passes separately
(:func:`pass1`, :func:`pass2`) around its all-reduce.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from merit_core import paths
from merit_core.optim.merit.common import Hyper, is_plain, state_dtype

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300  # far above a normal cold build; this only bounds a pathological compiler.
FLAG_MAXIMIZE, FLAG_L2, FLAG_ELEMENTWISE, FLAG_BOUND = 1, 2, 4, 8
PARALLEL_MIN_NUMEL = 1 << 15  # below this, OpenMP start-up costs more than it saves.

_CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
if platform.machine() in ("x86_64", "AMD64"):
    _CFLAGS.append("-mprefer-vector-width=512")  # gcc defaults to 256-bit vectors on AVX-512 CPUs
_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16"}
_lock = threading.Lock()
_state: dict = {"loaded": False, "lib": None, "error": None, "path": None, "build_s": None}


def source() -> str:
    """The kernel's C++ source (package data)."""
    return resources.files("merit_core.optim.merit").joinpath("csrc/merit_cpu.cpp").read_text()


def cache_dir() -> Path:
    """Where built kernels are kept: $MERIT_KERNEL_CACHE, else merit's cache folder + /kernels."""
    if os.environ.get("MERIT_KERNEL_CACHE"):
        return Path(os.environ["MERIT_KERNEL_CACHE"])
    return paths.cache_dir("kernels")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_signature() -> str:
    # -march=native code must not be reused on a CPU with fewer instruction-set extensions.
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build(compiler: str) -> Path:
    code = source()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([code, version, " ".join(_CFLAGS), _cpu_signature()]).encode())
    out = cache_dir() / f"merit_cpu_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "merit_cpu.cpp"
        src.write_text(code)
        lib = Path(tmp) / out.name
        proc = subprocess.run(
            [compiler, *_CFLAGS, str(src), "-o", str(lib)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
        )
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"{Path(compiler).name} exited with {proc.returncode}: {last}")
        os.replace(lib, out)  # atomic: concurrent builders never load a half-written library
    _state["build_s"] = time.perf_counter() - t0
    log.info("built the MERIT CPU kernel in %.1f s: %s", _state["build_s"], out)
    return out


def _bind(lib: ctypes.CDLL) -> dict:
    """{dtype: (step, pass1, pass2)} for the dtypes this build has (fp16 needs _Float16)."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    signatures = {
        "step": [ptr] * 4 + [i64] * 3 + [ptr, i32, i32],
        "pass1": [ptr] * 4 + [i64] * 3 + [ptr, i32, i32] + [ptr] * 3,
        "pass2": [ptr] * 3 + [i64] * 3 + [ptr, i32, i32] + [ptr] * 3,
    }
    funcs = {}
    for dtype, suffix in _SUFFIX.items():
        entry = []
        for kind, argtypes in signatures.items():
            fn = getattr(lib, f"merit_{kind}_{suffix}", None)
            if fn is None:
                break
            fn.restype, fn.argtypes = ctypes.c_int, argtypes
            entry.append(fn)
        else:
            funcs[dtype] = tuple(entry)
    return funcs


def load_kernel() -> dict | None:
    """The kernel's entry points by parameter dtype, building it on first use; None (and one
    warning) if that is impossible. (MERIT calls it from ``_init_group``, which torch.compile runs
    eagerly, so a compiled step never traces a build.)"""
    if _state["loaded"]:
        return _state["lib"]
    with _lock:
        if _state["loaded"]:
            return _state["lib"]
        try:
            compiler = _compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler found (set $CXX or install g++)")
            path = _build(compiler)
            _state.update(lib=_bind(ctypes.CDLL(str(path))), path=path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _state["error"] = str(e)
            warnings.warn(
                f"MERIT: the C++ CPU kernel is unavailable ({e}); using the foreach backend instead",
                RuntimeWarning,
                stacklevel=3,
            )
        _state["loaded"] = True
        return _state["lib"]


def _loaded_kernel() -> dict:
    """The kernel's entry points, for the callers that run only once :func:`unavailable` said yes."""
    lib = load_kernel()
    if lib is None:
        raise RuntimeError(f"MERIT: the C++ CPU kernel is unavailable ({_state['error']})")
    return lib


def kernel_loaded() -> bool:
    """Whether :func:`load_kernel` has run (successfully or not) in this process."""
    return _state["loaded"]


def kernel_info() -> dict:
    """What happened when the kernel was loaded: path, build seconds (None if cached), error."""
    return {k: _state[k] for k in ("path", "build_s", "error")} | {"available": _state["lib"] is not None}


def unavailable(params: list[Tensor], grads: list[Tensor]) -> str | None:
    """Why this backend cannot take these tensors, or None if it can."""
    if not all(is_plain(p) and type(g) is torch.Tensor for p, g in zip(params, grads)):
        return "it takes plain CPU tensors, not tensor subclasses"
    devices = {p.device.type for p in params} | {g.device.type for g in grads}
    if devices != {"cpu"}:
        return f"it runs on CPU tensors only, got tensors on {', '.join(sorted(devices))}"
    lib = _state["lib"] if _state["loaded"] else load_kernel()
    if lib is None:
        return f"the C++ CPU kernel is unavailable: {_state['error']}"
    missing = {p.dtype for p in params} - set(lib)
    if missing:
        names = ", ".join(sorted(str(d) for d in missing))
        return f"this build of the C++ kernel has no {names} (its compiler lacks _Float16)"
    return None


def _flags(h: Hyper, p: Tensor) -> int:
    return (
        (FLAG_MAXIMIZE if h.maximize else 0)
        | (FLAG_L2 if h.norm == "l2" else 0)
        | (FLAG_ELEMENTWISE if h.elementwise and p.dim() >= 2 else 0)
        | (FLAG_BOUND if h.weight_bound else 0)
    )


def _dims(p: Tensor) -> tuple[int, int, int]:
    """[rows, columns, trailing] of the kernel's view of p."""
    if p.dim() < 2:
        return 1, p.numel(), 1
    return p.shape[0], p.shape[1], math.prod(p.shape[2:])


def _threads(p: Tensor) -> int:
    return torch.get_num_threads() if p.numel() >= PARALLEL_MIN_NUMEL else 1


def _check(rc: int, p: Tensor) -> None:
    if rc != 0:
        raise MemoryError(f"MERIT CPU kernel could not allocate its row/column buffers for {tuple(p.shape)}")


class _Contiguous:
    """Contiguous stand-ins for p, m, v (copies where needed), written back on exit."""

    def __init__(self, *tensors: Tensor):
        self.originals = tensors
        self.tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]

    def __enter__(self) -> list[Tensor]:
        return self.tensors

    def __exit__(self, *exc) -> None:
        for orig, t in zip(self.originals, self.tensors):
            if t is not orig:
                orig.copy_(t)


def _hyper_array(h: Hyper, step: Tensor):
    return (ctypes.c_double * 8)(*h.kernel_vector(step))


def _step_one(lib: dict, p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, h: Hyper) -> None:
    g = g.contiguous()
    with _Contiguous(p, m, v) as (p_, m_, v_):
        hp = _hyper_array(h, step)
        rc = lib[p.dtype][0](
            g.data_ptr(), p_.data_ptr(), m_.data_ptr(), v_.data_ptr(), *_dims(p), hp, _flags(h, p), _threads(p)
        )
        _check(rc, p)


def stats_shapes(p: Tensor, h: Hyper) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Shapes of pass 1's row and column statistics ([2, R*T] and [2, C*T]); None without them."""
    if not (h.elementwise and p.dim() >= 2):
        return None
    r, c, t = _dims(p)
    return (2, r * t), (2, c * t)


def pass1(p: Tensor, g: Tensor, m: Tensor, v: Tensor, step: Tensor, h: Hyper, rows, cols, total: Tensor) -> None:
    """Moments in place, and raw statistics (max|x|, or sum x*x for l2) of |w| and |u| into float64
    tensors: rows [2, R*T], cols [2, C*T] (None without element-wise ratios), total [2]."""
    g = g.contiguous()
    with _Contiguous(p, m, v) as (p_, m_, v_):
        _run_pass(1, (g.data_ptr(), p_.data_ptr(), m_.data_ptr(), v_.data_ptr()), p, step, h, rows, cols, total)


def pass2(p: Tensor, m: Tensor, v: Tensor, step: Tensor, h: Hyper, rows, cols, total: Tensor) -> None:
    """The scaled, clipped update of p from completed pass-1 statistics."""
    with _Contiguous(p, m, v) as (p_, m_, v_):
        _run_pass(2, (p_.data_ptr(), m_.data_ptr(), v_.data_ptr()), p, step, h, rows, cols, total)


def _run_pass(which: int, pointers: tuple[int, ...], p: Tensor, step: Tensor, h: Hyper, rows, cols, total) -> None:
    """Call the kernel's pass `which` (1 or 2) for p's dtype: its tensors' pointers, then the shape,
    hyperparameters, flags, threads and the statistics buffers both passes share."""
    stats = (None if rows is None else rows.data_ptr(), None if cols is None else cols.data_ptr(), total.data_ptr())
    rc = _loaded_kernel()[p.dtype][which](
        *pointers, *_dims(p), _hyper_array(h, step), _flags(h, p), _threads(p), *stats
    )
    _check(rc, p)


@torch.library.custom_op("merit::cpu_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs"), device_types="cpu")
def _cpu_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    lr: Tensor,
    numbers: list[float],
    norm: str,
    switches: list[bool],
) -> None:
    h = Hyper.from_op(float(lr), numbers, norm, switches)  # lr: a CPU scalar, no sync
    lib = _loaded_kernel()
    for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
        if p.numel():
            _step_one(lib, p, g, m, v, step, h)


@_cpu_step.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr, numbers, norm, switches) -> None:
    return None


def merit_cpu(params, grads, exp_avgs, exp_avg_sqs, state_steps, h: Hyper) -> None:
    """The CPU backend: one ``merit::cpu_step`` custom op for the group (the record travels as
    :meth:`Hyper.to_op`'s arguments, a custom op taking only primitive types).

    The caller checks :func:`unavailable` first (the functional core does)."""
    for p, m in zip(params, exp_avgs):
        if m.dtype != state_dtype(p) or m.shape != p.shape:
            raise ValueError(
                f"MERIT cpu backend: moments of a {p.dtype} {tuple(p.shape)} parameter are {m.dtype} {tuple(m.shape)}"
            )
    if isinstance(h.lr, Tensor):
        lr_t = h.lr.detach().to(device="cpu", dtype=torch.float64)
    else:
        lr_t = torch.tensor(float(h.lr), dtype=torch.float64)
    torch.ops.merit.cpu_step(params, grads, exp_avgs, exp_avg_sqs, state_steps, lr_t, *h.to_op())
