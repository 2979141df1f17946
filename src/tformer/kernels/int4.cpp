// INT4 weights times int8 activations on the CPU's integer dot-product units: see int4.py for the format.
// Built by tformer.inference.native.load with the machine's C++ compiler (-O3 -march=native -fopenmp), against
// torch's stable C ABI, which registers the op below.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"
#include "chunked_op.h"

using torch::stable::Tensor;

constexpr int64_t TILE = 16;    // output rows a chunk holds
constexpr int64_t BLOCK = 32;   // input columns a chunk holds; each row has one scale and minimum per block
constexpr int64_t CHUNK = 320;  // bytes a chunk: 256 of 4-bit weights, 16 fp16 scales, 16 fp16 minimums
constexpr int ROWS = 6, ROWS_AVX2 = 4;  // input rows that share each chunk once unpacked (AVX-512, AVX2 loops)
static_assert(ROWS == 6, "matmul_vnni's switch takes the last 1 .. ROWS - 1 rows");
constexpr int64_t PREFETCH_AHEAD = 8 * CHUNK;  // bytes ahead of the chunk a one-row product reads: see tile_rows
constexpr int64_t PREFETCH_L2_AHEAD = 64 * CHUNK;  // and into the L2 cache alone, further ahead (AVX-512 loop)

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

// Each block of 32 activations x becomes two int8 blocks, x ≈ (254 q + r) * d with d = max |x| / (127 * 254):
// q = round(s) and r = round(254 (s - q)) for s = x / max|x| * 127, so a block keeps its values to 1/64,000 of its
// largest (one int8 block alone, llama.cpp's Q8_1, cost SmolLM2-135M 0.25 of John 1 perplexity in bf16). It also
// keeps the sum of its float values, which the minimums multiply. The portable and vectorized versions round alike
// (FINE = 254 and `remainder_int8` in native.h, shared with the w8a8 kernel).
template <typename T>
static void quantize_block_portable(const T* x, int8_t* q, float* d, float* sum) {
    float largest = 0.f, total = 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) largest = std::fmax(largest, std::fabs(to_float(x[k])));
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    for (int64_t k = 0; k < BLOCK; ++k) {
        const float value = to_float(x[k]), scaled = value * inverse, coarse = std::nearbyint(scaled);
        q[k] = to_int8(coarse);
        q[BLOCK + k] = remainder_int8(scaled, coarse);
        total += value;  // a NaN or an infinity anywhere in the block reaches the output through the sum
    }
    *d = largest / (127.f * FINE);
    *sum = total;
}

template <typename T>
static void matmul_portable(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                            int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    for (int64_t i = 0; i < M * blocks; ++i) quantize_block_portable(x + i * BLOCK, q + 2 * i * BLOCK, d + i, sums + i);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t m = 0; m < M; ++m) {
            float acc[TILE] = {};
            for (int64_t b = 0; b < blocks; ++b) {
                const uint8_t* chunk = w + (t * blocks + b) * CHUNK;
                const uint16_t* halves = reinterpret_cast<const uint16_t*>(chunk + 256);
                const int8_t* qb = q + 2 * (m * K + b * BLOCK);
                for (int64_t r = 0; r < TILE; ++r) {
                    int32_t coarse = 0, fine = 0;
                    for (int64_t k = 0; k < BLOCK; ++k) coarse += weight_at(chunk, r, k) * qb[k];
                    for (int64_t k = 0; k < BLOCK; ++k) fine += weight_at(chunk, r, k) * qb[BLOCK + k];
                    const int32_t dot = coarse * int32_t(FINE) + fine;  // at most 32 * 15 * 127 * 255: exact in fp32
                    const float scale = half_to_float(halves[r]), minimum = half_to_float(halves[TILE + r]);
                    acc[r] = std::fma(float(dot), scale * d[m * blocks + b], acc[r]);
                    acc[r] = std::fma(minimum, sums[m * blocks + b], acc[r]);
                }
            }
            for (int64_t r = 0; r < TILE; ++r) store(out + m * N + t * TILE + r, acc[r]);
        }
    }
}

