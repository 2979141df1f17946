// Loads, stores and roundings shared by tformer's C++ kernels (see native.py).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

// Unrolls the loop that follows completely (GCC's unroll pragma; other compilers may ignore it), so that small
// arrays of vector registers stay in registers.
#define TFORMER_UNROLLED _Pragma("GCC unroll 16")

// bfloat16 <-> float without branches, so that loops over them vectorize; rounds to nearest even as torch does.
static inline float bf16_float(uint16_t x) {
    return __builtin_bit_cast(float, uint32_t(x) << 16);
}
static inline uint16_t float_bf16(float x) {
    const uint32_t bits = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t((bits >> 16) | 0x40u) : uint16_t(rounded);  // NaN stays
}
static inline float to_float(float x) { return x; }
static inline float to_float(int8_t x) { return float(x); }  // an int8 cache's integer, before its scale
static inline float to_float(uint16_t x) { return bf16_float(x); }  // bfloat16: the high half of a float
static inline void store(float* out, float x) { *out = x; }
static inline void store(uint16_t* out, float x) { *out = float_bf16(x); }  // NaN stays NaN
// A rounded value as a signed byte of the int8 kernels: clamped to [-127, 127], a NaN as 0 (the NaN reaches the
// output through the row's scale or sum instead; casting it to an integer would be undefined).
static inline int8_t to_int8(float rounded) {
    return std::isnan(rounded) ? 0 : int8_t(std::fmax(-127.f, std::fmin(127.f, rounded)));
}
// The second step of the int4 and w8a8 kernels' two-step rounding: a value scaled to [-127, 127] and rounded to q
// keeps its remainder as r = round(FINE (scaled - q)), in steps FINE times finer than q's.
constexpr float FINE = 254.f;
static inline int8_t remainder_int8(float scaled, float rounded) {
    return to_int8(std::nearbyint((scaled - rounded) * FINE));
}

// Scratch memory for one call. Up to KEPT_SCRATCH_BYTES it is the calling thread's own buffer, grown as needed and
// reused by its next calls: a malloc of a kilobyte or more per call sent glibc through malloc_consolidate every time,
// and SmolLM2's W8A8 head (393 KB at one row, 12.6 MB at 32) through mmap and fresh pages (2026-12-03, perf).
// Larger requests (a long prompt's prefill) get memory of their own, freed with the object. `data()` is nullptr
// when the memory cannot be had.
constexpr size_t KEPT_SCRATCH_BYTES = size_t(16) << 20;
class ScratchMemory {
  public:
    explicit ScratchMemory(size_t bytes) {
        if (bytes > KEPT_SCRATCH_BYTES) {
            own_.reset(new (std::nothrow) char[bytes]);
            data_ = own_.get();
            return;
        }
        thread_local std::vector<char> kept;
        if (kept.size() < bytes) {
            try {
                kept.resize(bytes);
            } catch (const std::bad_alloc&) {
                return;
            }
        }
        data_ = kept.data();
    }
    void* data() const { return data_; }

  private:
    std::unique_ptr<char[]> own_;
    void* data_ = nullptr;
};

// The instructions the int4 and w8a8 kernels vectorize with in this build: AVX512-VNNI's dot products (64 byte
// products an instruction), else AVX2's byte multiplies that sum in pairs (32 an instruction, a CPU such as AMD's
// Zen 3), else a portable loop. `KERNEL_INSTRUCTIONS` names them for `<kernel>_instructions()`.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TFORMER_VNNI 1
constexpr const char* KERNEL_INSTRUCTIONS = "AVX512-VNNI";
constexpr bool VECTORIZED = true;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TFORMER_AVX2 1
#include <immintrin.h>
constexpr const char* KERNEL_INSTRUCTIONS = "AVX2";
constexpr bool VECTORIZED = true;
#else
constexpr const char* KERNEL_INSTRUCTIONS = "portable";
constexpr bool VECTORIZED = false;
#endif

#ifdef TFORMER_AVX2
// 8 floats from 8 bfloat16s or floats, and back (rounded as `store` rounds one).
static inline __m256 load8(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const int8_t* p) {  // 8 signed bytes (an int8 KV cache's), as floats
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
static inline void store8(T* p, __m256 v, int64_t count = 8) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int64_t i = 0; i < count; ++i) store(p + i, lanes[i]);
}
static inline float reduce_add8(__m256 v) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
}
static inline int32_t reduce_add8(__m256i v) {
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xb1)));
}

// 32 int32 values in [-127, 127] (4 vectors of 8) as 32 bytes in order (NaN's integer saturates to -128).
static inline __m256i pack_int8(const __m256i* v) {
    const __m256i words = _mm256_packs_epi32(v[0], v[1]), more = _mm256_packs_epi32(v[2], v[3]);
    // the packs work per 128-bit lane, leaving groups of 4 values in the order 0 2 4 6 1 3 5 7 (of 8 groups)
    return _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, more), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
static inline float reduce_max8(__m256 v) {
    __m128 top = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    top = _mm_max_ps(top, _mm_movehl_ps(top, top));
    return _mm_cvtss_f32(_mm_max_ss(top, _mm_movehdup_ps(top)));
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 load16(const uint16_t* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const int8_t* p) {  // 16 signed bytes (an int8 KV cache's), as floats
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(uint16_t* p, __m512 v) {  // 16 bfloat16s, rounded as `store` rounds one
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

#if defined(__AVX512F__) || defined(TFORMER_AVX2)
// Asks the CPU to bring `bytes` from `at` into its caches, a 64-byte line at a time, ahead of the loads that read them:
// into the L1 cache, or with `l2_only` into L2 alone, which keeps more lines in flight and so can reach further ahead.
static inline void prefetch(const void* at, int64_t bytes, bool l2_only = false) {
    const char* line = static_cast<const char*>(at);
    for (int64_t byte = 0; byte < bytes; byte += 64) {
        if (l2_only)
            _mm_prefetch(line + byte, _MM_HINT_T1);
        else
            _mm_prefetch(line + byte, _MM_HINT_T0);
    }
}
#endif
