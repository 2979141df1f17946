// Q6_K weights (llama.cpp's 6-bit K-quant, kept bit for bit) times int8 activations on the CPU's integer dot
// products: see q6k.py for the format. Built by native.load (-O3 -march=native -fopenmp) against torch's stable C
// ABI, which registers the op below.
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
constexpr int64_t BLOCK = 256;   // input columns a chunk holds (a Q6_K super-block), and an activation block
constexpr int64_t SUB = 16;      // columns that share one int8 sub-scale
constexpr int64_t GROUP = 384;   // bytes of 32 columns: 256 of low nibbles, 128 of high 2-bit pairs
constexpr int64_t SCALES = 8 * GROUP;          // byte where the 16 x 16 int8 sub-scales start ([sub][row])
constexpr int64_t HALVES = SCALES + 256;       // byte where the 16 fp16 super-block scales d start
constexpr int64_t CHUNK = HALVES + 2 * TILE;  // 3360 bytes: 6.5625 bits a weight, as the file's 210 per 256
constexpr int TOKENS = 4;        // tokens (8 rounded rows) that share each unpacked weight vector
constexpr int64_t PREFETCH_AHEAD = 2 * CHUNK, PREFETCH_L2_AHEAD = 16 * CHUNK;  // one token: weights from memory
constexpr int64_t UNPACK_TOKENS = 8;  // from this many tokens a tile is unpacked to bytes once (VNNI loop)

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

// The 6-bit weight u in [0, 63] (w = d * sc * (u - 32)) of row r (of the chunk's 16) and column k (of its 256).
// Group g = k / 32 holds 8 vectors of 16 rows x 4 columns: vector v < 4 columns 4v + i, v >= 4 columns 16 + 4(v-4) + i.
// Low 4 bits: byte 64 (v % 4) + 4 r + i of the group, the low nibble for v < 4, the high one for v >= 4. High 2
// bits: byte 256 + 64 (v / 4) + 4 r + i, bits 2 (v % 4) and up. So one 64-byte load of each gives 16 lanes (rows)
// of 4 consecutive weights, which `vpdpbusd` multiplies by 4 activations.
static inline int weight_at(const uint8_t* chunk, int64_t r, int64_t k) {
    const int64_t g = k / 32, column = k % 32, v = column / 4, i = column % 4;
    const uint8_t* group = chunk + g * GROUP;
    const int low = v < 4 ? group[64 * v + 4 * r + i] & 0xf : group[64 * (v - 4) + 4 * r + i] >> 4;
    const int high = (group[256 + 64 * (v / 4) + 4 * r + i] >> (2 * (v % 4))) & 3;
    return low | high << 4;
}

// Each block of 256 activations x becomes two int8 rows, x ≈ (254 q + r) * d with d = max |x| / (127 * 254), as
// int4.cpp rounds its blocks of 32: q = round(s), r = round(254 (s - q)) for s = x / max|x| * 127. Each row keeps
// -32 times the sum of each 16 of its values (`offsets`), which the weights' unsigned storage (u = w + 32) adds back.
// Rows are stored coarse then fine for each token (2 rows of K bytes), d per block, offsets per 16 per row.
struct Quantized { int8_t* q; float* d; int32_t* offsets; };

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
    for (int64_t s = 0; s < BLOCK / SUB; ++s) {
        int32_t coarse_sum = 0, fine_sum = 0;
        for (int64_t k = 0; k < SUB; ++k) coarse_sum += coarse[SUB * s + k], fine_sum += fine[SUB * s + k];
        out.offsets[2 * token * subs + b * (BLOCK / SUB) + s] = -32 * coarse_sum;
        out.offsets[(2 * token + 1) * subs + b * (BLOCK / SUB) + s] = -32 * fine_sum;
    }
    out.d[token * (K / BLOCK) + b] = nan ? NAN : largest / (127.f * FINE);  // a NaN reaches the output through d
}

