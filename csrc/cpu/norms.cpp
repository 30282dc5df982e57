// CPU kernels of LayerNorm / RMSNorm (+ fused residual add), forward and backward, for fp32, fp16
// and bf16 tensors; the CPU impl of zerofuse::layer_norm / rms_norm (pyextension/ops/norms.py).
//
// Same math as kernels/norms.py (see its docstring). fp32 rows are read and written in place;
// fp16/bf16 rows are converted to fp32 once into a per-thread buffer that stays in cache. Row sums
// are `omp simd` reductions (vectorised; their order depends only on the vector width of the
// clone picked for the machine), and results are rounded once. Rows run in
// parallel; weight/bias gradients are summed per fixed block of rows and the blocks are added in
// order, so results do not depend on the thread count.
#include "../checks.h"
#include "convert.h"
#include "vector_isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace zerofuse {
namespace {

constexpr int64_t kMaxRowBlocks = 64;
constexpr int64_t kColumnTile = 1024;  // floats: a 4 KB tile of dw and of db

// Mean and biased variance in one pass over x, on data shifted by x[0] (the shifted-data
// algorithm: no cancellation when |mean| >> std, unlike the plain sum of squares). The sums are
// double: in float, each vector lane adds n / width terms in sequence and s2 - s1^2 / n cancels:
// on AVX2 a 65537-wide row's rstd was off by 3e-6 (relative) and y by 2.4e-5 (1.4x the fp32
// tolerance); with double sums the statistics are off by ~2e-8 and y by 1.1e-6.
ZF_MULTIVERSION(void, row_moments, (const float* __restrict__ x, int64_t n, float* mean, float* var),
                (x, n, mean, var)) {
  const double k = x[0];
  double s1 = 0., s2 = 0.;
#pragma omp simd reduction(+ : s1, s2)
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - k;
    s1 += d;
    s2 += d * d;
  }
  const double inv_n = 1. / static_cast<double>(n);
  *mean = static_cast<float>(k + s1 * inv_n);
  // clamped at 0 against rounding, NaN kept (std::max(0., NaN) is 0: a row holding inf, whose
  // variance is inf - inf, was scaled by 1 / sqrt(eps) into -inf where torch gives NaN)
  const double v = (s2 - s1 * s1 * inv_n) * inv_n;
  *var = static_cast<float>(v < 0. ? 0. : v);
}

ZF_MULTIVERSION(float, row_mean_sq_dev, (const float* __restrict__ x, float mu, int64_t n),
                (x, mu, n)) {
  // mean((x - mu)^2): the variance about mu (LayerNorm) or, with mu = 0, the mean square (RMSNorm);
  // summed in double for the reason row_moments gives, and divided by n in double: a sum of
  // squares past FLT_MAX whose mean is not (17 x 5e18) gave inf, an rstd of 0 and y = 0
  double s = 0.;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(x[i]) - mu;
    s += d * d;
  }
  return static_cast<float>(s / static_cast<double>(n));
}

ZF_MULTIVERSION(void, row_normalize, (const float* __restrict__ x, float* __restrict__ y, float mean, float rstd, const float* __restrict__ w, const float* __restrict__ b, int64_t n),
                (x, y, mean, rstd, w, b, n)) {
  if (w && b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i] + b[i];
  } else if (w) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd * w[i];
  } else if (b) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd + b[i];
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - mean) * rstd;
  }
}

// row_normalize fused with the rounding to bf16 (round to nearest even, as f32_to_bf16): saves
// a pass and an fp32 row buffer for bf16 outputs. Specialised on weight/bias (branch-free loops).
template <bool kW, bool kB>
__attribute__((always_inline)) inline void row_normalize_bf16_impl(const float* __restrict__ x,
                                                                   uint16_t* __restrict__ y, float mean, float rstd,
                                                                   const float* __restrict__ w,
                                                                   const float* __restrict__ b, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = (x[i] - mean) * rstd;
    if constexpr (kW) v *= w[i];
    if constexpr (kB) v += b[i];
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    y[i] = static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
}

ZF_MULTIVERSION(void, row_normalize_bf16, (const float* x, uint16_t* y, float mean, float rstd, const float* w, const float* b, int64_t n),
                (x, y, mean, rstd, w, b, n)) {
  if (w && b) row_normalize_bf16_impl<true, true>(x, y, mean, rstd, w, b, n);
  else if (w) row_normalize_bf16_impl<true, false>(x, y, mean, rstd, w, b, n);
  else if (b) row_normalize_bf16_impl<false, true>(x, y, mean, rstd, w, b, n);
  else row_normalize_bf16_impl<false, false>(x, y, mean, rstd, w, b, n);
}

