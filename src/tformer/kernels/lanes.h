// Vector lanes for tformer's attention kernels (paged_attention.cpp, beam_attention.cpp, causal_attention.cpp): a
// register of `WIDTH` floats, AVX-512's 16 or else AVX2's 8 (a CPU such as AMD's Zen 3), with the few operations the
// kernels use, e^x over a register, and a row of scores' softmax. Without either instruction set TFORMER_VECTOR_ATTENTION stays undefined and the kernels keep
// their portable loops. Included after native.h.
#pragma once

#if defined(__AVX512F__) || defined(TFORMER_AVX2)
// out[0 .. 3]: the sums of a, b, c and d's 8 lanes. Each pair of horizontal adds halves the lanes per 128-bit half.
static inline void sum4_halves(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
    const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}
#endif

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
    static V lane_index() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
    static V fill_above(V x, V index, V limit, V fill) {  // x, with `fill` in the lanes where index > limit
        return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(index, limit, _CMP_GT_OQ), x, fill);
    }
    static void sum4(V a, V b, V c, V d, float* out) {  // out[0 .. 3]: the lane sums of a, b, c and d
        const auto half = [](V x) {
            const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
            return _mm256_add_ps(_mm512_castps512_ps256(x), high);
        };
        sum4_halves(half(a), half(b), half(c), half(d), out);
    }
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
    static V lane_index() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
    static V fill_above(V x, V index, V limit, V fill) {  // x, with `fill` in the lanes where index > limit
        return _mm256_blendv_ps(x, fill, _mm256_cmp_ps(index, limit, _CMP_GT_OQ));
    }
    static void sum4(V a, V b, V c, V d, float* out) { sum4_halves(a, b, c, d, out); }
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

// scores[0 .. n-1] = their softmax, in place; with `top_total`, e^(score - top) only, and top and their sum there
// (a split of the keys whose parts are merged later)
static inline void softmax_in_place(float* scores, int64_t n, float* top_total = nullptr) {
    const int64_t whole = n - n % WIDTH;  // scores past it take the scalar tail
    V top_lanes = Lanes::set1(-INFINITY);
    for (int64_t t = 0; t < whole; t += WIDTH) top_lanes = Lanes::max(top_lanes, Lanes::load(scores + t));
    float top = Lanes::reduce_max(top_lanes);
    for (int64_t t = whole; t < n; ++t) top = std::fmax(top, scores[t]);
    V total_lanes = Lanes::zero();
    for (int64_t t = 0; t < whole; t += WIDTH) {
        const V e = exp_lanes(Lanes::sub(Lanes::load(scores + t), Lanes::set1(top)));
        Lanes::store(scores + t, e);
        total_lanes = Lanes::add(total_lanes, e);
    }
    float total = Lanes::reduce_add(total_lanes);
    for (int64_t t = whole; t < n; ++t) total += (scores[t] = std::exp(scores[t] - top));
    if (top_total) {
        top_total[0] = top, top_total[1] = total;
        return;
    }
    const V inverse = Lanes::set1(1.f / total);
    for (int64_t t = 0; t < whole; t += WIDTH) Lanes::store(scores + t, Lanes::mul(Lanes::load(scores + t), inverse));
    for (int64_t t = whole; t < n; ++t) scores[t] *= 1.f / total;
}
#endif