// One row's dot product with a chunk's row r over its 256 columns: Σ_sub sc Σ_k (u - 32) q, exact in int32
// (|Σ_k (u - 32) q| <= 16 * 32 * 127 over a sub-block; times |sc| <= 128, 16 times: under 2^31).
static inline int32_t chunk_dot(const uint8_t* chunk, int64_t r, const int8_t* q) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(chunk + SCALES);
    int32_t total = 0;
    for (int64_t s = 0; s < BLOCK / SUB; ++s) {
        int32_t dot = 0;
        for (int64_t k = SUB * s; k < SUB * (s + 1); ++k) dot += (weight_at(chunk, r, k) - 32) * q[k];
        total += int32_t(scales[TILE * s + r]) * dot;
    }
    return total;
}

template <typename T>
static void matmul_portable(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                            Quantized a) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < blocks; ++b) quantize_block_portable(x, K, m, b, a);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t m = 0; m < M; ++m) {
            float coarse[TILE] = {}, fine[TILE] = {};
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* chunk = w + (t * blocks + b) * CHUNK;
                const uint16_t* halves = reinterpret_cast<const uint16_t*>(chunk + HALVES);
                const int8_t* q = a.q + 2 * m * K + b * BLOCK;
                for (int64_t r = 0; r < TILE; ++r) {
                    const float scale = half_to_float(halves[r]) * a.d[m * blocks + b];
                    coarse[r] = std::fma(float(chunk_dot(chunk, r, q)), scale, coarse[r]);
                    fine[r] = std::fma(float(chunk_dot(chunk, r, q + K)), scale, fine[r]);
                }
            }
            for (int64_t r = 0; r < TILE; ++r) store(out + m * N + t * TILE + r, std::fma(coarse[r], FINE, fine[r]));
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
        int32_t* coarse_offsets = a.offsets + 2 * m * subs + b * (BLOCK / SUB);
        int32_t* fine_offsets = coarse_offsets + subs;
        TFORMER_UNROLLED
        for (int j = 0; j < BLOCK / 16; ++j) {  // one sub-block of 16 values each
            const __m512 scaled = _mm512_mul_ps(v[j], inverse);
            const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i whole = _mm512_cvtps_epi32(rounded);
            const __m512i rest = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(FINE)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(coarse + 16 * j), _mm512_cvtsepi32_epi8(whole));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(fine + 16 * j), _mm512_cvtsepi32_epi8(rest));
            coarse_offsets[j] = -32 * _mm512_reduce_add_epi32(whole);
            fine_offsets[j] = -32 * _mm512_reduce_add_epi32(rest);
        }
        a.d[m * blocks + b] = nan ? NAN : largest / (127.f * FINE);
    }
}

// The 8 weight vectors of group g (v = 0 .. 7, see weight_at) as bytes u in [0, 63].
static inline void unpack_group(const uint8_t* group, __m512i* u) {
    const __m512i low_half = _mm512_set1_epi8(0x0f), top_pair = _mm512_set1_epi8(0x30);
    const __m512i high[2] = {_mm512_loadu_si512(group + 256), _mm512_loadu_si512(group + 320)};
    TFORMER_UNROLLED
    for (int j = 0; j < 4; ++j) {
        const __m512i bytes = _mm512_loadu_si512(group + 64 * j);
        // the pair at bits 2j .. 2j + 1, moved to bits 4 .. 5 (16-bit shifts: the mask drops what crosses bytes)
        TFORMER_UNROLLED
        for (int h = 0; h < 2; ++h) {
            __m512i pair = high[h];
            if (j == 0) pair = _mm512_slli_epi16(pair, 4);
            if (j == 1) pair = _mm512_slli_epi16(pair, 2);
            if (j == 3) pair = _mm512_srli_epi16(pair, 2);
            const __m512i nibble = h ? _mm512_srli_epi16(bytes, 4) : bytes;
            u[4 * h + j] = _mm512_ternarylogic_epi32(_mm512_and_si512(nibble, low_half), pair, top_pair, 0xf8);
        }
    }
}

