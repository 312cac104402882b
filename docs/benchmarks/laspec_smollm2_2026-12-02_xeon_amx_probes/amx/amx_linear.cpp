// Probe (2026-12-02, Intel Xeon with AMX, 2 cores), not a library feature: y = x @ w.T in fp32-class precision on AMX-BF16 (see linear_times.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
bool request_amx() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

inline __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}
// stacked A: rows [0,M) hi pieces, [M,2M) mid, [2M,3M) lo; Rp rows (zero padded), Kp columns
void split_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* a) {
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* hi = a + m * Kp; uint16_t* mid = a + (M + m) * Kp; uint16_t* lo = a + (2 * M + m) * Kp;
    for (int64_t k = 0; k < Kp; k += 16) {
      const int64_t n = std::min<int64_t>(16, K - k);
      const __mmask16 mask = n >= 16 ? 0xFFFF : (n > 0 ? static_cast<__mmask16>((1u << n) - 1u) : 0);
      const __m512 v = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      const __m256bh h = _mm512_cvtneps_pbh(v);
      const __m512 r1 = _mm512_sub_ps(v, widen(h));
      const __m256bh md = _mm512_cvtneps_pbh(r1);
      const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, widen(md)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + k), (__m256i)h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mid + k), (__m256i)md);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + k), (__m256i)l);
    }
  }
}

// One pass: T A tiles (rows t*16.. of the stacked A) against the P pieces of one 16-output block.
template <int P, int T>
inline void pass(const uint16_t* a, int64_t Kp, int64_t Kb, const uint16_t* wn, float* scratch) {
  // tiles: C[t][p] = tmm(t*P + p), A[t] = tmm(T*P + t), B[p] = tmm(T*P + T + p)
#define C_(t, p) ((t) * P + (p))
#define A_(t) (T * P + (t))
#define B_(p) (T * P + T + (p))
  // tile indices must be immediates: unrolled via constexpr switches below
  (void)a; (void)Kp; (void)Kb; (void)wn; (void)scratch;
}
}  // namespace

#define TZ(i) _tile_zero(i)
#define TL(i, p, s) _tile_loadd(i, p, s)
#define TS(i, p, s) _tile_stored(i, p, s)
#define DP(c, a, b) _tile_dpbf16ps(c, a, b)

// P = 2 pieces, T = 2 A tiles: C00=0 C01=1 C10=2 C11=3, A0=4 A1=5, B0=6 B1=7
static inline void pass_p2_t2(const uint16_t* a, int64_t Kp, int64_t Kb, const uint16_t* wn, float* s, int tiles) {
  TZ(0); TZ(1); TZ(2); TZ(3);
  const int64_t stride = Kp * 2;
  for (int64_t kb = 0; kb < Kb; ++kb) {
    const uint16_t* b = wn + kb * 2 * 512;
    _mm_prefetch(reinterpret_cast<const char*>(b + 4 * 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(b + 4 * 512 + 32), _MM_HINT_T0);
    TL(6, b, 64); TL(7, b + 512, 64);
    TL(4, a + kb * 32, stride);
    DP(0, 4, 6); DP(1, 4, 7);
    if (tiles > 1) { TL(5, a + 16 * Kp + kb * 32, stride); DP(2, 5, 6); DP(3, 5, 7); }
  }
  TS(0, s, 64 * 2); TS(1, s + 16, 64 * 2);
  if (tiles > 1) { TS(2, s + 512, 64 * 2); TS(3, s + 512 + 16, 64 * 2); }
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t Nb = packed.size(0), Kb = packed.size(1);
  const int64_t Kp = Kb * 32;
  const int64_t R = 3 * M, tiles_total = (R + 15) / 16, Rp = tiles_total * 16;
  std::vector<uint16_t> abuf(Rp * Kp, 0);
  split_rows(x.data_ptr<float>(), M, K, Kp, abuf.data());
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const uint16_t* ap = abuf.data();
  at::parallel_for(0, Nb, 4, [&](int64_t begin, int64_t end) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    std::vector<float> scratch(Rp * 32);  // rows x (16 hi-piece outputs, 16 mid-piece outputs)
    for (int64_t nb = begin; nb < end; ++nb) {
      const uint16_t* wn = wp + nb * Kb * 2 * 512;
      for (int64_t t0 = 0; t0 < tiles_total; t0 += 2) {
        pass_p2_t2(ap + t0 * 16 * Kp, Kp, Kb, wn, scratch.data() + t0 * 16 * 32, (int)std::min<int64_t>(2, tiles_total - t0));
      }
      const int64_t n0 = nb * 16, width = std::min<int64_t>(16, N - n0);
      const __mmask16 mask = width >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << width) - 1u);
      for (int64_t m = 0; m < M; ++m) {
        const float* hi = scratch.data() + m * 32;
        const float* mid = scratch.data() + (M + m) * 32;
        const float* lo = scratch.data() + (2 * M + m) * 32;
        // small terms first: mid.hi + lo.hi + hi.mid + mid.mid + lo.mid, then the hi.hi term
        __m512 small = _mm512_add_ps(_mm512_loadu_ps(mid), _mm512_loadu_ps(lo));
        small = _mm512_add_ps(small, _mm512_loadu_ps(hi + 16));
        small = _mm512_add_ps(small, _mm512_add_ps(_mm512_loadu_ps(mid + 16), _mm512_loadu_ps(lo + 16)));
        _mm512_mask_storeu_ps(yp + m * N + n0, mask, _mm512_add_ps(_mm512_loadu_ps(hi), small));
      }
    }
    _tile_release();
  });
  return y;
}

bool amx_available() { return request_amx(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_available", &amx_available);
  m.def("amx_linear", &amx_linear);
}
