// MERIT's step for CPU tensors: two passes over memory, C++/OpenMP, no torch headers.
//
// Built and loaded by merit_core/optim/merit/cpu.py (ctypes); see its docstring for the build.
//
// A parameter is a contiguous [R, C, T] array (T = product of the trailing dims, 1 for 2-D):
// rows along dim 0, columns along dim 1, and each trailing index t is its own [R, C] matrix
// for the row and column norms. Row statistics are indexed i*T + t, column statistics j*T + t
// (= the flat column of the [R, C*T] view). Without element-wise ratios (or below 2 dims) the
// tensor is a flat array and only the tensor-wide statistics exist.
//
// Statistics are raw accumulators in double: max|x| for the max-norm, sum x*x for the l2 norm,
// so that partial statistics of shards combine with one all-reduce (MAX or SUM).
//
//   pass 1: update m and v in place; row, column and tensor-wide statistics of |w| and |u|,
//           u = m_hat / (sqrt(v_hat) + eps) + wd * w, without storing u;
//   pass 2: recompute u, scale it by s (1 where a feeding norm is zero), clip it, write w
//           rounded once to the parameter's dtype.
//
// Non-finite values (the rule of merit_core/optim/merit/common.py): a NaN or inf in w or u
// makes every element of the parameter NaN. Max statistics count |NaN| as +inf (absn), so the
// tensor-wide maxima are infinite exactly when an entry is not finite, whatever order the
// threads and SIMD lanes combine them in; l2 sums propagate NaN and inf by themselves. Pass 2
// writes NaN everywhere when a tensor-wide statistic is not finite.
//
// merit_step_* runs both; merit_pass1_* / merit_pass2_* are the halves for the sharded path,
// which completes the statistics across shards in between.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>
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

// hp = [lr, beta1, beta2, eps, weight_decay, 1/bias_correction1, 1/sqrt(bias_correction2), clip]
template <class S> struct Hyper {
  S lr, b1, omb1, b2, omb2, eps, wd, ibc1, isbc2, clip, gsign;
  explicit Hyper(const double* h, bool maximize)
      : lr((S)h[0]), b1((S)h[1]), omb1((S)(1.0 - h[1])), b2((S)h[2]), omb2((S)(1.0 - h[2])),
        eps((S)h[3]), wd((S)h[4]), ibc1((S)h[5]), isbc2((S)h[6]), clip((S)h[7]),
        gsign(maximize ? (S)-1 : (S)1) {}
};

constexpr int FLAG_MAXIMIZE = 1, FLAG_L2 = 2, FLAG_ELEMENTWISE = 4, FLAG_BOUND = 8;
constexpr int64_t BLOCK = 8192;  // a flat tensor is cut into rows of BLOCK elements for threading

template <class S> inline S adam_dir(S m, S v, S w, const Hyper<S>& h) {
  return (m * h.ibc1) / (std::sqrt(v) * h.isbc2 + h.eps) + h.wd * w;
}
template <class S> inline S clip_step(S x, S c) { x = x < -c ? -c : x; return x > c ? c : x; }
template <class S> inline S mx(S a, S b) { return a > b ? a : b; }
// |x| for a max statistic: NaN counts as +inf (a max that may drop NaN cannot hide it then).
template <class S> inline S absn(S x) { const S a = std::fabs(x); return a == a ? a : (S)INFINITY; }

// Accumulator of a norm: max of |x| (exact in S) or sum of x*x (in double).
template <class S, bool L2> struct Acc;
template <class S> struct Acc<S, false> {
  using T = S;
  static inline T add(T acc, S x) { return mx(acc, absn(x)); }
  static inline double combine(double a, double b) { return a > b ? a : b; }
  static inline double finish(double a) { return a; }
};
template <class S> struct Acc<S, true> {
  using T = double;
  static inline T add(T acc, S x) { return acc + (double)x * (double)x; }
  static inline double combine(double a, double b) { return a + b; }
  static inline double finish(double a) { return std::sqrt(a); }
};

inline double ratio_or_one(double wn, double un) { return (wn > 0 && un > 0) ? wn / un : 1.0; }

