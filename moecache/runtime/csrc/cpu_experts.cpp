// CPU SwiGLU experts for the misses of one MoE layer visit: AVX-512 (BF16 dot products for bf16
// weights, FMA for fp32) inside one OpenMP parallel region.
//
// Why this shape: at decode (1..16 tokens) an expert is a GEMV that reads 6 MiB of weights per token
// batch, so the time is memory bandwidth. oneDNN's small-M bf16 path reaches only ~20 GB/s; here every
// thread streams its own contiguous share of each missed expert's rows, so all cores pull one expert
// at once, and each weight row is read once for all the tokens that chose that expert.
//
// Layout (transformers' fused experts): w13 [G, 2I, H] (gate rows 0..I-1, then up rows I..2I-1),
// w2 [G, H, I]; rows contiguous, the expert stride given (a store may interleave w13 and w2 per expert).
// Shape legend: T tokens, H hidden, I intermediate, G global expert keys, M (token, key, weight)
// triples, U distinct keys among them.
//
// Rounding: as transformers' experts (eager and grouped_mm alike) and the GPU kernel, every dot product
// is an fp32 sum, and what transformers keeps in x's dtype is rounded to it (R below; fp32: nothing):
// the gate and up projections, silu(gate), the activation, the down projection, and, when the router's
// weights are in x's dtype too (round_product), the weighted product; the products are summed in fp32.
// Phase 1 (parallel over all U*I gate/up row pairs):
//   act[m, r] = R(R(silu(R(x[t_m] . gate_r))) * R(x[t_m] . up_r)), stored in fp32.
// Phase 2 (parallel over output rows h): acc[t, h] = sum_m P(w_m * R(act[m] . down_h)), fp32 (bf16 down
// rows widened exactly to fp32, FMA with act; P: R when round_product), in key order (deterministic
// whatever the thread count), then out[t, h] = acc[t, h] in x's dtype, or in fp32 (out_f32: the caller
// adds it to the GPU half in fp32 and rounds once).
// A plain C ABI (called through ctypes, which releases the GIL): no torch headers, so it builds in
// about a second with any g++ that knows -mavx512bf16 and no ninja.
// host_idle: the calling thread (the one that drives the GPU and runs the cache manager's Python between
// calls) joins the team without a share of the work, so its core's caches are not flushed by the
// weights it would stream; the team is then `threads` workers + it.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kTokenTile = 8;  // tokens whose accumulators stay in registers: 2 rows x 8 = 16 zmm

// bf16 elements: 32 per zmm; the dot product step is VDPBF16PS (pairs of bf16 products into fp32).
struct Bf16 {
  using Elem = uint16_t;
  using Vec = __m512i;
  static constexpr int kStep = 32;
  static inline Vec load(const Elem* p) { return _mm512_loadu_si512(p); }
  static inline Vec load_tail(const Elem* p, int n) {
    return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  static inline __m512 dot(__m512 acc, Vec a, Vec b) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
  }
  static inline Elem from_float(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<Elem>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<Elem>(u >> 16);
  }
  static inline float round(float f) {  // f rounded to bf16, as fp32 (exact)
    const uint32_t u = static_cast<uint32_t>(from_float(f)) << 16;
    float r;
    std::memcpy(&r, &u, 4);
    return r;
  }
};