// dx = rstd * (wdy - xhat * c1 - c2), xhat = (x - mean) * rstd, wdy = w * dy (w may be null).
// Specialised on the weight so every loop is branch-free; always_inline puts it inside
// row_backward's ISA clones.
template <bool kW>
__attribute__((always_inline)) inline void row_backward_impl(const float* __restrict__ x, const float* __restrict__ dy,
                                                             float* __restrict__ dx, const float* __restrict__ w,
                                                             float mean, float rstd, bool rms, int64_t n) {
  double s1 = 0., s2 = 0.;  // double sums: row_moments says why
#pragma omp simd reduction(+ : s1, s2)
  for (int64_t i = 0; i < n; ++i) {
    const float xhat = (x[i] - mean) * rstd;
    const float wdy = kW ? w[i] * dy[i] : dy[i];
    s1 += static_cast<double>(xhat) * wdy;
    s2 += wdy;
  }
  const float c1 = static_cast<float>(s1 / static_cast<double>(n));
  const float c2 = rms ? 0.f : static_cast<float>(s2 / static_cast<double>(n));
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const float xhat = (x[k] - mean) * rstd;
    const float wdy = kW ? w[k] * dy[k] : dy[k];
    dx[k] = (wdy - xhat * c1 - c2) * rstd;
  }
}

// dx must not alias x or dy.
ZF_MULTIVERSION(void, row_backward, (const float* x, const float* dy, float* dx, const float* w, float mean, float rstd, bool rms, int64_t n),
                (x, dy, dx, w, mean, rstd, rms, n)) {
  if (w) row_backward_impl<true>(x, dy, dx, w, mean, rstd, rms, n);
  else row_backward_impl<false>(x, dy, dx, w, mean, rstd, rms, n);
}

// dw[i] += dy[i] * (x[i] - mean) * rstd and db[i] += dy[i] over one column tile of one row
// (either may be null).
ZF_MULTIVERSION(void, accumulate_param_grads, (const float* __restrict__ x, const float* __restrict__ dy, float mean, float rstd, int64_t n, float* __restrict__ dw, float* __restrict__ db),
                (x, dy, mean, rstd, n, dw, db)) {
  if (dw) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dw[i] += dy[i] * ((x[i] - mean) * rstd);
  }
  if (db) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) db[i] += dy[i];
  }
}

std::vector<float> param_as_float(const c10::optional<at::Tensor>& p, int64_t n) {
  if (!p.has_value() || !p->defined()) return {};
  std::vector<float> out(n);
  to_float(p->contiguous().data_ptr(), p->scalar_type(), out.data(), n);
  return out;
}

bool is_kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_2d(const at::Tensor& t, const char* name, int64_t m, int64_t n) {
  ZF_CHECK(t.dim() == 2 && t.size(0) == m && t.size(1) == n && t.is_contiguous(), "norm_cpu", "expected ", name,
           " to be a contiguous (", m, ", ", n, ") tensor, got shape ", t.sizes(), " with strides ", t.strides());
  ZF_CHECK(is_kernel_dtype(t.scalar_type()), "norm_cpu", "expected ", name, " in float32, float16 or bfloat16, got ",
           t.scalar_type());
}

// weight / bias: n values in a kernel dtype on the cpu (read whole, as n floats)
void check_param(const c10::optional<at::Tensor>& p, const char* name, int64_t n) {
  if (!p.has_value() || !p->defined()) return;
  ZF_CHECK(p->device().is_cpu() && is_kernel_dtype(p->scalar_type()) && p->numel() == n, "norm_cpu", "expected ",
           name, " to be a float32, float16 or bfloat16 cpu tensor of ", n, " elements (the hidden size), got ",
           p->scalar_type(), " ", p->sizes(), " on ", p->device());
}