#ifdef TFORMER_VNNI
template <typename T>
static void quantize_blocks(const T* x, int64_t count, int8_t* q, float* d, float* sums, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (count > 512)
    for (int64_t i = 0; i < count; ++i) {
        const __m512 a = load16(x + i * BLOCK), b = load16(x + i * BLOCK + 16);
        const __m512 magnitude = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
        const float largest = _mm512_reduce_max_ps(magnitude);
        const __m512 inverse = _mm512_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        int8_t* out = q + 2 * i * BLOCK;
        for (int half = 0; half < 2; ++half) {
            const __m512 scaled = _mm512_mul_ps(half ? b : a, inverse);
            const __m512 coarse = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 fine = _mm512_mul_ps(_mm512_sub_ps(scaled, coarse), _mm512_set1_ps(FINE));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * half),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(coarse)));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + BLOCK + 16 * half),
                             _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(fine)));  // rounds to nearest even
        }
        d[i] = largest / (127.f * FINE);
        sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));  // a NaN anywhere in the block reaches the output
    }
}

// Output rows t*16 .. t*16+15 for R input rows. Each quarter chunk, unpacked once, feeds all R rows in turn: 2R
// chains of dot products in flight, each turned to float by itself (the coarse part times FINE once, at the end).
// Against 4 rows one after another, on an Intel Xeon with AVX512-VNNI (2 threads, one process alternating both
// builds, SmolLM2's four INT4 shapes): 209 -> 297 GOP/s at 384 rows, 199 -> 305 at 32, 185 -> 261 at 5; one row
// from memory 92.2 -> 88.1 us. One thread, 384 rows: 4 rows in turn 187 GOP/s, 6 rows 196, 8 (spilling) 180.
// At one row the weights stream from memory, so it asks for the chunk 8 ahead, as `tile_row_avx2` does: SmolLM2's
// four INT4 layers went from 180-198 to 135-175 us a layer on an Intel Xeon without AMX (2 threads, weights out of
// the CPU's caches, one process alternating both builds; 4 chunks ahead 147-176, 16 ahead 131-180), and batch-1
// decode from 94.0 to 101.5 tok/s (medians of 630 steps, the two builds alternating every two steps). Asking for the
// chunk 64 ahead into L2 as well (session 25, the same machine): 97.6 -> 84.2 and 92.7 -> 81.6 us a layer (32
// ahead 91.7-118.6, 128 ahead 83.3-87.4; 64 ahead into L2 alone 96.3-120.6, no better), batch-1 decode 107.8 -> 111.0
// and 126.6 -> 132.0 tok/s. The AVX2 loop, tuned on another machine, does not do it (not measured there).
template <int R, typename T>
static inline void tile_rows(const uint8_t* w_tile, int64_t blocks, const int8_t* q, const float* d,
                             const float* sums, int64_t K, int64_t N, T* out) {
    __m512 coarse_acc[R], fine_acc[R];  // the coarse sums' part times FINE and the fine sums' and minimums' part
    TFORMER_UNROLLED
    for (int r = 0; r < R; ++r) coarse_acc[r] = fine_acc[r] = _mm512_setzero_ps();
    const __m512i low_half = _mm512_set1_epi8(0x0f);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        if constexpr (R == 1) {
            prefetch(chunk + PREFETCH_AHEAD, CHUNK);
            prefetch(chunk + PREFETCH_L2_AHEAD, CHUNK, true);
        }
        __m512i coarse[R], fine[R];
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) coarse[r] = fine[r] = _mm512_setzero_si512();
        TFORMER_UNROLLED
        for (int j = 0; j < 4; ++j) {
            const __m512i bytes = _mm512_loadu_si512(chunk + 64 * j);
            const __m512i low = _mm512_and_si512(bytes, low_half);
            const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_half);
            TFORMER_UNROLLED
            for (int r = 0; r < R; ++r) {
                const int32_t* quads = reinterpret_cast<const int32_t*>(q + 2 * (r * K + b * BLOCK));
                coarse[r] = _mm512_dpbusd_epi32(coarse[r], low, _mm512_set1_epi32(quads[j]));
                fine[r] = _mm512_dpbusd_epi32(fine[r], low, _mm512_set1_epi32(quads[8 + j]));
            }
            TFORMER_UNROLLED
            for (int r = 0; r < R; ++r) {
                const int32_t* quads = reinterpret_cast<const int32_t*>(q + 2 * (r * K + b * BLOCK));
                coarse[r] = _mm512_dpbusd_epi32(coarse[r], high, _mm512_set1_epi32(quads[4 + j]));
                fine[r] = _mm512_dpbusd_epi32(fine[r], high, _mm512_set1_epi32(quads[12 + j]));
            }
        }
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 256)));
        const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 288)));
        TFORMER_UNROLLED
        for (int r = 0; r < R; ++r) {
            const int64_t i = r * (K / BLOCK) + b;
            const __m512 scaled = _mm512_mul_ps(scale, _mm512_set1_ps(d[i]));
            coarse_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(coarse[r]), scaled, coarse_acc[r]);
            fine_acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine[r]), scaled, fine_acc[r]);
            fine_acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(sums[i]), fine_acc[r]);
        }
    }
    TFORMER_UNROLLED
    for (int r = 0; r < R; ++r) store16(out + r * N, _mm512_fmadd_ps(coarse_acc[r], _mm512_set1_ps(FINE), fine_acc[r]));
}