// Output rows t*16 .. t*16+15 for R rounded rows (R / 2 tokens, coarse and fine). Each sub-block's 4 dot products
// start from the row's offset (-32 Σ q) and are scaled by the 16 rows' int8 sub-scales (vpmulld); each super-block's
// sum, exact in int32, is turned to float once and scaled by d * d_x. With `UNPACKED` the weights come as bytes
// from a tile unpacked once (`unpack_tile`, many tokens), else from the chunks themselves.
template <int R, bool UNPACKED, typename T>
static inline void tile_rows(const uint8_t* w_tile, const uint8_t* bytes, int64_t blocks, const int8_t* q,
                             const float* d, const int32_t* offsets, int64_t K, int64_t N, T* out) {
    __m512 acc[R];
    TFORMER_UNROLLED
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t subs = K / SUB;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        if constexpr (R == 2 && !UNPACKED) {
            prefetch(chunk + PREFETCH_AHEAD, CHUNK);
            prefetch(chunk + PREFETCH_L2_AHEAD, CHUNK, true);
        }
        __m512i total[R];
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
        TFORMER_UNROLLED
        for (int g = 0; g < 8; ++g) {
            __m512i u[8];
            if constexpr (UNPACKED) {
                TFORMER_UNROLLED
                for (int v = 0; v < 8; ++v) u[v] = _mm512_loadu_si512(bytes + (b * 8 + g) * 512 + 64 * v);
            } else {
                unpack_group(chunk + g * GROUP, u);
            }
            TFORMER_UNROLLED
            for (int h = 0; h < 2; ++h) {
                const int64_t s = 2 * g + h, column = b * BLOCK + SUB * s;
                __m512i dot[R];
                TFORMER_UNROLLED
                for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(offsets[r * subs + b * (BLOCK / SUB) + s]);
                TFORMER_UNROLLED
                for (int j = 0; j < 4; ++j) {
                    TFORMER_UNROLLED
                    for (int r = 0; r < R; ++r) {
                        const int32_t quad = reinterpret_cast<const int32_t*>(q + r * K + column)[j];
                        dot[r] = _mm512_dpbusd_epi32(dot[r], u[4 * h + j], _mm512_set1_epi32(quad));
                    }
                }
                const __m512i scale = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + SCALES + TILE * s)));
                TFORMER_UNROLLED
                for (int r = 0; r < R; ++r) total[r] = _mm512_add_epi32(total[r], _mm512_mullo_epi32(dot[r], scale));
            }
        }
        const __m512 d_w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + HALVES)));
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) {
            const __m512 scale = _mm512_mul_ps(d_w, _mm512_set1_ps(d[(r / 2) * blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), scale, acc[r]);
        }
    }
    TFORMER_UNROLLED
    for (int r = 0; r < R; r += 2) store16(out + (r / 2) * N, _mm512_fmadd_ps(acc[r], _mm512_set1_ps(FINE), acc[r + 1]));
}

// A tile's weights as bytes u, 512 a group (8 vectors of 64), for many tokens to read without unpacking again.
static void unpack_tile(const uint8_t* w_tile, int64_t blocks, uint8_t* bytes) {
    for (int64_t b = 0; b < blocks; ++b)
        TFORMER_UNROLLED
        for (int g = 0; g < 8; ++g) {
            __m512i u[8];
            unpack_group(w_tile + b * CHUNK + g * GROUP, u);
            for (int v = 0; v < 8; ++v) _mm512_storeu_si512(bytes + (b * 8 + g) * 512 + 64 * v, u[v]);
        }
}

template <bool UNPACKED, typename T>
static void all_tokens(const uint8_t* w_tile, const uint8_t* bytes, int64_t blocks, int64_t M, int64_t K, int64_t N,
                       Quantized a, T* out) {
    const int64_t subs = K / SUB;
    int64_t m = 0;
    const auto tokens = [&](auto count) {
        constexpr int C = decltype(count)::value;
        tile_rows<2 * C, UNPACKED>(w_tile, bytes, blocks, a.q + 2 * m * K, a.d + m * blocks, a.offsets + 2 * m * subs,
                                   K, N, out + m * N);
        m += C;
    };
    while (M - m >= TOKENS) tokens(std::integral_constant<int, TOKENS>());
    switch (M - m) {  // the last tokens, fewer than TOKENS, in one pass
        case 3: tokens(std::integral_constant<int, 3>()); break;
        case 2: tokens(std::integral_constant<int, 2>()); break;
        case 1: tokens(std::integral_constant<int, 1>());
    }
}

