// Decode attention over a paged KV cache, reading each row's keys and values where they lie: see paged_attention.py.
// Built by tformer.inference.native.load with the machine's C++ compiler (-O3 -march=native -fopenmp), against
// torch's stable C ABI, which registers the op at the end.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"

using torch::stable::Tensor;

// The vector instructions `attend_one` runs on, as a few operations on a register of `WIDTH` floats: AVX-512's 16
// lanes, else AVX2's 8 (a CPU such as AMD's Zen 3); without either, `attend` keeps its portable loop.
#if defined(__AVX512F__)
#define TFORMER_VECTOR_ATTENTION 1
struct Lanes {
    using V = __m512;
    static constexpr int64_t WIDTH = 16;
    static V zero() { return _mm512_setzero_ps(); }
    static V set1(float x) { return _mm512_set1_ps(x); }
    template <typename T>
    static V load(const T* p) { return load16(p); }
    static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V max(V a, V b) { return _mm512_max_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
    static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
    static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
    static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static V times_power_of_two(V p, V n) { return _mm512_scalef_ps(p, n); }
};
#elif defined(TFORMER_AVX2)
#define TFORMER_VECTOR_ATTENTION 1
struct Lanes {
    using V = __m256;
    static constexpr int64_t WIDTH = 8;
    static V zero() { return _mm256_setzero_ps(); }
    static V set1(float x) { return _mm256_set1_ps(x); }
    template <typename T>
    static V load(const T* p) { return load8(p); }
    static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V max(V a, V b) { return _mm256_max_ps(a, b); }
    static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
    static float reduce_add(V v) { return reduce_add8(v); }
    static float reduce_max(V v) { return reduce_max8(v); }
    static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static V times_power_of_two(V p, V n) {  // n integral in [-126, 127]: 2^n built in the exponent bits
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    }
};
#endif

#ifdef TFORMER_VECTOR_ATTENTION
using V = Lanes::V;
constexpr int64_t WIDTH = Lanes::WIDTH;

// e^x for x <= 0: 2^n times a degree-6 polynomial in r = x - n ln2, |r| <= ln2 / 2 (relative error ~2e-7)
static inline V exp_lanes(V x) {
    x = Lanes::max(x, Lanes::set1(-87.f));
    const V n = Lanes::round(Lanes::mul(x, Lanes::set1(1.44269504f)));
    V r = Lanes::fnmadd(n, Lanes::set1(0.693145751953125f), x);
    r = Lanes::fnmadd(n, Lanes::set1(1.428606765330187e-06f), r);
    V p = Lanes::set1(0.0013888889f);
    for (const float c : {0.008333334f, 0.041666668f, 0.16666667f, 0.5f, 1.f, 1.f})
        p = Lanes::fmadd(p, r, Lanes::set1(c));
    return Lanes::times_power_of_two(p, n);
}

constexpr int64_t MAX_CHUNKS = 256 / WIDTH;  // head_dim up to 256
constexpr int64_t MAX_REP = 16;              // query heads per KV head
// Keys ahead to prefetch. 32 rows x ~130 keys of SmolLM2 in bf16, 30 layers' caches in DRAM (2 cores, AVX-512,
// 2026-12-02): 428-456 us a layer without prefetching, 308-322 at 8 keys ahead, 278-284 at 16, 247-252 at 32.
constexpr int64_t PREFETCH_AHEAD = 32;

static inline void prefetch_row(const void* row, int64_t bytes) {
    for (int64_t byte = 0; byte < bytes; byte += 64) _mm_prefetch(static_cast<const char*>(row) + byte, _MM_HINT_T0);
}

// One (row, KV head): scores, softmax and the weighted sum of values, WIDTH lanes at a time. D % WIDTH == 0.
template <typename T>
static void attend_one(const T* q, const T* k, const T* v, const int64_t* row_slots, int64_t n, int64_t Hkv,
                       int64_t g, int64_t rep, int64_t D, int64_t max_keys, float scale, float* scores, T* out) {
    const int64_t chunks = D / WIDTH, row_bytes = D * int64_t(sizeof(T));
    V query[MAX_REP * MAX_CHUNKS], acc[MAX_REP * MAX_CHUNKS], row[MAX_CHUNKS];
    for (int64_t i = 0; i < rep * chunks; ++i) {
        query[i] = Lanes::mul(Lanes::load(q + i * WIDTH), Lanes::set1(scale));
        acc[i] = Lanes::zero();
    }
    for (int64_t t = 0; t < n; ++t) {
        const T* key = k + (row_slots[t] * Hkv + g) * D;
        // the cache is larger than the CPU's caches: ask for keys in time
        if (t + PREFETCH_AHEAD < n) prefetch_row(k + (row_slots[t + PREFETCH_AHEAD] * Hkv + g) * D, row_bytes);
        for (int64_t c = 0; c < chunks; ++c) row[c] = Lanes::load(key + c * WIDTH);
        for (int64_t r = 0; r < rep; ++r) {
            V dot = Lanes::mul(query[r * chunks], row[0]);
            for (int64_t c = 1; c < chunks; ++c) dot = Lanes::fmadd(query[r * chunks + c], row[c], dot);
            scores[r * max_keys + t] = Lanes::reduce_add(dot);
        }
    }
    const int64_t whole = n - n % WIDTH;  // scores past it take the scalar tail
    for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores + r * max_keys;
        V top_lanes = Lanes::set1(-INFINITY);
        for (int64_t t = 0; t < whole; t += WIDTH) top_lanes = Lanes::max(top_lanes, Lanes::load(sr + t));
        float top = Lanes::reduce_max(top_lanes);
        for (int64_t t = whole; t < n; ++t) top = std::fmax(top, sr[t]);
        V total_lanes = Lanes::zero();
        for (int64_t t = 0; t < whole; t += WIDTH) {
            const V e = exp_lanes(Lanes::sub(Lanes::load(sr + t), Lanes::set1(top)));
            Lanes::store(sr + t, e);
            total_lanes = Lanes::add(total_lanes, e);
        }
        float total = Lanes::reduce_add(total_lanes);
        for (int64_t t = whole; t < n; ++t) total += (sr[t] = std::exp(sr[t] - top));
        const float inverse = 1.f / total;
        for (int64_t t = 0; t < n; ++t) sr[t] *= inverse;
    }
    for (int64_t t = 0; t < n; ++t) {
        const T* value = v + (row_slots[t] * Hkv + g) * D;
        if (t + PREFETCH_AHEAD < n) prefetch_row(v + (row_slots[t + PREFETCH_AHEAD] * Hkv + g) * D, row_bytes);
        for (int64_t c = 0; c < chunks; ++c) row[c] = Lanes::load(value + c * WIDTH);
        for (int64_t r = 0; r < rep; ++r) {
            const V w = Lanes::set1(scores[r * max_keys + t]);
            for (int64_t c = 0; c < chunks; ++c) acc[r * chunks + c] = Lanes::fmadd(w, row[c], acc[r * chunks + c]);
        }
    }
    alignas(64) float lanes[WIDTH];
    for (int64_t i = 0; i < rep * chunks; ++i) {
        Lanes::store(lanes, acc[i]);
        for (int64_t j = 0; j < WIDTH; ++j) store(out + i * WIDTH + j, lanes[j]);
    }
}
#endif