// Output rows t*16 .. t*16+15 (the tile at w_tile) for all M rows of the quantized activations, ROWS at a time.
template <typename T>
static inline void tile_all_rows(const uint8_t* w_tile, int64_t M, int64_t K, int64_t N, const int8_t* q,
                                 const float* d, const float* sums, T* out_tile) {
    const int64_t blocks = K / BLOCK;
    int64_t m = 0;
    const auto rows = [&](auto r) {
        constexpr int R = decltype(r)::value;
        tile_rows<R>(w_tile, blocks, q + 2 * m * K, d + m * blocks, sums + m * blocks, K, N, out_tile + m * N);
        m += R;
    };
    while (M - m >= ROWS) rows(std::integral_constant<int, ROWS>());
    switch (M - m) {  // the last rows, fewer than ROWS, in one pass
        case 5: rows(std::integral_constant<int, 5>()); break;
        case 4: rows(std::integral_constant<int, 4>()); break;
        case 3: rows(std::integral_constant<int, 3>()); break;
        case 2: rows(std::integral_constant<int, 2>()); break;
        case 1: rows(std::integral_constant<int, 1>());
    }
}

template <typename T>
static void matmul_vnni(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    quantize_blocks(x, M * blocks, q, d, sums, threads);
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < tiles; ++t) tile_all_rows(w + t * blocks * CHUNK, M, K, N, q, d, sums, out + t * TILE);
}

// Groups of rows, each times its own weight (a mixture's experts over the tokens routed to each): group g's rows
// are starts[g] .. starts[g + 1] - 1 of x and of out. The activations are quantized in one pass and all groups'
// tiles run in one parallel region; each thread takes a contiguous run of (group, tile) units holding its share of
// the rows x tiles, so that uneven groups still split evenly and a thread still streams its weights in order.
// Each row's numbers are those of `matmul_vnni` on its group alone (rows never depend on other rows).
template <typename T>
static void grouped_vnni(const T* x, const int64_t* starts, int64_t G, int64_t K, const uint8_t* const* w,
                         int64_t N, T* out, int threads, int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE, M = starts[G], total = M * tiles;
    quantize_blocks(x, M * blocks, q, d, sums, threads);
    #pragma omp parallel num_threads(threads) if (total > 4)
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        const int64_t begin = total * i / n, end = total * (i + 1) / n;  // this thread's share of the work
        for (int64_t g = 0; g < G; ++g) {
            const int64_t count = starts[g + 1] - starts[g], base = starts[g] * tiles;
            if (count == 0 || base >= end || base + count * tiles <= begin) continue;
            // the units (g, t) whose work starts, at base + t * count, inside [begin, end)
            const int64_t first = begin > base ? (begin - base + count - 1) / count : 0;
            const int64_t last = std::min(tiles, (end - base + count - 1) / count);
            const int64_t row = starts[g];
            for (int64_t t = first; t < last; ++t)
                tile_all_rows(w[g] + t * blocks * CHUNK, count, K, N, q + 2 * row * K, d + row * blocks,
                              sums + row * blocks, out + row * N + t * TILE);
        }
    }
}
#endif