// mean / rstd: the forward's per-row statistics, m fp32 values on the cpu
void check_stat(const at::Tensor& t, const char* name, int64_t m) {
  ZF_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == m, "norm_cpu",
           "expected ", name, " to be a contiguous float32 cpu tensor of ", m, " elements (one per row), got ",
           t.scalar_type(), " ", t.sizes(), " on ", t.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd_cpu(
    const at::Tensor& x,                          // (M, N) contiguous
    const c10::optional<at::Tensor>& weight,      // (N,)
    const c10::optional<at::Tensor>& bias,        // (N,)
    const c10::optional<at::Tensor>& residual,    // (M, N) contiguous
    double eps, bool rms) {
  ZF_CHECK(x.dim() == 2 && x.size(1) >= 1, "norm_cpu", "expected x of 2 dims (rows, hidden) with a hidden size >= 1, "
           "got shape ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  check_2d(x, "x", m, n);
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) check_2d(*residual, "residual", m, n);
  check_param(weight, "weight", n);
  check_param(bias, "bias", n);
  const at::ScalarType ht = has_res ? at::promote_types(x.scalar_type(), residual->scalar_type()) : x.scalar_type();
  at::Tensor y = at::empty({m, n}, x.options().dtype(ht));
  at::Tensor h = has_res ? at::empty({m, n}, x.options().dtype(ht)) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({rms ? 0 : m}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
  const std::vector<float> w = param_as_float(weight, n), b = param_as_float(bias, n);
  const float* wp = w.empty() ? nullptr : w.data();
  const float* bp = b.empty() ? nullptr : b.data();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* rp = has_res ? static_cast<const char*>(residual->data_ptr()) : nullptr;
  const int64_t xs = n * x.element_size(), rs = has_res ? n * residual->element_size() : 0, hs = n * y.element_size();
  float* meanp = rms ? nullptr : mean.data_ptr<float>();
  float* rstdp = rstd.data_ptr<float>();
  char* yp = static_cast<char*>(y.data_ptr());
  char* hp = has_res ? static_cast<char*>(h.data_ptr()) : nullptr;

  // fp32 rows are read and written in place; other dtypes go through a per-thread fp32 row.
  const bool read_direct = x.scalar_type() == at::kFloat && !has_res;
  const bool write_direct = ht == at::kFloat;
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> row(read_direct && write_direct ? 0 : n), tmp(has_res || !write_direct ? n : 0);
    for (int64_t r = lo; r < hi; ++r) {
      const float* in = read_direct ? reinterpret_cast<const float*>(xp + r * xs) : row.data();
      if (!read_direct) to_float(xp + r * xs, x.scalar_type(), row.data(), n);
      if (has_res) {
        to_float(rp + r * rs, residual->scalar_type(), tmp.data(), n);
        for (int64_t i = 0; i < n; ++i) row[i] += tmp[i];
        from_float(row.data(), hp + r * hs, ht, n);
        to_float(hp + r * hs, ht, row.data(), n);  // normalise the rounded sum, as unfused code would
      }
      float mu, var;
      if (rms) {
        mu = 0.f;
        var = row_mean_sq_dev(in, 0.f, n);
      } else {
        row_moments(in, n, &mu, &var);
      }
      const float rs_ = 1.f / std::sqrt(var + static_cast<float>(eps));
      if (meanp) meanp[r] = mu;
      rstdp[r] = rs_;
      if (ht == at::kBFloat16) {
        row_normalize_bf16(in, reinterpret_cast<uint16_t*>(yp + r * hs), mu, rs_, wp, bp, n);
        continue;
      }
      float* out = write_direct ? reinterpret_cast<float*>(yp + r * hs) : tmp.data();
      row_normalize(in, out, mu, rs_, wp, bp, n);
      if (!write_direct) from_float(out, yp + r * hs, ht, n);
    }
  });
  return {y, h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd_cpu(
    const at::Tensor& dy,                     // (M, N) contiguous
    const c10::optional<at::Tensor>& dh,      // (M, N) contiguous: gradient of the h output, added to dx
    const at::Tensor& x,                      // (M, N) contiguous: the normalised input (h when fused)
    const c10::optional<at::Tensor>& weight,  // (N,)
    const c10::optional<at::Tensor>& bias,    // (N,): only its presence and dtype matter
    const at::Tensor& mean,                   // (M,) fp32, empty for RMSNorm
    const at::Tensor& rstd,                   // (M,) fp32
    bool rms) {
  ZF_CHECK(x.dim() == 2 && x.size(1) >= 1, "norm_cpu", "expected x of 2 dims (rows, hidden) with a hidden size >= 1, "
           "got shape ", x.sizes());
  const int64_t m = x.size(0), n = x.size(1);
  check_2d(x, "x", m, n);
  check_2d(dy, "dy", m, n);
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_2d(*dh, "dh", m, n);
  check_stat(rstd, "rstd", m);
  if (!rms) check_stat(mean, "mean", m);
  check_param(weight, "weight", n);
  check_param(bias, "bias", n);
  const bool has_w = weight.has_value() && weight->defined();
  const bool has_b = bias.has_value() && bias->defined();
  const std::vector<float> w = param_as_float(weight, n);
  const float* wp = has_w ? w.data() : nullptr;

  at::Tensor dx = at::empty_like(x);
  const int64_t blocks = std::min<int64_t>(std::max<int64_t>(m, 1), kMaxRowBlocks);
  const int64_t rows_per_block = (m + blocks - 1) / blocks;
  // per-block partial sums of dw and db, added in block order afterwards
  std::vector<float> dw_part(has_w ? blocks * n : 0, 0.f), db_part(has_b ? blocks * n : 0, 0.f);
  const float* meanp = rms ? nullptr : mean.data_ptr<float>();
  const float* rstdp = rstd.data_ptr<float>();
  const int64_t xs = n * x.element_size(), dys = n * dy.element_size(), dhs = has_dh ? n * dh->element_size() : 0;

  // Per block of rows: dx row by row, then dw/db column tile by column tile over the block's rows
  // (which are still in L2), so the partial-sum tiles stay in L1 even for wide rows.
  const bool direct = x.scalar_type() == at::kFloat && dy.scalar_type() == at::kFloat;
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    const size_t buf = direct ? 0 : static_cast<size_t>(rows_per_block * n);
    std::vector<float> xb(buf), gb(buf), out(n), extra(has_dh ? n : 0);
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t r0 = blk * rows_per_block, r1 = std::min(m, r0 + rows_per_block);
      auto x_row = [&](int64_t r) {
        return direct ? static_cast<const float*>(x.data_ptr()) + r * n : xb.data() + (r - r0) * n;
      };
      auto g_row = [&](int64_t r) {
        return direct ? static_cast<const float*>(dy.data_ptr()) + r * n : gb.data() + (r - r0) * n;
      };
      for (int64_t r = r0; r < r1; ++r) {
        if (!direct) {
          to_float(static_cast<const char*>(x.data_ptr()) + r * xs, x.scalar_type(), xb.data() + (r - r0) * n, n);
          to_float(static_cast<const char*>(dy.data_ptr()) + r * dys, dy.scalar_type(), gb.data() + (r - r0) * n, n);
        }
        char* dxr = static_cast<char*>(dx.data_ptr()) + r * xs;
        float* o = direct ? reinterpret_cast<float*>(dxr) : out.data();
        row_backward(x_row(r), g_row(r), o, wp, meanp ? meanp[r] : 0.f, rstdp[r], rms, n);
        if (has_dh) {
          to_float(static_cast<const char*>(dh->data_ptr()) + r * dhs, dh->scalar_type(), extra.data(), n);
          for (int64_t i = 0; i < n; ++i) o[i] += extra[i];
        }
        if (!direct) from_float(o, dxr, x.scalar_type(), n);
      }
      if (!has_w && !has_b) continue;
      float* dwp = has_w ? dw_part.data() + blk * n : nullptr;
      float* dbp = has_b ? db_part.data() + blk * n : nullptr;
      for (int64_t c0 = 0; c0 < n; c0 += kColumnTile) {
        const int64_t len = std::min(kColumnTile, n - c0);
        for (int64_t r = r0; r < r1; ++r)
          accumulate_param_grads(x_row(r) + c0, g_row(r) + c0, meanp ? meanp[r] : 0.f, rstdp[r], len,
                                 dwp ? dwp + c0 : nullptr, dbp ? dbp + c0 : nullptr);
      }
    }
  });

  auto reduce = [&](const std::vector<float>& part, const c10::optional<at::Tensor>& like) {
    if (part.empty()) return at::empty({0}, x.options());
    std::vector<float> sum(n, 0.f);
    for (int64_t blk = 0; blk < blocks; ++blk)
      for (int64_t i = 0; i < n; ++i) sum[i] += part[blk * n + i];
    at::Tensor out = at::empty({n}, like->options());
    from_float(sum.data(), out.data_ptr(), out.scalar_type(), n);
    return out;
  };
  return {dx, reduce(dw_part, weight), reduce(db_part, bias)};
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CPU, m) {
  m.impl("norm_fwd_cpu", &norm_fwd_cpu);
  m.impl("norm_bwd_cpu", &norm_bwd_cpu);
}

}  // namespace zerofuse