// q (B, H, D), k and v (num_slots, Hkv, D), slots (B, max_keys): row b reads keys slots[b, 0 .. lengths[b] - 1].
// Returns 0, or -1 (computing nothing) when a slot it would read lies outside the cache.
template <typename T>
static int attend(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths, int64_t B,
                  int64_t H, int64_t Hkv, int64_t D, int64_t max_keys, int64_t num_slots, float scale, int threads,
                  T* out) {
    for (int64_t b = 0; b < B; ++b) {
        const int64_t n = lengths[b] < max_keys ? lengths[b] : max_keys;
        for (int64_t t = 0; t < n; ++t) {
            if (slots[b * max_keys + t] < 0 || slots[b * max_keys + t] >= num_slots) return -1;
        }
    }
    const int64_t rep = H / Hkv;
    #pragma omp parallel num_threads(threads)
    {
        std::vector<float> query(rep * D), acc(rep * D), scores(rep * max_keys);
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            for (int64_t g = 0; g < Hkv; ++g) {
                int64_t n = lengths[b] < max_keys ? lengths[b] : max_keys;
                const int64_t* row_slots = slots + b * max_keys;
                const T* row_q = q + (b * H + g * rep) * D;
#ifdef TFORMER_VECTOR_ATTENTION
                if (D % WIDTH == 0 && D <= WIDTH * MAX_CHUNKS && rep <= MAX_REP && n > 0) {
                    attend_one(row_q, k, v, row_slots, n, Hkv, g, rep, D, max_keys, scale, scores.data(),
                               out + (b * H + g * rep) * D);
                    continue;
                }
#endif
                for (int64_t i = 0; i < rep * D; ++i) query[i] = to_float(row_q[i]) * scale;
                for (int64_t t = 0; t < n; ++t) {
                    const T* key = k + (row_slots[t] * Hkv + g) * D;
                    for (int64_t r = 0; r < rep; ++r) {
                        const float* qr = query.data() + r * D;
                        float s = 0.f;
                        #pragma omp simd reduction(+ : s)
                        for (int64_t d = 0; d < D; ++d) s += qr[d] * to_float(key[d]);
                        scores[r * max_keys + t] = s;
                    }
                }
                for (int64_t r = 0; r < rep; ++r) {
                    float* sr = scores.data() + r * max_keys;
                    float top = -INFINITY;
                    for (int64_t t = 0; t < n; ++t) top = sr[t] > top ? sr[t] : top;
                    float total = 0.f;
                    for (int64_t t = 0; t < n; ++t) {
                        sr[t] = std::exp(sr[t] - top);
                        total += sr[t];
                    }
                    float inverse = n > 0 ? 1.f / total : 0.f;
                    for (int64_t t = 0; t < n; ++t) sr[t] *= inverse;
                }
                std::fill(acc.begin(), acc.end(), 0.f);
                for (int64_t t = 0; t < n; ++t) {
                    const T* value = v + (row_slots[t] * Hkv + g) * D;
                    for (int64_t r = 0; r < rep; ++r) {
                        const float w = scores[r * max_keys + t];
                        float* ar = acc.data() + r * D;
                        #pragma omp simd
                        for (int64_t d = 0; d < D; ++d) ar[d] += w * to_float(value[d]);
                    }
                }
                T* row_out = out + (b * H + g * rep) * D;
                for (int64_t i = 0; i < rep * D; ++i) store(row_out + i, acc[i]);
            }
        }
    }
    return 0;
}