#ifdef TFORMER_AVX2
// Each block of 32 activations as the portable loop rounds it, 8 at a time (the block's sum in another order).
template <typename T>
static void quantize_blocks_avx2(const T* x, int64_t count, int8_t* q, float* d, float* sums, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (count > 512)
    for (int64_t i = 0; i < count; ++i) {
        __m256 v[4], magnitude = _mm256_setzero_ps(), total = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.f);
        for (int j = 0; j < 4; ++j) {
            v[j] = load8(x + i * BLOCK + 8 * j);
            magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, v[j]));
            total = _mm256_add_ps(total, v[j]);
        }
        const float largest = reduce_max8(magnitude);
        const __m256 inverse = _mm256_set1_ps(largest > 0.f ? 127.f / largest : 0.f);
        __m256i coarse[4], fine[4];
        for (int j = 0; j < 4; ++j) {
            const __m256 scaled = _mm256_mul_ps(v[j], inverse);
            const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            coarse[j] = _mm256_cvtps_epi32(rounded);
            fine[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(FINE)));
        }
        int8_t* out = q + 2 * i * BLOCK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), pack_int8(coarse));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + BLOCK), pack_int8(fine));
        d[i] = largest / (127.f * FINE);
        sums[i] = reduce_add8(total);  // a NaN anywhere in the block reaches the output
    }
}

// Output rows t*16 .. t*16+15 for R input rows, one half of 8 rows at a time. vpmaddubsw multiplies the unsigned
// 4-bit weights by the activations and sums pairs into 16 bits: a block's 8 such sums stay below 8 * 2 * 15 * 127
// = 30,480, so they add in 16 bits before vpmaddwd widens them once a block.
template <int R, typename T>
static inline void half_rows_avx2(const uint8_t* w_tile, int64_t blocks, int h, const int8_t* q, const float* d,
                                  const float* sums, int64_t K, int64_t N, T* out) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const __m256i low_half = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        __m256i low[4], high[4];
        for (int j = 0; j < 4; ++j) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * j + 32 * h));
            low[j] = _mm256_and_si256(bytes, low_half);
            high[j] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_half);
        }
        const auto halves = reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h);
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(halves));
        const __m256 minimum = _mm256_cvtph_ps(_mm_loadu_si128(halves + 2));  // 32 bytes on
        for (int r = 0; r < R; ++r) {
            const int32_t* quads = reinterpret_cast<const int32_t*>(q + 2 * (r * K + b * BLOCK));
            __m256i coarse = _mm256_setzero_si256(), fine = _mm256_setzero_si256();
            for (int j = 0; j < 4; ++j) {
                coarse = _mm256_add_epi16(coarse, _mm256_maddubs_epi16(low[j], _mm256_set1_epi32(quads[j])));
                coarse = _mm256_add_epi16(coarse, _mm256_maddubs_epi16(high[j], _mm256_set1_epi32(quads[4 + j])));
                fine = _mm256_add_epi16(fine, _mm256_maddubs_epi16(low[j], _mm256_set1_epi32(quads[8 + j])));
                fine = _mm256_add_epi16(fine, _mm256_maddubs_epi16(high[j], _mm256_set1_epi32(quads[12 + j])));
            }
            const __m256i dot = _mm256_add_epi32(
                _mm256_mullo_epi32(_mm256_madd_epi16(coarse, ones), _mm256_set1_epi32(int32_t(FINE))),
                _mm256_madd_epi16(fine, ones));
            const int64_t i = r * (K / BLOCK) + b;
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(scale, _mm256_set1_ps(d[i])), acc[r]);
            acc[r] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(sums[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) store8(out + r * N + 8 * h, acc[r]);
}