// Rows [lo, hi) of this thread: the same split in both passes.
inline void split(int64_t rows, int64_t& lo, int64_t& hi) {
  const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
  lo = rows * t / n; hi = rows * (t + 1) / n;
}

template <class W> struct Tensors {
  using S = typename Math<W>::S;
  const W* g; W* w; S* m; S* v;
  int64_t R, C, T;  // element-wise: [R, C, T]; otherwise numel = R*C*T, processed flat
};

// Pass 1. row: [2, R*T] (w then u), col: [2, C*T], tot: [2]; row/col unused unless ELEMENTWISE.
template <class W, bool L2, bool ELEMENTWISE>
int pass1(const Tensors<W>& x, const Hyper<typename Math<W>::S>& h, int nth, double* row, double* col, double* tot) {
  using S = typename Math<W>::S;
  using A = Acc<S, L2>;
  using T = typename A::T;
  const int64_t numel = x.R * x.C * x.T;
  const int64_t width = ELEMENTWISE ? x.C * x.T : BLOCK;  // elements per row of work
  const int64_t rows = ELEMENTWISE ? x.R : (numel + BLOCK - 1) / BLOCK;
  const int64_t nrow = ELEMENTWISE ? x.R * x.T : rows, ncol = ELEMENTWISE ? width : 0;
  std::vector<double> own_row;
  std::vector<T> part_w, part_u;  // per-thread column partials
  try {
    if (!ELEMENTWISE) { own_row.assign(2 * rows, 0.0); row = own_row.data(); }
    if (ELEMENTWISE) { part_w.assign((size_t)nth * ncol, 0); part_u.assign((size_t)nth * ncol, 0); }
  } catch (const std::bad_alloc&) { return 1; }
  const int64_t Tn = ELEMENTWISE ? x.T : 1;

  #pragma omp parallel num_threads(nth) if (nth > 1)
  {
    int64_t lo, hi;
    split(rows, lo, hi);
    const int me = omp_get_thread_num();
    T* cw = ELEMENTWISE ? part_w.data() + (size_t)me * ncol : nullptr;
    T* cu = ELEMENTWISE ? part_u.data() + (size_t)me * ncol : nullptr;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t base = i * width, len = (base + width <= numel) ? width : numel - base;
      const W* gi = x.g + base; const W* wi = x.w + base; S* mi = x.m + base; S* vi = x.v + base;
      if (Tn == 1) {
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
            S aw = absn(wj), au = absn(adam_dir(mj, vj, wj, h));
            rw = mx(rw, aw); ru = mx(ru, au);
            if constexpr (ELEMENTWISE) { cw[j] = mx(cw[j], aw); cu[j] = mx(cu[j], au); }
          }
        }
        row[i] = (double)rw; row[nrow + i] = (double)ru;
      } else {  // 3-D and up: one row statistic per trailing index
        double* rwi = row + i * Tn; double* rui = row + nrow + i * Tn;
        for (int64_t t = 0; t < Tn; ++t) { rwi[t] = 0; rui[t] = 0; }
        for (int64_t j = 0; j < len; ++j) {
          const int64_t t = j % Tn;
          S gj = h.gsign * (S)load(gi + j), wj = (S)load(wi + j);
          S mj = mi[j] * h.b1 + h.omb1 * gj;
          S vj = vi[j] * h.b2 + h.omb2 * gj * gj;
          mi[j] = mj; vi[j] = vj;
          S u = adam_dir(mj, vj, wj, h);
          rwi[t] = (double)A::add((T)rwi[t], wj); rui[t] = (double)A::add((T)rui[t], u);
          cw[j] = A::add(cw[j], wj); cu[j] = A::add(cu[j], u);
        }
      }
    }
    #pragma omp barrier
    if constexpr (ELEMENTWISE) {
      const int n_part = omp_get_num_threads();
      #pragma omp for
      for (int64_t j = 0; j < ncol; ++j) {
        double a = (double)part_w[j], b = (double)part_u[j];
        for (int t = 1; t < n_part; ++t) {
          a = A::combine(a, (double)part_w[(size_t)t * ncol + j]);
          b = A::combine(b, (double)part_u[(size_t)t * ncol + j]);
        }
        col[j] = a; col[ncol + j] = b;
      }
    }
  }
  double gw = 0, gu = 0;
  for (int64_t i = 0; i < nrow; ++i) { gw = A::combine(gw, row[i]); gu = A::combine(gu, row[nrow + i]); }
  tot[0] = gw; tot[1] = gu;
  return 0;
}