// tformer::paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) -> Tensor, defined in
// paged_attention.py. The checks repeat the ones the kernel relies on (metadata only: no tensor is read before).
static Tensor paged_decode_attention_op(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor lengths) {
    using torch::headeronly::ScalarType;
    if (q.dim() != 4 || q.size(2) != 1)
        throw std::invalid_argument("paged_decode_attention takes one query per row, q (B, H, 1, D)");
    const int64_t B = q.size(0), H = q.size(1), D = q.size(3);
    if (k.dim() != 3 || v.dim() != 3 || k.size(0) != v.size(0) || k.size(1) != v.size(1) || k.size(2) != v.size(2) ||
        k.size(2) != D || k.size(1) == 0 || H % k.size(1))
        throw std::invalid_argument("paged_decode_attention: k and v must be the cache's (slots, Hkv, D) tensors "
                                    "with H a multiple of Hkv");
    if (!k.is_contiguous() || !v.is_contiguous())
        throw std::invalid_argument("paged_decode_attention: k and v must be contiguous (the paged cache's own "
                                    "tensors)");
    const ScalarType dtype = q.scalar_type();
    if ((dtype != ScalarType::BFloat16 && dtype != ScalarType::Float) || k.scalar_type() != dtype ||
        v.scalar_type() != dtype)
        throw std::invalid_argument("paged_decode_attention: q, k and v must share one dtype of bfloat16 and float32");
    if (slots.scalar_type() != ScalarType::Long || lengths.scalar_type() != ScalarType::Long || slots.dim() != 2 ||
        slots.size(0) != B || lengths.dim() != 1 || lengths.size(0) != B)
        throw std::invalid_argument("paged_decode_attention: slots must be int64 (B, max_keys) and lengths int64 (B,)");
    if (!q.is_contiguous()) q = torch::stable::contiguous(q);
    if (!slots.is_contiguous()) slots = torch::stable::contiguous(slots);
    if (!lengths.is_contiguous()) lengths = torch::stable::contiguous(lengths);
    Tensor out = torch::stable::new_empty(q, {B, H, 1, D});
    const int64_t Hkv = k.size(1), max_keys = slots.size(1), num_slots = k.size(0);
    const float scale = float(std::pow(double(D), -0.5));  // as Python's D ** -0.5
    const int threads = int(torch::stable::get_num_threads());
    const auto* slot_ids = static_cast<const int64_t*>(slots.data_ptr());
    const auto* counts = static_cast<const int64_t*>(lengths.data_ptr());
    const int status =
        dtype == ScalarType::BFloat16
            ? attend(static_cast<const uint16_t*>(q.data_ptr()), static_cast<const uint16_t*>(k.data_ptr()),
                     static_cast<const uint16_t*>(v.data_ptr()), slot_ids, counts, B, H, Hkv, D, max_keys, num_slots,
                     scale, threads, static_cast<uint16_t*>(out.data_ptr()))
            : attend(static_cast<const float*>(q.data_ptr()), static_cast<const float*>(k.data_ptr()),
                     static_cast<const float*>(v.data_ptr()), slot_ids, counts, B, H, Hkv, D, max_keys, num_slots,
                     scale, threads, static_cast<float*>(out.data_ptr()));
    if (status)
        throw std::out_of_range("paged_decode_attention: a slot to read lies outside the cache's " +
                                std::to_string(num_slots) + " slots");
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("paged_decode_attention", TORCH_BOX(&paged_decode_attention_op));
}
