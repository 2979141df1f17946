// Q4_K weights (llama.cpp's 4-bit K-quant, its numbers kept exactly) times int8 activations on the CPU's integer
// dot products: see q4k.py for the format. Built by native.load (-O3 -march=native -fopenmp) against torch's
// stable C ABI, which registers the op below.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include <omp.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"
#include "chunked_op.h"

using torch::stable::Tensor;

constexpr int64_t TILE = 16;     // output rows a chunk holds
constexpr int64_t BLOCK = 256;   // input columns a chunk holds (a Q4_K super-block), and an activation block
constexpr int64_t SUB = 32;      // columns that share one sub-scale and minimum
constexpr int64_t SUBS = BLOCK / SUB;
constexpr int64_t SCALES = 2048;             // byte where the 8 x 16 sub-scales start ([sub][row]), after the nibbles
constexpr int64_t MINS = SCALES + 128;       // the 8 x 16 minimums ([sub][row])
constexpr int64_t HALVES = MINS + 128;       // the 16 fp16 d, then the 16 fp16 dmin
constexpr int64_t CHUNK = HALVES + 4 * TILE;  // 2368 bytes: 4.625 bits a weight, against the file's 4.5
constexpr int TOKENS = 4;        // tokens (8 rounded rows) that share each unpacked weight vector
constexpr int64_t PREFETCH_AHEAD = 2 * CHUNK, PREFETCH_L2_AHEAD = 16 * CHUNK;  // one token: weights from memory

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
        const float f = std::ldexp(float(mantissa), -24);
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The 4-bit weight q in [0, 15] of row r (of the chunk's 16) and column k (of its 256): in group g = k / 32, byte
// 64 j + 4 r + i holds columns 4 j + i (low nibble) and 16 + 4 j + i (high nibble), so one 64-byte load gives 16
// lanes (rows) of 4 consecutive weights per nibble, which `vpdpbusd` multiplies by 4 activations.
static inline int weight_at(const uint8_t* chunk, int64_t r, int64_t k) {
    const int64_t g = k / 32, column = k % 16, byte = g * 256 + 64 * (column / 4) + 4 * r + column % 4;
    return k % 32 < 16 ? chunk[byte] & 0xf : chunk[byte] >> 4;
}

// Each block of 256 activations x becomes two int8 rows, x ≈ (254 q + r) * d with d = max |x| / (127 * 254), as
// q6k.cpp rounds them: q = round(s), r = round(254 (s - q)) for s = x / max|x| * 127. Each row keeps the integer sum
// of each 32 of its values (`sums`), which the sub-blocks' minimums multiply: exact, so every build agrees.
// Rows are stored coarse then fine for each token (2 rows of K bytes), d per block, sums per 32 per row.
struct Quantized { int8_t* q; float* d; int32_t* sums; };

template <typename T>
static void quantize_block_portable(const T* x, int64_t K, int64_t token, int64_t b, Quantized out) {
    const T* at = x + token * K + b * BLOCK;
    float largest = 0.f;
    bool nan = false;
    for (int64_t k = 0; k < BLOCK; ++k) {
        nan = nan || std::isnan(to_float(at[k]));
        largest = std::fmax(largest, std::fabs(to_float(at[k])));
    }
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    int8_t* coarse = out.q + 2 * token * K + b * BLOCK;
    int8_t* fine = coarse + K;
    for (int64_t k = 0; k < BLOCK; ++k) {
        const float scaled = to_float(at[k]) * inverse, rounded = std::nearbyint(scaled);
        coarse[k] = to_int8(rounded);
        fine[k] = remainder_int8(scaled, rounded);
    }
    const int64_t subs = K / SUB;
    for (int64_t s = 0; s < SUBS; ++s) {
        int32_t coarse_sum = 0, fine_sum = 0;
        for (int64_t k = 0; k < SUB; ++k) coarse_sum += coarse[SUB * s + k], fine_sum += fine[SUB * s + k];
        out.sums[2 * token * subs + b * SUBS + s] = coarse_sum;
        out.sums[(2 * token + 1) * subs + b * SUBS + s] = fine_sum;
    }
    out.d[token * (K / BLOCK) + b] = nan ? NAN : largest / (127.f * FINE);  // a NaN reaches the output through d
}

// One rounded row's super-block with a chunk's row r: Σ_sub sc Σ_k q_w q and Σ_sub m Σ_k q, both exact in int32
// (|Σ_k q_w q| <= 32 * 15 * 127 over a sub-block, times sc <= 63, 8 times: under 2^25).
static inline void chunk_dot(const uint8_t* chunk, int64_t r, const int8_t* q, const int32_t* sums, int32_t& scaled,
                             int32_t& minimum) {
    scaled = 0, minimum = 0;
    for (int64_t s = 0; s < SUBS; ++s) {
        int32_t dot = 0;
        for (int64_t k = SUB * s; k < SUB * (s + 1); ++k) dot += weight_at(chunk, r, k) * q[k];
        scaled += int32_t(chunk[SCALES + TILE * s + r]) * dot;
        minimum += int32_t(chunk[MINS + TILE * s + r]) * sums[s];
    }
}

// A super-block's two integer sums into a row's float accumulator, in the order every build follows.
static inline float accumulate(float acc, int32_t scaled, int32_t minimum, float d_scale, float m_scale) {
    return std::fma(-float(minimum), m_scale, std::fma(float(scaled), d_scale, acc));
}

template <typename T>
static void matmul_portable(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                            Quantized a) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE, subs = K / SUB;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < blocks; ++b) quantize_block_portable(x, K, m, b, a);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t m = 0; m < M; ++m) {
            float acc[2][TILE] = {};
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* chunk = w + (t * blocks + b) * CHUNK;
                const uint16_t* halves = reinterpret_cast<const uint16_t*>(chunk + HALVES);
                for (int64_t row = 0; row < 2; ++row) {  // coarse, fine
                    const int8_t* q = a.q + (2 * m + row) * K + b * BLOCK;
                    const int32_t* sums = a.sums + (2 * m + row) * subs + b * SUBS;
                    for (int64_t r = 0; r < TILE; ++r) {
                        int32_t scaled, minimum;
                        chunk_dot(chunk, r, q, sums, scaled, minimum);
                        const float d_x = a.d[m * blocks + b];
                        const float d_scale = half_to_float(halves[r]) * d_x, m_scale = half_to_float(halves[TILE + r]) * d_x;
                        acc[row][r] = accumulate(acc[row][r], scaled, minimum, d_scale, m_scale);
                    }
                }
            }
            for (int64_t r = 0; r < TILE; ++r) store(out + m * N + t * TILE + r, std::fma(acc[0][r], FINE, acc[1][r]));
        }
    }
}

