"""A fused two-pass C++/OpenMP MERIT step for CPU tensors, built once per machine and cached.

The kernel is plain C++ (no torch headers), so a cold build takes about a second instead of the
~30 s that `torch.utils.cpp_extension` needs for `torch/extension.h`. It is compiled with the
system C++ compiler (``$CXX``, else ``g++``/``c++``) into a user cache directory
(``$MERIT_KERNEL_CACHE``, else the ``kernels`` folder of merit's cache: ``$MERIT_CACHE_DIR``,
``$XDG_CACHE_HOME/merit`` or ``~/.cache/merit``), keyed by a hash of the source, the compiler and the CPU, and
loaded with :mod:`ctypes`. If it cannot be built, :func:`load_kernel` returns ``None`` and says
why once (``RuntimeWarning``); MERIT then uses its pure-torch path.

Per parameter the kernel makes two passes over memory:

1. update ``m`` and ``v`` in place and reduce the row, column and global norms (max or l2) of
   ``|w|`` and ``|u|`` where ``u = m / (sqrt(v) + eps) + wd * w``, without storing ``u``;
2. recompute ``u`` from ``m``, ``v``, ``w``, scale it by the element-wise ratio, clip it, and
   write ``w`` (rounded once to the parameter's dtype).

Extra memory is O(rows + threads * cols); nothing of the parameter's size is allocated.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

from merit_core import paths

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 300  # a cold build takes ~1-3 s; this only bounds a pathological compiler.
FLAG_MAXIMIZE, FLAG_L2, FLAG_ELEMENTWISE, FLAG_BOUND = 1, 2, 4, 8
PARALLEL_MIN_NUMEL = 1 << 15  # below this, OpenMP start-up costs more than it saves.

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <vector>
#include <new>
#include <omp.h>

namespace {

struct bf16 { uint16_t x; };

inline float  load(const float* p)    { return *p; }
inline double load(const double* p)   { return *p; }
#ifdef __FLT16_MAX__  // _Float16: gcc >= 12 / clang on x86-64 and aarch64
inline float  load(const _Float16* p) { return (float)*p; }
inline void store(_Float16* p, float x) { *p = (_Float16)x; }
#endif
inline float  load(const bf16* p) {
  uint32_t u = (uint32_t)p->x << 16; float f; std::memcpy(&f, &u, 4); return f;
}
inline void store(float* p, float x)    { *p = x; }
inline void store(double* p, double x)  { *p = x; }
inline void store(bf16* p, float x) {  // round to nearest even, as torch does
  uint32_t u; std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) { p->x = (uint16_t)((u >> 16) | 0x40u); return; }
  u += 0x7fffu + ((u >> 16) & 1u);
  p->x = (uint16_t)(u >> 16);
}

template <class W> struct Math { using S = float; };
template <> struct Math<double> { using S = double; };

template <class S> struct Hyper {
  S lr, b1, omb1, b2, omb2, eps, wd, ibc1, isbc2, clip, gsign;
  explicit Hyper(const double* h, bool maximize)
      : lr((S)h[0]), b1((S)h[1]), omb1((S)(1.0 - h[1])), b2((S)h[2]), omb2((S)(1.0 - h[2])),
        eps((S)h[3]), wd((S)h[4]), ibc1((S)h[5]), isbc2((S)h[6]), clip((S)h[7]),
        gsign(maximize ? (S)-1 : (S)1) {}
};

template <class S> inline S adam_dir(S m, S v, S w, const Hyper<S>& h) {
  return (m * h.ibc1) / (std::sqrt(v) * h.isbc2 + h.eps) + h.wd * w;
}
template <class S> inline S clip_step(S x, S c) { x = x < -c ? -c : x; return x > c ? c : x; }
template <class S> inline S mx(S a, S b) { return a > b ? a : b; }

// Accumulator of a norm: max of |x| (exact in S) or sum of x*x (in double).
template <class S, bool L2> struct Acc;
template <class S> struct Acc<S, false> {
  using T = S;
  static inline T add(T acc, S x) { return mx(acc, (S)std::fabs(x)); }
  static inline T combine(T a, T b) { return mx(a, b); }
  static inline S finish(T a) { return a; }
};
template <class S> struct Acc<S, true> {
  using T = double;
  static inline T add(T acc, S x) { return acc + (double)x * (double)x; }
  static inline T combine(T a, T b) { return a + b; }
  static inline S finish(T a) { return (S)std::sqrt(a); }
};

template <class S> inline S ratio_or_one(S wn, S un) {
  return (wn > 0 && un > 0) ? wn / un : (S)1;
}

// Rows [lo, hi) of this thread: the same split in both passes.
inline void split(int64_t rows, int64_t& lo, int64_t& hi) {
  const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
  lo = rows * t / n; hi = rows * (t + 1) / n;
}

// The update of one parameter. ELEMENTWISE: s_ij = max(r_i, c_j, b) on a row-major
// [rows, cols] tensor. Otherwise one ratio s = ||w|| / ||u|| for the tensor, which is then
// processed as a flat array cut into rows of BLOCK elements.
template <class W, bool L2, bool ELEMENTWISE>
int step_impl(const W* g, W* w, typename Math<W>::S* m, typename Math<W>::S* v, int64_t rows,
              int64_t cols, const Hyper<typename Math<W>::S>& h, bool bound, int nth) {
  using S = typename Math<W>::S;
  using A = Acc<S, L2>;
  using T = typename A::T;
  const int64_t numel = rows * cols;
  constexpr int64_t BLOCK = 8192;
  if (!ELEMENTWISE) { cols = BLOCK; rows = (numel + BLOCK - 1) / BLOCK; }
  std::vector<T> row_w, row_u, col_w, col_u;
  std::vector<S> col_s;
  try {
    row_w.assign(rows, 0); row_u.assign(rows, 0);
    if (ELEMENTWISE) {
      col_w.assign((size_t)nth * cols, 0); col_u.assign((size_t)nth * cols, 0);
      col_s.assign(cols, 0);
    }
  } catch (const std::bad_alloc&) { return 1; }
  S uniform_s = 1;

  #pragma omp parallel num_threads(nth) if (nth > 1)
  {
    int64_t lo, hi;
    split(rows, lo, hi);
    T* cw = ELEMENTWISE ? col_w.data() + (size_t)omp_get_thread_num() * cols : nullptr;
    T* cu = ELEMENTWISE ? col_u.data() + (size_t)omp_get_thread_num() * cols : nullptr;

    // Pass 1: moments in place; norms of |w| and |u| per row (and per column).
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t base = i * cols, len = (base + cols <= numel) ? cols : numel - base;
      const W* gi = g + base; const W* wi = w + base; S* mi = m + base; S* vi = v + base;
      T rw = 0, ru = 0;
      if constexpr (L2) {
        #pragma omp simd reduction(+:rw, ru)
        for (int64_t j = 0; j < len; ++j) {
          S gj = h.gsign * (S)load(gi + j), wj = (S)load(wi + j);
          S mj = mi[j] * h.b1 + h.omb1 * gj;
          S vj = vi[j] * h.b2 + h.omb2 * gj * gj;
          mi[j] = mj; vi[j] = vj;
          S u = adam_dir(mj, vj, wj, h);
          T ww = (T)wj * (T)wj, uu = (T)u * (T)u;
          rw += ww; ru += uu;
          if constexpr (ELEMENTWISE) { cw[j] += ww; cu[j] += uu; }
        }
      } else {
        #pragma omp simd reduction(max:rw, ru)
        for (int64_t j = 0; j < len; ++j) {
          S gj = h.gsign * (S)load(gi + j), wj = (S)load(wi + j);
          S mj = mi[j] * h.b1 + h.omb1 * gj;
          S vj = vi[j] * h.b2 + h.omb2 * gj * gj;
          mi[j] = mj; vi[j] = vj;
          S aw = std::fabs(wj), au = std::fabs(adam_dir(mj, vj, wj, h));
          rw = mx(rw, aw); ru = mx(ru, au);
          if constexpr (ELEMENTWISE) { cw[j] = mx(cw[j], aw); cu[j] = mx(cu[j], au); }
        }
      }
      row_w[i] = rw; row_u[i] = ru;
    }
    #pragma omp barrier
    #pragma omp single
    {
      T gw = 0, gu = 0;
      for (int64_t i = 0; i < rows; ++i) { gw = A::combine(gw, row_w[i]); gu = A::combine(gu, row_u[i]); }
      const S b = ratio_or_one(A::finish(gw), A::finish(gu));
      uniform_s = b;
      if constexpr (ELEMENTWISE) {
        const int n_part = omp_get_num_threads();
        const S floor_b = bound ? b : (S)0;
        for (int64_t j = 0; j < cols; ++j) {
          T cwj = col_w[j], cuj = col_u[j];
          for (int t = 1; t < n_part; ++t) {
            cwj = A::combine(cwj, col_w[(size_t)t * cols + j]);
            cuj = A::combine(cuj, col_u[(size_t)t * cols + j]);
          }
          S a = A::finish(cwj), c = A::finish(cuj);
          col_s[j] = (a > 0 && c > 0) ? mx(a / c, floor_b) : (S)-1;  // -1: a zero column max
        }
      }
    }  // implicit barrier

    // Pass 2: recompute u, scale by s (1 where a feeding max is zero), clip, write w rounded once.
    const S* cs = col_s.data();
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t base = i * cols, len = (base + cols <= numel) ? cols : numel - base;
      W* wi = w + base; const S* mi = m + base; const S* vi = v + base;
      S r = uniform_s;
      bool row_zero = false;
      if constexpr (ELEMENTWISE) {
        S a = A::finish(row_w[i]), c = A::finish(row_u[i]);
        row_zero = !(a > 0 && c > 0);
        r = row_zero ? (S)1 : a / c;
      }
      if (!ELEMENTWISE || row_zero) {
        #pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
          S wj = (S)load(wi + j);
          store(wi + j, wj - h.lr * clip_step(r * adam_dir(mi[j], vi[j], wj, h), h.clip));
        }
      } else {
        #pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
          S wj = (S)load(wi + j);
          S s = cs[j] < 0 ? (S)1 : mx(r, cs[j]);
          store(wi + j, wj - h.lr * clip_step(s * adam_dir(mi[j], vi[j], wj, h), h.clip));
        }
      }
    }
  }
  return 0;
}

template <class W>
int step(const void* g, void* w, void* m, void* v, int64_t rows, int64_t cols, const double* hp,
         int flags, int nth) {
  using S = typename Math<W>::S;
  const Hyper<S> h(hp, flags & 1);
  const bool l2 = flags & 2, elementwise = flags & 4, bound = flags & 8;
  const W* gp = (const W*)g; W* wp = (W*)w; S* mp = (S*)m; S* vp = (S*)v;
  if (elementwise)
    return l2 ? step_impl<W, true, true>(gp, wp, mp, vp, rows, cols, h, bound, nth)
              : step_impl<W, false, true>(gp, wp, mp, vp, rows, cols, h, bound, nth);
  return l2 ? step_impl<W, true, false>(gp, wp, mp, vp, rows, cols, h, bound, nth)
            : step_impl<W, false, false>(gp, wp, mp, vp, rows, cols, h, bound, nth);
}

}  // namespace

extern "C" {
int merit_step_f32(const void* g, void* w, void* m, void* v, int64_t r, int64_t c,
    const double* hp, int flags, int nth) {
  return step<float>(g, w, m, v, r, c, hp, flags, nth);
}
int merit_step_f64(const void* g, void* w, void* m, void* v, int64_t r, int64_t c,
    const double* hp, int flags, int nth) {
  return step<double>(g, w, m, v, r, c, hp, flags, nth);
}
#ifdef __FLT16_MAX__
int merit_step_f16(const void* g, void* w, void* m, void* v, int64_t r, int64_t c,
    const double* hp, int flags, int nth) {
  return step<_Float16>(g, w, m, v, r, c, hp, flags, nth);
}
#endif
int merit_step_bf16(const void* g, void* w, void* m, void* v, int64_t r, int64_t c,
    const double* hp, int flags, int nth) {
  return step<bf16>(g, w, m, v, r, c, hp, flags, nth);
}
}
"""