template <typename T>
static void matmul_vnni(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        Quantized a, uint8_t* unpacked) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    quantize_blocks(x, M, K, a, threads);
    if (M < UNPACK_TOKENS) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
        for (int64_t t = 0; t < tiles; ++t)
            all_tokens<false>(w + t * blocks * CHUNK, nullptr, blocks, M, K, N, a, out + t * TILE);
        return;
    }
    #pragma omp parallel num_threads(threads)
    {
        uint8_t* bytes = unpacked + omp_get_thread_num() * blocks * 8 * 512;  // this thread's unpacked tile
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const uint8_t* w_tile = w + t * blocks * CHUNK;
            unpack_tile(w_tile, blocks, bytes);
            all_tokens<true>(w_tile, bytes, blocks, M, K, N, a, out + t * TILE);
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
        int32_t* coarse_offsets = a.offsets + 2 * m * subs + b * (BLOCK / SUB);
        int32_t* fine_offsets = coarse_offsets + subs;
        for (int j = 0; j < BLOCK / 32; ++j) {  // 32 values: two sub-blocks
            __m256i whole[4], rest[4];
            for (int e = 0; e < 4; ++e) {
                const __m256 scaled = _mm256_mul_ps(load8(at + 32 * j + 8 * e), inverse);
                const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                whole[e] = _mm256_cvtps_epi32(rounded);
                rest[e] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(FINE)));
            }
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(coarse + 32 * j), pack_int8(whole));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(fine + 32 * j), pack_int8(rest));
            for (int h = 0; h < 2; ++h) {
                coarse_offsets[2 * j + h] = -32 * reduce_add8(_mm256_add_epi32(whole[2 * h], whole[2 * h + 1]));
                fine_offsets[2 * j + h] = -32 * reduce_add8(_mm256_add_epi32(rest[2 * h], rest[2 * h + 1]));
            }
        }
        a.d[m * blocks + b] = _mm256_movemask_ps(nan) ? NAN : largest / (127.f * FINE);
    }
}

// Output rows t*16 + 8h .. t*16 + 8h + 7 for R rounded rows. AVX2 has no byte dot product into 32 bits:
// vpmaddubsw multiplies |u - 32| by the activations given u - 32's sign and sums pairs into 16 bits; a sub-block's
// 4 such sums stay within 16 bits (8 * 32 * 127 = 32,512), and vpmaddwd by the row's sub-scale (in both 16-bit
// halves of its lane) widens them to 32 bits already scaled. The sum is Σ sc Σ (u - 32) q, as the VNNI loop's.
template <int R, typename T>
static inline void half_rows_avx2(const uint8_t* w_tile, int64_t blocks, int h, const int8_t* q, const float* d,
                                  int64_t K, int64_t N, T* out) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low_half = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        if constexpr (R == 2) prefetch(chunk + PREFETCH_AHEAD, CHUNK);
        __m256i total[R];
        for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
        for (int g = 0; g < 8; ++g) {
            const uint8_t* group = chunk + g * GROUP;
            for (int hh = 0; hh < 2; ++hh) {  // sub-block 2g + hh
                const int64_t s = 2 * g + hh, column = b * BLOCK + SUB * s;
                const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 256 + 64 * hh + 32 * h));
                __m256i signs[4], magnitudes[4];
                for (int j = 0; j < 4; ++j) {
                    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * j + 32 * h));
                    const __m256i nibble = _mm256_and_si256(hh ? _mm256_srli_epi16(bytes, 4) : bytes, low_half);
                    const __m256i pair = _mm256_and_si256(_mm256_srli_epi16(high, 2 * j), three);
                    signs[j] = _mm256_sub_epi8(_mm256_or_si256(nibble, _mm256_slli_epi16(pair, 4)), bias);
                    magnitudes[j] = _mm256_abs_epi8(signs[j]);
                }
                const __m256i sc = _mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(chunk + SCALES + TILE * s + 8 * h)));
                const __m256i scale = _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xffff)),
                                                      _mm256_slli_epi32(sc, 16));
                for (int r = 0; r < R; ++r) {
                    const int32_t* quads = reinterpret_cast<const int32_t*>(q + r * K + column);
                    __m256i pairs = _mm256_setzero_si256();
                    for (int j = 0; j < 4; ++j)
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(
                                                            magnitudes[j], _mm256_sign_epi8(_mm256_set1_epi32(quads[j]), signs[j])));
                    total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(pairs, scale));
                }
            }
        }
        const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + HALVES + 16 * h)));
        for (int r = 0; r < R; ++r) {
            const __m256 scale = _mm256_mul_ps(d_w, _mm256_set1_ps(d[(r / 2) * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), scale, acc[r]);
        }
    }
    for (int r = 0; r < R; r += 2) store8(out + (r / 2) * N + 8 * h, _mm256_fmadd_ps(acc[r], _mm256_set1_ps(FINE), acc[r + 1]));
}

