// y = x @ w.T for a few rows of x (fp32, CPU; AVX-512 or AVX2 + FMA): the tree verification's shape.
//
// Why: for a few rows MKL's sgemm packs the weight panel on every call, so a forward of 4-16 tokens
// costs up to twice a one-token forward although it streams the same weights. Here every weight row is read
// once from memory: a tile of 4 weight rows (contiguous) meets up to 4 rows of x at a time (16 zmm
// accumulators; 2 rows and 8 ymm accumulators with AVX2), the next 512 bytes of each weight row are
// prefetched, and each dot product is reduced once at the end. Every output row is computed the same way
// whatever the number of rows (no cross-row blocking of the reduction), so a row's value does not depend on
// which other rows share the call. The instruction set is chosen at compile time (-mavx512f or -mavx2).
//
// The weight may also be bfloat16 (a drafter's weights, whose cost on a CPU is reading them): each weight
// is widened to fp32 in registers (exact) and the same fp32 products are summed in the same order, so a
// weight that is exactly representable in bf16 gives bitwise the fp32 kernel's result from half the bytes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
constexpr int kRowsPerPass = 4;  // rows of x per pass over a tile: 4 x 4 accumulators of 32 registers
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_first(const float* p, int64_t n) {  // lanes [0, n) of p, zeros after (n < kLanes)
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int kLanes = 8;
constexpr int kRowsPerPass = 2;  // 4 x 2 accumulators of 16 registers
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_first(const float* p, int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}
#else
#error "small_linear needs AVX-512F or AVX2 + FMA (build with -mavx512f or -mavx2 -mfma)"
#endif

constexpr int kTileRows = 4;          // weight rows per micro-tile
constexpr int kPrefetchBytes = 512;   // bytes ahead in each weight row

// kLanes weights widened to fp32: a float load, or bf16 bits shifted into the high half of each lane (exact)
inline vec wload(const float* p) { return vload(p); }
inline vec wload(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
#else
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
#endif
}
inline vec wload_first(const float* p, int64_t n) { return vload_first(p, n); }
inline vec wload_first(const uint16_t* p, int64_t n) {  // lanes [0, n), zeros after
  alignas(64) float lanes[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    std::memcpy(&lanes[i], &bits, sizeof(float));
  }
  return vload(lanes);
}

template <int M, typename W>
inline void micro_tile(const float* x, int64_t K, const W* w, float* y, int64_t ldy) {
  constexpr int64_t kPrefetch = kPrefetchBytes / sizeof(W);
  vec acc[M][kTileRows];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) acc[m][r] = vzero();
  const int64_t body = K - K % kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    vec b[kTileRows];
#pragma GCC unroll 4
    for (int r = 0; r < kTileRows; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + r * K + k + kPrefetch), _MM_HINT_T0);
      b[r] = wload(w + r * K + k);
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const vec a = vload(x + m * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < kTileRows; ++r) acc[m][r] = vfma(a, b[r], acc[m][r]);
    }
  }
  if (body < K) {
    for (int m = 0; m < M; ++m) {
      const vec a = vload_first(x + m * K + body, K - body);
      for (int r = 0; r < kTileRows; ++r) acc[m][r] = vfma(a, wload_first(w + r * K + body, K - body), acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < kTileRows; ++r) y[m * ldy + r] = vsum(acc[m][r]);
}

// the last N % 4 weight rows: the same lane-wise accumulation and final reduction, one row at a time
template <typename W>
inline void ragged_row(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t ldy) {
  const int64_t body = K - K % kLanes;
  for (int64_t m = 0; m < M; ++m) {
    vec acc = vzero();
    for (int64_t k = 0; k < body; k += kLanes) acc = vfma(vload(x + m * K + k), wload(w + k), acc);
    if (body < K) acc = vfma(vload_first(x + m * K + body, K - body), wload_first(w + body, K - body), acc);
    y[m * ldy] = vsum(acc);
  }
}

template <typename W>
void weight_rows(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += kTileRows) {
    const W* tile = w + o * K;
    if (o + kTileRows > N) {
      for (int64_t row = o; row < N; ++row) ragged_row(x, M, K, w + row * K, y + row, N);
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {  // later passes find the tile in L1
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N + o;
      const int64_t rows = std::min<int64_t>(M - m0, kRowsPerPass);
      if (rows == kRowsPerPass) micro_tile<kRowsPerPass, W>(xm, K, tile, ym, N);
      else if (rows == 1) micro_tile<1, W>(xm, K, tile, ym, N);
      else if constexpr (kRowsPerPass > 2) {
        if (rows == 2) micro_tile<2, W>(xm, K, tile, ym, N);
        else micro_tile<3, W>(xm, K, tile, ym, N);
      }
    }
  }
}

}  // namespace

std::atomic<int64_t> kernel_calls{0};  // for tests: how many calls ran the kernel

torch::Tensor small_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_linear: x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "small_linear: float32 x, float32 or bfloat16 w");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "small_linear: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "small_linear: contiguous tensors only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  kernel_calls.fetch_add(1, std::memory_order_relaxed);
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  if (w.scalar_type() == at::kBFloat16) {
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
      weight_rows(xp, M, K, wp, yp, N, begin * kTileRows, std::min<int64_t>(end * kTileRows, N));
    });
  } else {
    const float* wp = w.data_ptr<float>();
    at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
      weight_rows(xp, M, K, wp, yp, N, begin * kTileRows, std::min<int64_t>(end * kTileRows, N));
    });
  }
  return y;
}

// F.linear(x, w, bias), through the kernel when x holds min_rows..max_rows rows of fp32 CPU data and no
// gradient is needed; everything else (one row, many rows, other dtypes, autograd) goes to at::linear.
// `compact`, when given, is a bf16 copy of w that the kernel reads instead (the fallback still uses w).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                     int64_t min_rows, int64_t max_rows, const c10::optional<torch::Tensor>& compact) {
  const int64_t K = x.dim() ? x.size(-1) : 0;
  const int64_t rows = K ? x.numel() / K : 0;
  const bool grad = at::GradMode::is_enabled() &&
                    (x.requires_grad() || w.requires_grad() || (bias.has_value() && bias->requires_grad()));
  const bool use_compact = compact.has_value() && compact->scalar_type() == at::kBFloat16 &&
                           compact->device().is_cpu() && compact->is_contiguous() && compact->sizes() == w.sizes();
  if (rows < min_rows || rows > max_rows || grad || x.scalar_type() != at::kFloat ||
      (w.scalar_type() != at::kFloat && !use_compact) || !x.device().is_cpu() || !w.device().is_cpu() ||
      w.dim() != 2 || w.size(1) != K || (!w.is_contiguous() && !use_compact) ||
      (bias.has_value() && (bias->scalar_type() != at::kFloat || !bias->device().is_cpu())))
    return at::linear(x, w, bias);
  auto y = small_linear(x.reshape({rows, K}).contiguous(), use_compact ? *compact : w);
  if (bias.has_value()) y.add_(*bias);
  auto sizes = x.sizes().vec();
  sizes.back() = w.size(0);
  return y.view(sizes);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear", &small_linear, "x @ w.T for a few rows of x (M, K) and w (N, K)");
  m.def("linear", &linear, "F.linear, through small_linear for min_rows..max_rows fp32 rows",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("bias"), pybind11::arg("min_rows"),
        pybind11::arg("max_rows"), pybind11::arg("compact") = pybind11::none());
  m.def("kernel_calls", []() { return kernel_calls.load(); });
}