// Pass 2 from completed statistics (the layouts of pass 1).
template <class W, bool L2, bool ELEMENTWISE>
int pass2(const Tensors<W>& x, const Hyper<typename Math<W>::S>& h, int nth, bool bound, const double* row,
          const double* col, const double* tot) {
  using S = typename Math<W>::S;
  using A = Acc<S, L2>;
  const int64_t numel = x.R * x.C * x.T;
  const int64_t width = ELEMENTWISE ? x.C * x.T : BLOCK;
  const int64_t rows = ELEMENTWISE ? x.R : (numel + BLOCK - 1) / BLOCK;
  const int64_t nrow = x.R * x.T, ncol = ELEMENTWISE ? width : 0;
  const double b = ratio_or_one(A::finish(tot[0]), A::finish(tot[1]));
  if (!(std::isfinite(tot[0]) && std::isfinite(tot[1]))) {  // the non-finite rule: poison the tensor
    #pragma omp parallel for num_threads(nth) if (nth > 1)
    for (int64_t i = 0; i < numel; ++i) store(x.w + i, (S)NAN);
    return 0;
  }
  std::vector<S> col_s;
  try {
    col_s.assign(ncol, 0);
  } catch (const std::bad_alloc&) { return 1; }
  const int64_t Tn = ELEMENTWISE ? x.T : 1;

  #pragma omp parallel num_threads(nth) if (nth > 1)
  {
    if constexpr (ELEMENTWISE) {
      const double floor_b = bound ? b : 0.0;
      #pragma omp for
      for (int64_t j = 0; j < ncol; ++j) {
        const double a = A::finish(col[j]), c = A::finish(col[ncol + j]);
        col_s[j] = (a > 0 && c > 0) ? (S)(a / c > floor_b ? a / c : floor_b) : (S)-1;  // -1: a zero column
      }
    }
    int64_t lo, hi;
    split(rows, lo, hi);
    const S* cs = col_s.data();
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t base = i * width, len = (base + width <= numel) ? width : numel - base;
      W* wi = x.w + base; const S* mi = x.m + base; const S* vi = x.v + base;
      if (!ELEMENTWISE) {
        const S r = (S)b;
        #pragma omp simd
        for (int64_t j = 0; j < len; ++j) {
          S wj = (S)load(wi + j);
          store(wi + j, wj - h.lr * clip_step(r * adam_dir(mi[j], vi[j], wj, h), h.clip));
        }
      } else if (Tn == 1) {
        const double a = A::finish(row[i]), c = A::finish(row[nrow + i]);
        const bool row_zero = !(a > 0 && c > 0);
        const S r = row_zero ? (S)1 : (S)(a / c);
        if (row_zero) {
          #pragma omp simd
          for (int64_t j = 0; j < len; ++j) {
            S wj = (S)load(wi + j);
            store(wi + j, wj - h.lr * clip_step(adam_dir(mi[j], vi[j], wj, h), h.clip));
          }
        } else {
          #pragma omp simd
          for (int64_t j = 0; j < len; ++j) {
            S wj = (S)load(wi + j);
            S s = cs[j] < 0 ? (S)1 : mx(r, cs[j]);
            store(wi + j, wj - h.lr * clip_step(s * adam_dir(mi[j], vi[j], wj, h), h.clip));
          }
        }
      } else {
        for (int64_t j = 0; j < len; ++j) {
          const int64_t t = j % Tn;
          const double a = A::finish(row[i * Tn + t]), c = A::finish(row[nrow + i * Tn + t]);
          S s = (a > 0 && c > 0 && cs[j] >= 0) ? mx((S)(a / c), cs[j]) : (S)1;
          S wj = (S)load(wi + j);
          store(wi + j, wj - h.lr * clip_step(s * adam_dir(mi[j], vi[j], wj, h), h.clip));
        }
      }
    }
  }
  return 0;
}