template <typename T>
static void matmul_avx2(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        Quantized a) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    quantize_blocks_avx2(x, M, K, a, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < 2 * tiles; ++t) {  // half tiles: 8 output rows each
        const uint8_t* w_tile = w + (t / 2) * blocks * CHUNK;
        const int h = int(t % 2);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2)
            half_rows_avx2<4>(w_tile, blocks, h, a.q + 2 * m * K, a.d + m * blocks, K, N, out + m * N + (t / 2) * TILE);
        for (; m < M; ++m)
            half_rows_avx2<2>(w_tile, blocks, h, a.q + 2 * m * K, a.d + m * blocks, K, N, out + m * N + (t / 2) * TILE);
    }
}
#endif

extern "C" const char* q6k_instructions() { return KERNEL_INSTRUCTIONS; }  // "AVX512-VNNI", "AVX2" or "portable"

// x (M, K) times the chunks (N / 16, K / 256, 3360) into out (M, N); K % 256 == 0 and N % 16 == 0. Returns 0, or
// -1 (computing nothing) when the scratch for the quantized activations cannot be allocated.
template <typename T>
static int matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads, bool portable) {
    if (M == 0 || K == 0) return 0;
    const int64_t q_bytes = ((2 * M * K + 63) / 64) * 64, d_bytes = M * (K / BLOCK) * 4;
    const int64_t offset_bytes = ((2 * M * (K / SUB) * 4 + 63) / 64) * 64;
    // with many tokens the VNNI loop unpacks each tile once, into a buffer per thread (2 bytes a weight's 6 bits)
    const int64_t unpacked_bytes = VECTORIZED && !portable && M >= UNPACK_TOKENS ? threads * (K / BLOCK) * 8 * 512 : 0;
    const ScratchMemory scratch(q_bytes + d_bytes + offset_bytes + unpacked_bytes);
    int8_t* q = static_cast<int8_t*>(scratch.data());
    if (q == nullptr) return -1;
    float* d = reinterpret_cast<float*>(q + q_bytes);
    const Quantized a{q, d, reinterpret_cast<int32_t*>(q + q_bytes + d_bytes)};
    uint8_t* unpacked = reinterpret_cast<uint8_t*>(q + q_bytes + d_bytes + offset_bytes);
#ifdef TFORMER_VNNI
    if (!portable) matmul_vnni(x, M, K, w, N, out, threads, a, unpacked);
#endif
#ifdef TFORMER_AVX2
    if (!portable) matmul_avx2(x, M, K, w, N, out, threads, a);
#endif
    if (portable || !VECTORIZED) matmul_portable(x, M, K, w, N, out, threads, a);
    return 0;
}

// tformer::q6k_matmul(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor, defined in q6k.py.
static Tensor q6k_matmul_op(Tensor x, Tensor packed, int64_t out_features, bool portable) {
    return chunked_matmul_op("q6k_matmul", x, packed, out_features, portable, TILE, BLOCK, CHUNK,
                             [](auto... args) { return matmul(args...); });
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("q6k_matmul", TORCH_BOX(&q6k_matmul_op)); }