#ifdef TFORMER_VNNI
template <typename T>
static void quantize_blocks(const T* x, int64_t M, int64_t K, Quantized a, int threads) {
    const int64_t blocks = K / BLOCK, subs = K / SUB;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * blocks > 64)
    for (int64_t i = 0; i < M * blocks; ++i) {
        const int64_t m = i / blocks, b = i % blocks;
        const T* at = x + m * K + b * BLOCK;
        __m512 v[BLOCK / 16], magnitude = _mm512_setzero_ps();
        __mmask16 nan = 0;
        TFORMER_UNROLLED
        for (int j = 0; j < BLOCK / 16; ++j) {
            v[j] = load16(at + 16 * j);
            nan |= _mm512_cmp_ps_mask(v[j], v[j], _CMP_UNORD_Q);
            magnitude = _mm512_max_ps(magnitude, _mm512_abs_ps(v[j]));
        }
        const float largest = _mm512_reduce_max_ps(magnitude);
        const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        int8_t* coarse = a.q + 2 * m * K + b * BLOCK;
        int8_t* fine = coarse + K;
        int32_t* coarse_sums = a.sums + 2 * m * subs + b * SUBS;
        int32_t* fine_sums = coarse_sums + subs;
        TFORMER_UNROLLED
        for (int s = 0; s < SUBS; ++s) {  // one sub-block of 32 values each
            __m512i whole[2], rest[2];
            TFORMER_UNROLLED
            for (int e = 0; e < 2; ++e) {
                const __m512 scaled = _mm512_mul_ps(v[2 * s + e], inverse);
                const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                whole[e] = _mm512_cvtps_epi32(rounded);
                rest[e] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(FINE)));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(coarse + 32 * s + 16 * e), _mm512_cvtsepi32_epi8(whole[e]));
                _mm_storeu_si128(reinterpret_cast<__m128i*>(fine + 32 * s + 16 * e), _mm512_cvtsepi32_epi8(rest[e]));
            }
            coarse_sums[s] = _mm512_reduce_add_epi32(_mm512_add_epi32(whole[0], whole[1]));
            fine_sums[s] = _mm512_reduce_add_epi32(_mm512_add_epi32(rest[0], rest[1]));
        }
        a.d[m * blocks + b] = nan ? NAN : largest / (127.f * FINE);
    }
}