template <class W>
Tensors<W> tensors(const void* g, void* w, void* m, void* v, int64_t R, int64_t C, int64_t T) {
  using S = typename Math<W>::S;
  return Tensors<W>{(const W*)g, (W*)w, (S*)m, (S*)v, R, C, T};
}

template <class W>
int run_pass1(const Tensors<W>& x, const double* hp, int flags, int nth, double* row, double* col, double* tot) {
  using S = typename Math<W>::S;
  const Hyper<S> h(hp, flags & FLAG_MAXIMIZE);
  const bool l2 = flags & FLAG_L2, ew = flags & FLAG_ELEMENTWISE;
  if (ew) return l2 ? pass1<W, true, true>(x, h, nth, row, col, tot) : pass1<W, false, true>(x, h, nth, row, col, tot);
  return l2 ? pass1<W, true, false>(x, h, nth, row, col, tot) : pass1<W, false, false>(x, h, nth, row, col, tot);
}

template <class W>
int run_pass2(const Tensors<W>& x, const double* hp, int flags, int nth, const double* row, const double* col,
              const double* tot) {
  using S = typename Math<W>::S;
  const Hyper<S> h(hp, flags & FLAG_MAXIMIZE);
  const bool l2 = flags & FLAG_L2, ew = flags & FLAG_ELEMENTWISE, bound = flags & FLAG_BOUND;
  if (ew)
    return l2 ? pass2<W, true, true>(x, h, nth, bound, row, col, tot)
              : pass2<W, false, true>(x, h, nth, bound, row, col, tot);
  return l2 ? pass2<W, true, false>(x, h, nth, bound, row, col, tot)
            : pass2<W, false, false>(x, h, nth, bound, row, col, tot);
}

template <class W>
int step(const void* g, void* w, void* m, void* v, int64_t R, int64_t C, int64_t T, const double* hp, int flags,
         int nth) {
  const Tensors<W> x = tensors<W>(g, w, m, v, R, C, T);
  const bool ew = flags & FLAG_ELEMENTWISE;
  std::vector<double> row, col;
  double tot[2] = {0, 0};
  try {
    if (ew) { row.assign(2 * R * T, 0.0); col.assign(2 * C * T, 0.0); }
  } catch (const std::bad_alloc&) { return 1; }
  int rc = run_pass1<W>(x, hp, flags, nth, row.data(), col.data(), tot);
  if (rc) return rc;
  return run_pass2<W>(x, hp, flags, nth, row.data(), col.data(), tot);
}

}  // namespace

#define MERIT_ENTRY_POINTS(SUFFIX, W)                                                                          \
  int merit_step_##SUFFIX(const void* g, void* w, void* m, void* v, int64_t R, int64_t C, int64_t T,            \
                          const double* hp, int flags, int nth) {                                              \
    return step<W>(g, w, m, v, R, C, T, hp, flags, nth);                                                       \
  }                                                                                                            \
  int merit_pass1_##SUFFIX(const void* g, void* w, void* m, void* v, int64_t R, int64_t C, int64_t T,           \
                           const double* hp, int flags, int nth, double* row, double* col, double* tot) {      \
    return run_pass1<W>(tensors<W>(g, w, m, v, R, C, T), hp, flags, nth, row, col, tot);                       \
  }                                                                                                            \
  int merit_pass2_##SUFFIX(void* w, void* m, void* v, int64_t R, int64_t C, int64_t T, const double* hp,        \
                           int flags, int nth, const double* row, const double* col, const double* tot) {      \
    return run_pass2<W>(tensors<W>(nullptr, w, m, v, R, C, T), hp, flags, nth, row, col, tot);                 \
  }

extern "C" {
MERIT_ENTRY_POINTS(f32, float)
MERIT_ENTRY_POINTS(f64, double)
MERIT_ENTRY_POINTS(bf16, bf16)
#ifdef __FLT16_MAX__
MERIT_ENTRY_POINTS(f16, _Float16)
#endif
}