// Keeps a running sum where it is: without it GCC reorders the 16-bit adds into a tree, which holds all 32
// products of a block at once and spills half of them to the stack.
static inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// Output rows t*16 .. t*16+15 for one input row: both halves in one pass over the chunk, so each activation
// broadcast feeds two multiplies and the two accumulators are independent. `vpmaddwd` by 254 folds the coarse
// sums into the fine ones without a 32-bit multiply (at most 2 * 30,480 * 254, inside int32).
// A thread's tiles are contiguous, so it streams its weights in order; asking for the chunk 8 ahead of the one it
// multiplies (the next tile's, near a tile's end) made SmolLM2's four INT4 layers at one row 11-13% faster on Zen 3
// (2 threads, weights out of the CPU's caches, one process alternating the two builds: 145.5-157.1 against
// 166.8-176.9 us a layer; 4 chunks ahead 150.3, 16 ahead 145.8, 32 ahead 147.3).
template <typename T>
static inline void tile_row_avx2(const uint8_t* w_tile, int64_t blocks, const int8_t* q, const float* d,
                                 const float* sums, T* out) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256i low_half = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i fine_weight = _mm256_set1_epi16(int16_t(FINE));
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* chunk = w_tile + b * CHUNK;
        prefetch(chunk + PREFETCH_AHEAD, CHUNK);
        const int32_t* quads = reinterpret_cast<const int32_t*>(q + 2 * b * BLOCK);
        __m256i coarse[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        __m256i fine[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int j = 0; j < 4; ++j) {
            const __m256i coarse_low = _mm256_set1_epi32(quads[j]), coarse_high = _mm256_set1_epi32(quads[4 + j]);
            const __m256i fine_low = _mm256_set1_epi32(quads[8 + j]), fine_high = _mm256_set1_epi32(quads[12 + j]);
            for (int h = 0; h < 2; ++h) {
                const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64 * j + 32 * h));
                const __m256i low = _mm256_and_si256(bytes, low_half);
                const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_half);
                coarse[h] = _mm256_add_epi16(coarse[h], _mm256_maddubs_epi16(low, coarse_low));
                coarse[h] = _mm256_add_epi16(coarse[h], _mm256_maddubs_epi16(high, coarse_high));
                fine[h] = _mm256_add_epi16(fine[h], _mm256_maddubs_epi16(low, fine_low));
                fine[h] = _mm256_add_epi16(fine[h], _mm256_maddubs_epi16(high, fine_high));
                in_register(coarse[h]);
                in_register(fine[h]);
            }
        }
        const __m256 block_scale = _mm256_set1_ps(d[b]), block_sum = _mm256_set1_ps(sums[b]);
        for (int h = 0; h < 2; ++h) {
            const auto halves = reinterpret_cast<const __m128i*>(chunk + 256 + 16 * h);
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(coarse[h], fine_weight),
                                                 _mm256_madd_epi16(fine[h], ones));
            const __m256 scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(halves)), block_scale);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[h]);
            acc[h] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(halves + 2)), block_sum, acc[h]);
        }
    }
    store8(out, acc[0]);
    store8(out + 8, acc[1]);
}

template <typename T>
static void matmul_avx2(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads,
                        int8_t* q, float* d, float* sums) {
    const int64_t blocks = K / BLOCK, tiles = N / TILE;
    quantize_blocks_avx2(x, M * blocks, q, d, sums, threads);
    if (M == 1) {
        #pragma omp parallel for num_threads(threads) schedule(static) if (tiles > 4)
        for (int64_t t = 0; t < tiles; ++t) tile_row_avx2(w + t * blocks * CHUNK, blocks, q, d, sums, out + t * TILE);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles * M > 4)
    for (int64_t t = 0; t < 2 * tiles; ++t) {  // half tiles: 8 output rows each
        const uint8_t* w_tile = w + (t / 2) * blocks * CHUNK;
        const int h = int(t % 2);
        T* at = out + (t / 2) * TILE;
        int64_t m = 0;
        for (; m + ROWS_AVX2 <= M; m += ROWS_AVX2)
            half_rows_avx2<ROWS_AVX2>(w_tile, blocks, h, q + 2 * m * K, d + m * blocks, sums + m * blocks, K, N,
                                 at + m * N);
        for (; m < M; ++m)
            half_rows_avx2<1>(w_tile, blocks, h, q + 2 * m * K, d + m * blocks, sums + m * blocks, K, N, at + m * N);
    }
}
#endif

extern "C" const char* int4_instructions() { return KERNEL_INSTRUCTIONS; }  // "AVX512-VNNI", "AVX2" or "portable"

// x (M, K) times the packed weight (N / 16, K / 32, 320) into out (M, N); K % 32 == 0 and N % 16 == 0.
// Returns 0, or -1 (computing nothing) when the scratch for the quantized activations cannot be allocated.
template <typename T>
static int matmul(const T* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, T* out, int threads, bool portable) {
    const int64_t count = M * (K / BLOCK);
    if (count == 0) return 0;  // no rows (or no columns): nothing to compute
    const int64_t q_bytes = ((2 * M * K + 63) / 64) * 64;
    const ScratchMemory scratch(q_bytes + 2 * count * sizeof(float));
    int8_t* q = static_cast<int8_t*>(scratch.data());
    if (q == nullptr) return -1;
    float* scales = reinterpret_cast<float*>(q + q_bytes);
#ifdef TFORMER_VNNI
    if (!portable) matmul_vnni(x, M, K, w, N, out, threads, q, scales, scales + count);
#endif
#ifdef TFORMER_AVX2
    if (!portable) matmul_avx2(x, M, K, w, N, out, threads, q, scales, scales + count);
#endif
    if (portable || !VECTORIZED) matmul_portable(x, M, K, w, N, out, threads, q, scales, scales + count);
    return 0;
}