// Output rows t*16 .. t*16+15 for R rounded rows (R / 2 tokens, coarse and fine). Each sub-block's 8 dot products
// (4 vectors of each nibble) are scaled by the 16 rows' sub-scales (vpmulld) and its activations' sum by their
// minimums; each super-block's two sums, exact in int32, are turned to floats and scaled as `accumulate` does.
template <int R, typename T>
static inline void tile_rows(const uint8_t* w_tile, int64_t blocks, const int8_t* q, const float* d,
                             const int32_t* sums, int64_t K, int64_t N, T* out) {
    __m512 acc[R];
    TFORMER_UNROLLED
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t subs = K / SUB;
    const __m512i low_half = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        if constexpr (R == 2) {
            prefetch(chunk + PREFETCH_AHEAD, CHUNK);
            prefetch(chunk + PREFETCH_L2_AHEAD, CHUNK, true);
        }
        __m512i total[R], minimum[R];
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) total[r] = minimum[r] = _mm512_setzero_si512();
        TFORMER_UNROLLED
        for (int g = 0; g < SUBS; ++g) {
            __m512i u[8];
            TFORMER_UNROLLED
            for (int j = 0; j < 4; ++j) {
                const __m512i bytes = _mm512_loadu_si512(chunk + 256 * g + 64 * j);
                u[j] = _mm512_and_si512(bytes, low_half);
                u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_half);
            }
            const int64_t column = b * BLOCK + SUB * g;
            __m512i dot[R];
            TFORMER_UNROLLED
            for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
            TFORMER_UNROLLED
            for (int v = 0; v < 8; ++v) {
                TFORMER_UNROLLED
                for (int r = 0; r < R; ++r) {
                    const int32_t quad = reinterpret_cast<const int32_t*>(q + r * K + column)[v];
                    dot[r] = _mm512_dpbusd_epi32(dot[r], u[v], _mm512_set1_epi32(quad));
                }
            }
            const __m512i scale = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + SCALES + TILE * g)));
            const __m512i mins = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + MINS + TILE * g)));
            TFORMER_UNROLLED
            for (int r = 0; r < R; ++r) {
                total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(dot[r], scale));
                const int32_t sum = sums[r * subs + b * SUBS + g];
                minimum[r] = _mm512_add_epi32(minimum[r], _mm512_mullo_epi32(mins, _mm512_set1_epi32(sum)));
            }
        }
        const __m512 d_w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + HALVES)));
        const __m512 m_w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + HALVES + 32)));
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) {
            const __m512 d_x = _mm512_set1_ps(d[(r / 2) * blocks + b]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d_w, d_x), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(minimum[r]), _mm512_mul_ps(m_w, d_x), acc[r]);
        }
    }
    TFORMER_UNROLLED
    for (int r = 0; r < R; r += 2) store16(out + (r / 2) * N, _mm512_fmadd_ps(acc[r], _mm512_set1_ps(FINE), acc[r + 1]));
}

