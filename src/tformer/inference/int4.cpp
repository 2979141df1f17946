// INT4 weights times int8 activations on the CPU's integer dot-product units: see int4.py for the format.
// Built by tformer.inference.native.load with the machine's C++ compiler (-O3 -march=native -fopenmp).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "native.h"

constexpr int64_t TILE = 16;    // output rows a chunk holds
constexpr int64_t BLOCK = 32;   // input columns a chunk holds; each row has one scale and minimum per block
constexpr int64_t CHUNK = 320;  // bytes a chunk: 256 of 4-bit weights, 16 fp16 scales, 16 fp16 minimums
constexpr int64_t ROWS = 4;     // input rows that share each chunk once it is unpacked into registers

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
        const float f = std::ldexp(float(mantissa), -24);
        return sign ? -f : f;
    }
    bits = sign | (exponent == 31 ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The 4-bit weight of row r (of the chunk's 16) and column k (of its 32): byte 64 j + 4 r + i holds columns
// 4 j + i (low half) and 16 + 4 j + i (high half), so one 64-byte load feeds a 16-lane dot product per half.
static inline int weight_at(const uint8_t* chunk, int64_t r, int64_t k) {
    const int64_t column = k % 16, byte = 64 * (column / 4) + 4 * r + column % 4;
    return k < 16 ? chunk[byte] & 0xf : chunk[byte] >> 4;
}

// Each block of 32 activations becomes q = round(x / d) in [-127, 127] with d = max |x| / 127, and keeps the sum of
// its float values (the minimums multiply it). The portable and vectorized versions round the same way.
template <typename T>
static void quantize_block_portable(const T* x, int8_t* q, float* d, float* sum) {
    float largest = 0.f, total = 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) largest = std::fmax(largest, std::fabs(to_float(x[k])));
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) {
        const float value = to_float(x[k]), scaled = std::nearbyint(value * inverse);
        q[k] = std::isnan(scaled) ? 0 : int8_t(std::fmax(-127.f, std::fmin(127.f, scaled)));
        total += value;  // a NaN or an infinity anywhere in the block reaches the output through the sum
    }
    *d = largest / 127.f;
    *sum = total;
}

template <typename T>
static void matmul_portable(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                            int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    for (int64_t i = 0; i < M * blocks; ++i) quantize_block_portable(x + i * BLOCK, q + i * BLOCK, d + i, sums + i);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t m = 0; m < M; ++m) {
            float acc[TILE] = {};
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* chunk = w + (t * blocks + b) * CHUNK;
                const uint16_t* halves = reinterpret_cast<const uint16_t*>(chunk + 256);
                const int8_t* qb = q + m * K + b * BLOCK;
                for (int64_t r = 0; r < TILE; ++r) {
                    int32_t dot = 0;
                    for (int64_t k = 0; k < BLOCK; ++k) dot += weight_at(chunk, r, k) * qb[k];
                    const float scale = half_to_float(halves[r]), minimum = half_to_float(halves[TILE + r]);
                    acc[r] = std::fma(float(dot), scale * d[m * blocks + b], acc[r]);
                    acc[r] = std::fma(minimum, sums[m * blocks + b], acc[r]);
                }
            }
            for (int64_t r = 0; r < TILE; ++r) store(out + m * N + t * TILE + r, acc[r]);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define TFORMER_VNNI 1
template <typename T>
static void quantize_blocks(const T* x, int64_t count, int8_t* q, float* d, float* sums, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (count > 512)
    for (int64_t i = 0; i < count; ++i) {
        const __m512 a = load16(x + i * BLOCK), b = load16(x + i * BLOCK + 16);
        const __m512 magnitude = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
        const float largest = _mm512_reduce_max_ps(magnitude);
        const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // rounds to nearest even
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * BLOCK), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * BLOCK + 16), _mm512_cvtsepi32_epi8(qb));
        d[i] = largest / 127.f;
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));  // a NaN anywhere in the block reaches the output
    }
}

// Output rows t*16 .. t*16+15 for R input rows: each chunk is unpacked once, then every row takes 8 dot products.
template <int R, typename T>
static inline void tile_rows(const uint8_t* w_tile, int64_t blocks, const int8_t* q, const float* d,
                             const float* sums, int64_t K, int64_t N, T* out) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    const __m512i low_half = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        __m512i low[4], high[4];
        for (int j = 0; j < 4; ++j) {
            const __m512i bytes = _mm512_loadu_si512(chunk + 64 * j);
            low[j] = _mm512_and_si512(bytes, low_half);
            high[j] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_half);
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256)));
        const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 288)));
        for (int r = 0; r < R; ++r) {
            const int32_t* quads = reinterpret_cast<const int32_t*>(q + r * K + b * BLOCK);
            __m512i dot = _mm512_setzero_si512();
            for (int j = 0; j < 4; ++j) dot = _mm512_dpbusd_epi32(dot, low[j], _mm512_set1_epi32(quads[j]));
            for (int j = 0; j < 4; ++j) dot = _mm512_dpbusd_epi32(dot, high[j], _mm512_set1_epi32(quads[4 + j]));
            const int64_t i = r * (K / BLOCK) + b;
            const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(d[i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scaled, acc[r]);
            acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store16(out + r * N, acc[r]);
}

template <typename T>
static void matmul_vnni(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    quantize_blocks(x, M * blocks, q, d, sums, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* w_tile = w + t * blocks * CHUNK;
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS)
            tile_rows<ROWS>(w_tile, blocks, q + m * K, d + m * blocks, sums + m * blocks, K, N, out + m * N + t * TILE);
        for (; m < M; ++m)
            tile_rows<1>(w_tile, blocks, q + m * K, d + m * blocks, sums + m * blocks, K, N, out + m * N + t * TILE);
    }
}
#endif

extern "C" int int4_vectorized() {  // 1 where the AVX512-VNNI version was built, 0 where only the portable one
#ifdef TFORMER_VNNI
    return 1;
#else
    return 0;
#endif
}

// x (M, K) times the packed weight (N / 16, K / 32, 320) into out (M, N); K % 32 == 0 and N % 16 == 0.
// Returns 0, or -1 (computing nothing) when the scratch for the quantized activations cannot be allocated.
template <typename T>
static int matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads, bool portable) {
    const int64_t count = M * (K / BLOCK);
    int8_t* q = static_cast<int8_t*>(std::malloc(M * K));
    float* scales = static_cast<float*>(std::malloc(2 * count * sizeof(float)));
    if (q == nullptr || scales == nullptr) {
        std::free(q);
        std::free(scales);
        return -1;
    }
#ifdef TFORMER_VNNI
    if (!portable) matmul_vnni(x, M, K, w, N, out, threads, q, scales, scales + count);
#endif
    if (portable || !int4_vectorized()) matmul_portable(x, M, K, w, N, out, threads, q, scales, scales + count);
    std::free(q);
    std::free(scales);
    return 0;
}

extern "C" int int4_matmul_bf16(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, uint16_t* out,
                                int threads, int portable) {
    return matmul(x, M, K, w, N, out, threads, portable != 0);
}
extern "C" int int4_matmul_f32(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* out,
                               int threads, int portable) {
    return matmul(x, M, K, w, N, out, threads, portable != 0);
}