// fp32 elements: 16 per zmm, FMA.
struct F32 {
  using Elem = float;
  using Vec = __m512;
  static constexpr int kStep = 16;
  static inline Vec load(const Elem* p) { return _mm512_loadu_ps(p); }
  static inline Vec load_tail(const Elem* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static inline __m512 dot(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
  static inline Elem from_float(float f) { return f; }
  static inline float round(float f) { return f; }
};

// Weight rows read 16 at a time as fp32, against fp32 vectors (phase 2: the fp32 activations).
// bf16 -> fp32 is exact: the 16 bits move to the top of the fp32 word.
struct Bf16Wide {
  using Elem = uint16_t;
  static inline __m512 load(const Elem* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static inline __m512 load_tail(const Elem* p, int n) {
    const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};
struct F32Wide {
  using Elem = float;
  static inline __m512 load(const Elem* p) { return _mm512_loadu_ps(p); }
  static inline __m512 load_tail(const Elem* p, int n) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
};
// The fp32 widening of each weight type.
template <class E>
struct Wide;
template <>
struct Wide<Bf16> {
  using type = Bf16Wide;
};
template <>
struct Wide<F32> {
  using type = F32Wide;
};

// Two weight rows (a0, a1) of length K against NT vectors xs[j]: s0[j] = a0 . xs[j], s1[j] = a1 . xs[j].
template <class E, int NT>
inline void dot2(const typename E::Elem* a0, const typename E::Elem* a1, const typename E::Elem* const* xs,
                 int K, float* s0, float* s1) {
  __m512 acc0[NT], acc1[NT];
  for (int j = 0; j < NT; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  int k = 0;
  for (; k + E::kStep <= K; k += E::kStep) {
    _mm_prefetch(reinterpret_cast<const char*>(a0 + k) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a1 + k) + 1024, _MM_HINT_T0);
    const typename E::Vec w0 = E::load(a0 + k), w1 = E::load(a1 + k);
    for (int j = 0; j < NT; ++j) {
      const typename E::Vec xv = E::load(xs[j] + k);
      acc0[j] = E::dot(acc0[j], w0, xv);
      acc1[j] = E::dot(acc1[j], w1, xv);
    }
  }
  if (k < K) {
    const int n = K - k;
    const typename E::Vec w0 = E::load_tail(a0 + k, n), w1 = E::load_tail(a1 + k, n);
    for (int j = 0; j < NT; ++j) {
      const typename E::Vec xv = E::load_tail(xs[j] + k, n);
      acc0[j] = E::dot(acc0[j], w0, xv);
      acc1[j] = E::dot(acc1[j], w1, xv);
    }
  }
  for (int j = 0; j < NT; ++j) {
    s0[j] = _mm512_reduce_add_ps(acc0[j]);
    s1[j] = _mm512_reduce_add_ps(acc1[j]);
  }
}

// dot2 with weights of type W widened to fp32 (W: Bf16Wide / F32Wide) against NT fp32 vectors xs[j].
template <class W, int NT>
inline void dot2_wide(const typename W::Elem* a0, const typename W::Elem* a1, const float* const* xs, int K,
                      float* s0, float* s1) {
  __m512 acc0[NT], acc1[NT];
  for (int j = 0; j < NT; ++j) acc0[j] = acc1[j] = _mm512_setzero_ps();
  int k = 0;
  for (; k + 16 <= K; k += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(a0 + k) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a1 + k) + 1024, _MM_HINT_T0);
    const __m512 w0 = W::load(a0 + k), w1 = W::load(a1 + k);
    for (int j = 0; j < NT; ++j) {
      const __m512 xv = _mm512_loadu_ps(xs[j] + k);
      acc0[j] = _mm512_fmadd_ps(w0, xv, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(w1, xv, acc1[j]);
    }
  }
  if (k < K) {
    const int n = K - k;
    const __m512 w0 = W::load_tail(a0 + k, n), w1 = W::load_tail(a1 + k, n);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int j = 0; j < NT; ++j) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xs[j] + k);
      acc0[j] = _mm512_fmadd_ps(w0, xv, acc0[j]);
      acc1[j] = _mm512_fmadd_ps(w1, xv, acc1[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    s0[j] = _mm512_reduce_add_ps(acc0[j]);
    s1[j] = _mm512_reduce_add_ps(acc1[j]);
  }
}

// dot2_wide for 1..kTokenTile vectors, the count known only at run time.
template <class W>
inline void dot2_wide_n(int n, const typename W::Elem* a0, const typename W::Elem* a1, const float* const* xs,
                        int K, float* s0, float* s1) {
  switch (n) {
    case 1: return dot2_wide<W, 1>(a0, a1, xs, K, s0, s1);
    case 2: return dot2_wide<W, 2>(a0, a1, xs, K, s0, s1);
    case 3: return dot2_wide<W, 3>(a0, a1, xs, K, s0, s1);
    case 4: return dot2_wide<W, 4>(a0, a1, xs, K, s0, s1);
    case 5: return dot2_wide<W, 5>(a0, a1, xs, K, s0, s1);
    case 6: return dot2_wide<W, 6>(a0, a1, xs, K, s0, s1);
    case 7: return dot2_wide<W, 7>(a0, a1, xs, K, s0, s1);
    default: return dot2_wide<W, 8>(a0, a1, xs, K, s0, s1);
  }
}

// dot2 for 1..kTokenTile vectors, the count known only at run time.
template <class E>
inline void dot2_n(int n, const typename E::Elem* a0, const typename E::Elem* a1,
                   const typename E::Elem* const* xs, int K, float* s0, float* s1) {
  switch (n) {
    case 1: return dot2<E, 1>(a0, a1, xs, K, s0, s1);
    case 2: return dot2<E, 2>(a0, a1, xs, K, s0, s1);
    case 3: return dot2<E, 3>(a0, a1, xs, K, s0, s1);
    case 4: return dot2<E, 4>(a0, a1, xs, K, s0, s1);
    case 5: return dot2<E, 5>(a0, a1, xs, K, s0, s1);
    case 6: return dot2<E, 6>(a0, a1, xs, K, s0, s1);
    case 7: return dot2<E, 7>(a0, a1, xs, K, s0, s1);
    default: return dot2<E, 8>(a0, a1, xs, K, s0, s1);
  }
}

// [begin, end) of `total` items for thread `tid` of `nthreads`, contiguous and balanced.
inline void share(int64_t total, int tid, int nthreads, int64_t* begin, int64_t* end) {
  *begin = total * tid / nthreads;
  *end = total * (tid + 1) / nthreads;
}

struct Problem {
  int T, H, I, M, U;
  const int64_t* key_U;    // distinct keys, ascending
  const int32_t* start_U;  // U + 1 offsets into the key-sorted triples
  const int32_t* order_M;  // triple index of each key-sorted position
  const int64_t* token_M;
  const float* weight_M;
  int64_t w13_stride, w2_stride;  // elements between consecutive experts
  bool round_product;             // w_m * (act . down) rounded to x's dtype (the router's weights are in it)
};

// `idle` threads (the first: the calling thread, with host_idle) take no share of the work and only
// meet the others at the barrier, so the caller's caches keep what it runs between calls.
// out_f32: out_TH is fp32 (acc as it is), else x's dtype.
template <class E>
void run_phases(const Problem& p, const typename E::Elem* x_TH, const typename E::Elem* w13,
                const typename E::Elem* w2, float* act_MI, float* acc_TH, void* out_TH, bool out_f32,
                int idle) {
  using Elem = typename E::Elem;
  using W = typename Wide<E>::type;
  const int tid = omp_get_thread_num() - idle, nthreads = omp_get_num_threads() - idle;
  if (tid < 0) {
#pragma omp barrier
    return;
  }
  const Elem* xs[kTokenTile];
  float s0[kTokenTile], s1[kTokenTile];

  // Phase 1: this thread's contiguous share of all U * I (gate row, up row) pairs.
  int64_t f0, f1;
  share(static_cast<int64_t>(p.U) * p.I, tid, nthreads, &f0, &f1);
  for (int64_t f = f0; f < f1; ++f) {
    const int u = static_cast<int>(f / p.I), r = static_cast<int>(f % p.I);
    const Elem* gate = w13 + p.key_U[u] * p.w13_stride + static_cast<int64_t>(r) * p.H;
    const Elem* up = gate + static_cast<int64_t>(p.I) * p.H;
    for (int q0 = p.start_U[u]; q0 < p.start_U[u + 1]; q0 += kTokenTile) {
      const int n = std::min(kTokenTile, p.start_U[u + 1] - q0);
      for (int j = 0; j < n; ++j) xs[j] = x_TH + p.token_M[p.order_M[q0 + j]] * p.H;
      dot2_n<E>(n, gate, up, xs, p.H, s0, s1);
      for (int j = 0; j < n; ++j) {
        const float g = E::round(s0[j]), silu = E::round(g / (1.0f + std::exp(-g)));
        act_MI[static_cast<int64_t>(q0 + j) * p.I + r] = E::round(silu * E::round(s1[j]));
      }
    }
  }
#pragma omp barrier

  // Phase 2: this thread owns output rows [h0, h1) of every token (so no two threads write one value).
  int64_t h0, h1;
  share(p.H, tid, nthreads, &h0, &h1);
  const float* acts[kTokenTile];
  for (int t = 0; t < p.T; ++t) {
    float* row = acc_TH + static_cast<int64_t>(t) * p.H;
    std::fill(row + h0, row + h1, 0.0f);
  }
  for (int u = 0; u < p.U; ++u) {
    const Elem* down = w2 + p.key_U[u] * p.w2_stride;
    for (int64_t h = h0; h < h1; h += 2) {
      const bool pair = h + 1 < h1;
      const Elem* row0 = down + h * p.I;
      const Elem* row1 = pair ? row0 + p.I : row0;
      for (int q0 = p.start_U[u]; q0 < p.start_U[u + 1]; q0 += kTokenTile) {
        const int n = std::min(kTokenTile, p.start_U[u + 1] - q0);
        for (int j = 0; j < n; ++j) acts[j] = act_MI + static_cast<int64_t>(q0 + j) * p.I;
        dot2_wide_n<W>(n, row0, row1, acts, p.I, s0, s1);
        for (int j = 0; j < n; ++j) {
          const int m = p.order_M[q0 + j];
          float* acc = acc_TH + p.token_M[m] * p.H + h;
          const float w = p.weight_M[m];
          float y0 = w * E::round(s0[j]), y1 = w * E::round(s1[j]);
          if (p.round_product) y0 = E::round(y0), y1 = E::round(y1);
          acc[0] += y0;
          if (pair) acc[1] += y1;
        }
      }
    }
  }
  for (int t = 0; t < p.T; ++t) {
    const int64_t row = static_cast<int64_t>(t) * p.H;
    if (out_f32) {
      std::memcpy(static_cast<float*>(out_TH) + row + h0, acc_TH + row + h0, (h1 - h0) * sizeof(float));
    } else {
      Elem* out = static_cast<Elem*>(out_TH) + row;
      for (int64_t h = h0; h < h1; ++h) out[h] = E::from_float(acc_TH[row + h]);
    }
  }
}

}  // namespace

// The call's arguments in one struct (ctypes converts one pointer instead of twenty arguments: ~1 us).
// dtype: 0 = bf16, 1 = fp32 (x and weights share it); out_f32: out is fp32, else x's dtype;
// round_product: the weighted products rounded to x's dtype (Problem). Workspaces:
// order_M int32[M], key_U int64[M], start_U int32[M + 1], act_MI float[M * I], acc_TH float[T * H].
// Strides count elements.
struct RunArgs {
  int64_t dtype, T, H, I, G, M, w13_stride, w2_stride, threads, host_idle, out_f32, round_product;
  const void *x_TH, *w13, *w2;
  const int64_t *key_M, *token_M;
  const float* weight_M;
  int32_t* order_M;
  int64_t* key_U;
  int32_t* start_U;
  float* act_MI;
  float* acc_TH;
  void* out_TH;
};

extern "C" {

// Checks and groups the triples, then runs both phases in one parallel region of `threads` threads.
// Returns 0, or -(1 + m) for the first triple m whose key is outside [0, G) or token outside [0, T),
// or -1000000000 for a bad dtype; out_TH is then untouched.
int moecache_cpu_experts_run(const RunArgs* a) {
  if (a->dtype != 0 && a->dtype != 1) return -1000000000;
  const int M = static_cast<int>(a->M);
  const int64_t* key_M = a->key_M;
  for (int m = 0; m < M; ++m)
    if (key_M[m] < 0 || key_M[m] >= a->G || a->token_M[m] < 0 || a->token_M[m] >= a->T) return -(1 + m);
  // Group by key (stable: a key's triples keep their given order, so the sum order is fixed).
  int32_t* order_M = a->order_M;
  for (int m = 0; m < M; ++m) order_M[m] = m;
  std::stable_sort(order_M, order_M + M, [key_M](int32_t x, int32_t y) { return key_M[x] < key_M[y]; });
  int U = 0;
  for (int q = 0; q < M; ++q) {
    if (q == 0 || key_M[order_M[q]] != a->key_U[U - 1]) {
      a->key_U[U] = key_M[order_M[q]];
      a->start_U[U++] = q;
    }
  }
  a->start_U[U] = M;
  const Problem p{static_cast<int>(a->T), static_cast<int>(a->H), static_cast<int>(a->I), M, U, a->key_U,
                  a->start_U, order_M, a->token_M, a->weight_M, a->w13_stride, a->w2_stride,
                  a->round_product != 0};
  // `threads` workers; with host_idle the calling thread joins the team without a share (one more).
  const int threads = a->threads > 0 ? static_cast<int>(a->threads) : 1;
  const int idle = a->host_idle ? 1 : 0;
#pragma omp parallel num_threads(threads + idle)
  {
    // a team smaller than asked (the runtime's limit): the caller works after all
    const int skip = omp_get_num_threads() > idle ? idle : 0;
    const bool out_f32 = a->out_f32 != 0;
    if (a->dtype == 0)
      run_phases<Bf16>(p, static_cast<const uint16_t*>(a->x_TH), static_cast<const uint16_t*>(a->w13),
                       static_cast<const uint16_t*>(a->w2), a->act_MI, a->acc_TH, a->out_TH, out_f32, skip);
    else
      run_phases<F32>(p, static_cast<const float*>(a->x_TH), static_cast<const float*>(a->w13),
                      static_cast<const float*>(a->w2), a->act_MI, a->acc_TH, a->out_TH, out_f32, skip);
  }
  return 0;
}

}  // extern "C"