template <typename T>
static void matmul_vnni(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        Quantized a) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE, subs = K / SUB;
    quantize_blocks(x, M, K, a, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* w_tile = w + t * blocks * CHUNK;
        int64_t m = 0;
        const auto tokens = [&](auto count) {
            constexpr int C = decltype(count)::value;
            tile_rows<2 * C>(w_tile, blocks, a.q + 2 * m * K, a.d + m * blocks, a.sums + 2 * m * subs, K, N,
                             out + m * N + t * TILE);
            m += C;
        };
        while (M - m >= TOKENS) tokens(std::integral_constant<int, TOKENS>());
        switch (M - m) {  // the last tokens, fewer than TOKENS, in one pass
            case 3: tokens(std::integral_constant<int, 3>()); break;
            case 2: tokens(std::integral_constant<int, 2>()); break;
            case 1: tokens(std::integral_constant<int, 1>());
        }
    }
}
#endif

#ifdef TFORMER_AVX2
template <typename T>
static void quantize_blocks_avx2(const T* x, int64_t M, int64_t K, Quantized a, int threads) {
    const int64_t blocks = K / BLOCK, subs = K / SUB;
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * blocks > 64)
    for (int64_t i = 0; i < M * blocks; ++i) {
        const int64_t m = i / blocks, b = i % blocks;
        const T* at = x + m * K + b * BLOCK;
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 magnitude = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int j = 0; j < BLOCK / 8; ++j) {
            const __m256 v = load8(at + 8 * j);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v));
        }
        const float largest = reduce_max8(magnitude);
        const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        int8_t* coarse = a.q + 2 * m * K + b * BLOCK;
        int8_t* fine = coarse + K;
        int32_t* coarse_sums = a.sums + 2 * m * subs + b * SUBS;
        int32_t* fine_sums = coarse_sums + subs;
        for (int s = 0; s < SUBS; ++s) {  // 32 values: one sub-block
            __m256i whole[4], rest[4];
            for (int e = 0; e < 4; ++e) {
                const __m256 scaled = _mm256_mul_ps(load8(at + 32 * s + 8 * e), inverse);
                const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                whole[e] = _mm256_cvtps_epi32(rounded);
                rest[e] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(FINE)));
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(coarse + 32 * s), pack_int8(whole));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(fine + 32 * s), pack_int8(rest));
            coarse_sums[s] = reduce_add8(_mm256_add_epi32(_mm256_add_epi32(whole[0], whole[1]),
                                                          _mm256_add_epi32(whole[2], whole[3])));
            fine_sums[s] = reduce_add8(_mm256_add_epi32(_mm256_add_epi32(rest[0], rest[1]),
                                                        _mm256_add_epi32(rest[2], rest[3])));
        }
        a.d[m * blocks + b] = _mm256_movemask_ps(nan) ? NAN : largest / (127.f * FINE);
    }
}

// Output rows t*16 + 8h .. t*16 + 8h + 7 for R rounded rows. AVX2 has no byte dot product into 32 bits:
// vpmaddubsw multiplies the unsigned nibbles by the activations and sums pairs into 16 bits; a sub-block's 8 such
// sums stay within 16 bits (16 * 15 * 127 = 30,480), and vpmaddwd by the row's sub-scale (in both 16-bit halves of
// its lane) widens them to 32 bits already scaled. The sums are the VNNI loop's.
template <int R, typename T>
static inline void half_rows_avx2(const uint8_t* w_tile, int64_t blocks, int h, const int8_t* q, const float* d,
                                  const int32_t* sums, int64_t K, int64_t N, T* out) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const int64_t subs = K / SUB;
    const __m256i low_half = _mm256_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        if constexpr (R == 2) prefetch(chunk + PREFETCH_AHEAD, CHUNK);
        __m256i total[R], minimum[R];
        for (int r = 0; r < R; ++r) total[r] = minimum[r] = _mm256_setzero_si256();
        for (int g = 0; g < SUBS; ++g) {
            __m256i u[8];
            for (int j = 0; j < 4; ++j) {
                const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256 * g + 64 * j + 32 * h));
                u[j] = _mm256_and_si256(bytes, low_half);
                u[4 + j] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_half);
            }
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + SCALES + TILE * g + 8 * h)));
            const __m256i scale = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
            const __m256i mins = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + MINS + TILE * g + 8 * h)));
            const int64_t column = b * BLOCK + SUB * g;
            for (int r = 0; r < R; ++r) {
                const int32_t* quads = reinterpret_cast<const int32_t*>(q + r * K + column);
                __m256i pairs = _mm256_setzero_si256();
                for (int v = 0; v < 8; ++v)
                    pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(u[v], _mm256_set1_epi32(quads[v])));
                total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(pairs, scale));
                const int32_t sum = sums[r * subs + b * SUBS + g];
                minimum[r] = _mm256_add_epi32(minimum[r], _mm256_mullo_epi32(mins, _mm256_set1_epi32(sum)));
            }
        }
        const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + HALVES + 16 * h)));
        const __m256 m_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + HALVES + 32 + 16 * h)));
        for (int r = 0; r < R; ++r) {
            const __m256 d_x = _mm256_set1_ps(d[(r / 2) * blocks + b]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d_w, d_x), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(minimum[r]), _mm256_mul_ps(m_w, d_x), acc[r]);
        }
    }
    for (int r = 0; r < R; r += 2) store8(out + (r / 2) * N + 8 * h, _mm256_fmadd_ps(acc[r], _mm256_set1_ps(FINE), acc[r + 1]));
}