// tformer::int4_matmul(Tensor x, Tensor packed, int out_features, bool portable=False) -> Tensor, defined in int4.py.
static Tensor int4_matmul_op(Tensor x, Tensor packed, int64_t out_features, bool portable) {
    return chunked_matmul_op("int4_matmul", x, packed, out_features, portable, TILE, BLOCK, CHUNK,
                             [](auto... args) { return matmul(args...); });
}

// Groups of rows of x (M, K), each times its own packed weight: starts (G + 1) the groups' first rows, then M.
// Returns 0, or -1 (computing nothing) when the scratch for the quantized activations cannot be allocated.
template <typename T>
static int grouped(const T* x, const int64_t* starts, int64_t G, int64_t K, const uint8_t* const* w, int64_t N,
                   T* out, int threads, bool portable) {
    const int64_t M = starts[G], count = M * (K / BLOCK);
    if (count == 0) return 0;
#ifdef TFORMER_VNNI
    if (!portable) {
        const int64_t q_bytes = ((2 * M * K + 63) / 64) * 64;
        const ScratchMemory scratch(q_bytes + 2 * count * sizeof(float));
        int8_t* q = static_cast<int8_t*>(scratch.data());
        if (q == nullptr) return -1;
        float* scales = reinterpret_cast<float*>(q + q_bytes);
        grouped_vnni(x, starts, G, K, w, N, out, threads, q, scales, scales + count);
        return 0;
    }
#endif
    for (int64_t g = 0; g < G; ++g)  // elsewhere one matmul per group
        if (matmul(x + starts[g] * K, starts[g + 1] - starts[g], K, w[g], N, out + starts[g] * N, threads, portable))
            return -1;
    return 0;
}

// tformer::int4_grouped_matmul(Tensor x, Tensor[] packed, int[] counts, int out_features, bool portable=False)
// -> Tensor, defined in int4.py: rows counts[0] of x times packed[0], the next counts[1] times packed[1], ...
static Tensor int4_grouped_matmul_op(Tensor x, std::vector<Tensor> packed, std::vector<int64_t> counts,
                                     int64_t out_features, bool portable) {
    using torch::headeronly::ScalarType;
    const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
    if (!bf16 && x.scalar_type() != ScalarType::Float)
        throw std::invalid_argument("int4_grouped_matmul: x must be bfloat16 or float32");
    if (x.dim() != 2 || packed.size() != counts.size() || out_features % TILE)
        throw std::invalid_argument("int4_grouped_matmul: x (M, K) and one packed weight per count");
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    const int64_t G = int64_t(packed.size()), M = x.size(0), K = x.size(1), N = out_features;
    std::vector<int64_t> starts(G + 1, 0);
    std::vector<const uint8_t*> w(G);
    for (int64_t g = 0; g < G; ++g) {
        const Tensor& p = packed[g];
        if (p.scalar_type() != ScalarType::Byte || p.dim() != 3 || p.size(0) != N / TILE || p.size(1) * BLOCK != K ||
            p.size(2) != CHUNK || !p.is_contiguous() || counts[g] < 0)
            throw std::invalid_argument("int4_grouped_matmul: each packed weight contiguous uint8 chunks (N / 16, "
                                        "K / 32, 320) for N = out_features, and counts >= 0");
        starts[g + 1] = starts[g] + counts[g];
        w[g] = static_cast<const uint8_t*>(p.data_ptr());
    }
    if (starts[G] != M) throw std::invalid_argument("int4_grouped_matmul: the counts must sum to x's rows");
    Tensor out = torch::stable::new_empty(x, {M, N});
    const int threads = int(torch::stable::get_num_threads());
    const int status = bf16 ? grouped(static_cast<const uint16_t*>(x.data_ptr()), starts.data(), G, K, w.data(), N,
                                      static_cast<uint16_t*>(out.data_ptr()), threads, portable)
                            : grouped(static_cast<const float*>(x.data_ptr()), starts.data(), G, K, w.data(), N,
                                      static_cast<float*>(out.data_ptr()), threads, portable);
    if (status) throw std::runtime_error("int4_grouped_matmul: no memory for the quantized activations");
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("int4_matmul", TORCH_BOX(&int4_matmul_op));
    m.impl("int4_grouped_matmul", TORCH_BOX(&int4_grouped_matmul_op));
}