_CFLAGS = ["-O3", "-march=native", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
if platform.machine() in ("x86_64", "AMD64"):
    _CFLAGS.append("-mprefer-vector-width=512")  # gcc defaults to 256-bit vectors on AVX-512 CPUs
_FUNCS = {
    torch.float32: "merit_step_f32",
    torch.float64: "merit_step_f64",
    torch.float16: "merit_step_f16",
    torch.bfloat16: "merit_step_bf16",
}
_lock = threading.Lock()
_state: dict = {"loaded": False, "lib": None, "error": None, "path": None, "build_s": None}


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
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([_SOURCE, version, " ".join(_CFLAGS), _cpu_signature()]).encode())
    out = cache_dir() / f"merit_kernels_{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "merit_kernels.cpp"
        src.write_text(_SOURCE)
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


def load_kernel() -> dict | None:
    """The kernel's entry points by parameter dtype, building it on first use; None (and one
    warning) if that is impossible."""
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
            lib = ctypes.CDLL(str(path))
            funcs = {}
            for dtype, name in _FUNCS.items():
                fn = getattr(lib, name, None)  # float16 needs a compiler with _Float16
                if fn is not None:
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p] * 4 + [
                        ctypes.c_int64,
                        ctypes.c_int64,
                        ctypes.c_void_p,
                        ctypes.c_int,
                        ctypes.c_int,
                    ]
                    funcs[dtype] = fn
            _state.update(lib=funcs, path=path)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _state["error"] = str(e)
            warnings.warn(
                f"MERIT: the C++ CPU kernel is unavailable ({e}); using the pure-torch path instead",
                RuntimeWarning,
                stacklevel=3,
            )
        _state["loaded"] = True
        return _state["lib"]