template <typename T>
static void matmul_avx2(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        Quantized a) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE, subs = K / SUB;
    quantize_blocks_avx2(x, M, K, a, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < 2 * tiles; ++t) {  // half tiles: 8 output rows each
        const uint8_t* w_tile = w + (t / 2) * blocks * CHUNK;
        const int h = int(t % 2);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2)
            half_rows_avx2<4>(w_tile, blocks, h, a.q + 2 * m * K, a.d + m * blocks, a.sums + 2 * m * subs, K, N,
                              out + m * N + (t / 2) * TILE);
        for (; m < M; ++m)
            half_rows_avx2<2>(w_tile, blocks, h, a.q + 2 * m * K, a.d + m * blocks, a.sums + 2 * m * subs, K, N,
                              out + m * N + (t / 2) * TILE);
    }
}
#endif

extern "C" const char* q4k_instructions() { return KERNEL_INSTRUCTIONS; }  // "AVX512-VNNI", "AVX2" or "portable"

// x (M, K) times the chunks (N / 16, K / 256, 2368) into out (M, N); K % 256 == 0 and N % 16 == 0. Returns 0, or
// -1 (computing nothing) when the scratch for the quantized activations cannot be allocated.
template <typename T>
static int matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads, bool portable) {
    if (M == 0 || K == 0) return 0;
    const int64_t q_bytes = ((2 * M * K + 63) / 64) * 64, d_bytes = M * (K / BLOCK) * 4;
    const int64_t sum_bytes = 2 * M * (K / SUB) * 4;
    const ScratchMemory scratch(q_bytes + d_bytes + sum_bytes);
    int8_t* q = static_cast<int8_t*>(scratch.data());
    if (q == nullptr) return -1;
    float* d = reinterpret_cast<float*>(q + q_bytes);
    const Quantized a{q, d, reinterpret_cast<int32_t*>(q + q_bytes + d_bytes)};
#ifdef TFORMER_VNNI
    if (!portable) matmul_vnni(x, M, K, w, N, out, threads, a);
#endif
#ifdef TFORMER_AVX2
    if (!portable) matmul_avx2(x, M, K, w, N, out, threads, a);
#endif
    if (portable || !VECTORIZED) matmul_portable(x, M, K, w, N, out, threads, a);
    return 0;
}

// tformer::q4k_matmul(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor, defined in q4k.py.
static Tensor q4k_matmul_op(Tensor x, Tensor packed, int64_t out_features, bool portable) {
    return chunked_matmul_op("q4k_matmul", x, packed, out_features, portable, TILE, BLOCK, CHUNK,
                             [](auto... args) { return matmul(args...); });
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("q4k_matmul", TORCH_BOX(&q4k_matmul_op)); }