def kernel_info() -> dict:
    """What happened when the kernel was loaded: path, build seconds (None if cached), error."""
    return {k: _state[k] for k in ("path", "build_s", "error")} | {"available": _state["lib"] is not None}


def supports(lib: dict, p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """True if the kernel can update this parameter: plain contiguous CPU tensors of <= 2 dims."""
    state_dtype = torch.float64 if p.dtype == torch.float64 else torch.float32
    return (
        type(grad) is torch.Tensor
        and type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.device.type == "cpu"
        and p.dtype in lib
        and p.dim() <= 2
        and grad.dtype == p.dtype
        and exp_avg.dtype == exp_avg_sq.dtype == state_dtype
        and grad.device == exp_avg.device == exp_avg_sq.device == p.device
        and p.shape == grad.shape == exp_avg.shape == exp_avg_sq.shape
        and all(t.is_contiguous() for t in (p, grad, exp_avg, exp_avg_sq))
    )


def kernel_step(lib, p, grad, exp_avg, exp_avg_sq, hyper, flags: int) -> None:
    """One MERIT step of one parameter in place. `hyper` is a ctypes double[8]:
    lr, beta1, beta2, eps, weight_decay, 1/bias_correction1, 1/sqrt(bias_correction2), clip."""
    n = p.numel()
    if n == 0:
        return
    rows, cols = (p.shape[0], p.shape[1]) if p.dim() == 2 else (1, n)
    if p.dim() < 2:
        flags &= ~FLAG_ELEMENTWISE  # the 1-D rule: one ratio for the whole vector
    nth = torch.get_num_threads() if n >= PARALLEL_MIN_NUMEL else 1
    rc = lib[p.dtype](
        grad.data_ptr(),
        p.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        rows,
        cols,
        ctypes.addressof(hyper),
        flags,
        nth,
    )
    if rc != 0:
        raise MemoryError(f"MERIT CPU kernel could not allocate its row/column buffers for {tuple(p.shape)}")
