// W8A8: int8 weights per output channel times int8 activations per token, on the CPU's integer dot products (format:
// w8a8.py). Built by native.load (-O3 -march=native -fopenmp) against torch's stable C ABI, which registers the op.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"
using torch::stable::Tensor;

constexpr int64_t TILE = 16;  // output rows a tile holds; its bytes: K/4 groups of 16 rows x 4 columns
constexpr int64_t ROWS = 4;   // input rows that share each weight load
// Bytes ahead in a tile's weights to ask for, into L1 and, further ahead, into L2 alone (AVX-512 loop): docs/engine.md
constexpr int64_t PREFETCH_AHEAD = 2048, PREFETCH_L2_AHEAD = 16384;

// The stored byte of weight (n, k): q + 128, so that the dot products read weights as unsigned bytes.
static inline int weight_at(const uint8_t* w, int64_t padded_k, int64_t n, int64_t k) {
    return w[(n / TILE) * TILE * padded_k + (k / 4) * 64 + (n % TILE) * 4 + k % 4];
}

// Each row x becomes q = round(x * 127 / max|x|) in [-127, 127] with the scale max|x| / 127 (NaN where x holds a
// NaN: it then reaches every output of the row), and 128 * Σ q, which the unsigned weights' offset adds to every
// dot product. Columns K .. padded_k - 1 are zeros. With a second row (`fine`), the remainder becomes
// r = round(FINE * (x * 127 / max|x| - q)) with the scale max|x| / (127 FINE): x ≈ (FINE q + r) max|x| / (127 FINE)
// (FINE and `remainder_int8` in native.h, shared with the int4 kernel).

struct QuantRow { int8_t* q; float* scale; int32_t* offset; };  // one quantized row: its bytes, scale and offset

template <typename T>
static void quantize_row_portable(const T* x, int64_t K, int64_t padded_k, QuantRow row, const QuantRow* fine) {
    float largest = 0.f;
    bool nan = false;
    for (int64_t k = 0; k < K; ++k) {
        const float value = to_float(x[k]);
        nan = nan || std::isnan(value);
        largest = std::fmax(largest, std::fabs(value));
    }
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    int32_t sum = 0, fine_sum = 0;
    for (int64_t k = 0; k < K; ++k) {
        const float scaled = to_float(x[k]) * inverse, rounded = std::nearbyint(scaled);
        row.q[k] = to_int8(rounded);
        sum += row.q[k];
        if (fine) {
            fine->q[k] = remainder_int8(scaled, rounded);
            fine_sum += fine->q[k];
        }
    }
    std::memset(row.q + K, 0, padded_k - K);
    *row.scale = nan ? NAN : largest / 127.f;
    *row.offset = 128 * sum;
    if (fine) {
        std::memset(fine->q + K, 0, padded_k - K);
        *fine->scale = nan ? NAN : largest / (127.f * FINE);
        *fine->offset = 128 * fine_sum;
    }
}

template <typename T>
static void matmul_portable(const int8_t* q, const float* row_scales, const int32_t* offsets, int64_t M,
                            int64_t padded_k, const uint8_t* w, const float* scales, int64_t N, T* out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * N > 4096)
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t m = 0; m < M; ++m) {
            int32_t dot = 0;
            for (int64_t k = 0; k < padded_k; ++k) dot += weight_at(w, padded_k, n, k) * q[m * padded_k + k];
            store(out + m * N + n, float(dot - offsets[m]) * (scales[n] * row_scales[m]));
        }
    }
}

#ifdef TFORMER_VNNI
static inline __m512 load_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
static inline __m512 load_masked(const uint16_t* p, __mmask16 mask) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512i clamp_int8(__m512i x) {  // to [-127, 127]; a NaN converted to INT_MIN becomes -127
    return _mm512_max_epi32(_mm512_min_epi32(x, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
}

template <typename T>
static void quantize_row(const T* x, int64_t K, int64_t padded_k, QuantRow row, const QuantRow* fine) {
    __m512 largest = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
        const __m512 v = load_masked(x + k, mask);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(largest);
    const __m512 inverse = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m512i sum = _mm512_setzero_si512(), fine_sum = _mm512_setzero_si512();
    std::memset(row.q + K, 0, padded_k - K);
    if (fine) std::memset(fine->q + K, 0, padded_k - K);
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
        const __m512 scaled = _mm512_mul_ps(load_masked(x + k, mask), inverse);
        const __m512i clamped = clamp_int8(_mm512_cvtps_epi32(scaled));  // rounds to nearest even
        _mm_mask_storeu_epi8(row.q + k, mask, _mm512_cvtepi32_epi8(clamped));
        sum = _mm512_add_epi32(sum, _mm512_maskz_mov_epi32(mask, clamped));
        if (fine) {
            const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i rest = clamp_int8(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(FINE))));
            _mm_mask_storeu_epi8(fine->q + k, mask, _mm512_cvtepi32_epi8(rest));
            fine_sum = _mm512_add_epi32(fine_sum, _mm512_maskz_mov_epi32(mask, rest));
        }
    }
    *row.scale = nan ? NAN : top / 127.f;
    *row.offset = 128 * _mm512_reduce_add_epi32(sum);
    if (fine) {
        *fine->scale = nan ? NAN : top / (127.f * FINE);
        *fine->offset = 128 * _mm512_reduce_add_epi32(fine_sum);
    }
}

// Output rows n0 .. n0 + 16 * TILES - 1 for R input rows; each 64-byte weight load feeds R dot products. Unrolled, and
// without GCC's partial redundancy elimination, which copied every accumulator twice a step (docs/engine.md).
#pragma GCC push_options
#pragma GCC optimize("no-tree-pre")
template <int R, int TILES, typename T>
static inline void tiles_rows(const uint8_t* w, int64_t padded_k, const int8_t* q, const float* row_scales,
                              const int32_t* offsets, const float* scales, int64_t N, int64_t n0, T* out) {
    __m512i acc[TILES][R] = {};  // zeros
    const uint8_t* tile = w + (n0 / TILE) * TILE * padded_k;
    for (int64_t k4 = 0; k4 < padded_k / 4; ++k4) {
        __m512i weights[TILES];
        TFORMER_UNROLLED for (int t = 0; t < TILES; ++t) {
            const uint8_t* at = tile + t * TILE * padded_k + k4 * 64;
            _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_AHEAD), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_L2_AHEAD), _MM_HINT_T1);
            weights[t] = _mm512_loadu_si512(at);
        }
        TFORMER_UNROLLED for (int r = 0; r < R; ++r) {
            const __m512i quad = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(q + r * padded_k)[k4]);
            TFORMER_UNROLLED for (int t = 0; t < TILES; ++t)
                acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], weights[t], quad);
        }
    }
    TFORMER_UNROLLED for (int t = 0; t < TILES; ++t) {
        const int64_t n = n0 + t * TILE;
        const __m512 column_scales = _mm512_loadu_ps(scales + n);
        TFORMER_UNROLLED for (int r = 0; r < R; ++r) {
            const __m512i dot = _mm512_sub_epi32(acc[t][r], _mm512_set1_epi32(offsets[r]));
            const __m512 scale = _mm512_mul_ps(column_scales, _mm512_set1_ps(row_scales[r]));
            const __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), scale);
            if (n + TILE <= N) {
                store16(out + r * N + n, value);
            } else {  // the last tile of a layer whose rows are not a multiple of 16
                alignas(64) float lanes[TILE];
                _mm512_store_ps(lanes, value);
                for (int64_t i = 0; n + i < N; ++i) store(out + r * N + n + i, lanes[i]);
            }
        }
    }
}
#pragma GCC pop_options

template <int TILES, typename T>
static inline void all_rows(const uint8_t* w, int64_t padded_k, const int8_t* q, const float* row_scales,
                            const int32_t* offsets, int64_t M, const float* scales, int64_t N, int64_t n0, T* out) {
    int64_t m = 0;  // 8 rows at a time (16 accumulators and 2 weight registers of the 32), then 4, 2 and 1
    for (; m + 8 <= M; m += 8)
        tiles_rows<8, TILES>(w, padded_k, q + m * padded_k, row_scales + m, offsets + m, scales, N, n0, out + m * N);
    for (; m + ROWS <= M; m += ROWS)
        tiles_rows<ROWS, TILES>(w, padded_k, q + m * padded_k, row_scales + m, offsets + m, scales, N, n0, out + m * N);
    for (; m + 2 <= M; m += 2)  // a token's two rounded rows (`fine`) at batch 1 share each weight load
        tiles_rows<2, TILES>(w, padded_k, q + m * padded_k, row_scales + m, offsets + m, scales, N, n0, out + m * N);
    for (; m < M; ++m)
        tiles_rows<1, TILES>(w, padded_k, q + m * padded_k, row_scales + m, offsets + m, scales, N, n0, out + m * N);
}

template <typename T>
static void matmul_vnni(const int8_t* q, const float* row_scales, const int32_t* offsets, int64_t M, int64_t padded_k,
                        const uint8_t* w, const float* scales, int64_t N, T* out, int threads) {
    const int64_t tiles = (N + TILE - 1) / TILE, units = (tiles + 1) / 2;  // pairs of tiles, and a last single one
    #pragma omp parallel for num_threads(threads) schedule(static) if (units > 1)
    for (int64_t u = 0; u < units; ++u) {
        if (2 * u + 1 < tiles)
            all_rows<2>(w, padded_k, q, row_scales, offsets, M, scales, N, 2 * u * TILE, out);
        else
            all_rows<1>(w, padded_k, q, row_scales, offsets, M, scales, N, 2 * u * TILE, out);
    }
}
#endif

#ifdef TFORMER_AVX2
// Output rows n0 .. n0 + 15 for R input rows. AVX2 has no byte dot product into 32 bits: each weight byte becomes
// signed again (q_w = stored - 128), and vpmaddubsw multiplies |q_w| by the activation given q_w's sign, summing
// pairs into 16 bits (at most 2 * 127 * 127: it never saturates), which vpmaddwd widens to 32. The sum is the
// signed dot product itself, without the offset the VNNI version subtracts. Each half of the tile's 64-byte group
// holds 8 output rows x 4 columns.
template <int R, typename T>
static inline void tile_rows_avx2(const uint8_t* tile, int64_t padded_k, const int8_t* q, const float* row_scales,
                                  const float* scales, int64_t N, int64_t n0, T* out) {
    __m256i acc[2][R];
    for (int h = 0; h < 2; ++h)
        for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_si256();
    const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
    for (int64_t k4 = 0; k4 < padded_k / 4; ++k4) {
        const uint8_t* at = tile + k4 * 64;
        _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256i signed_weights[2], magnitudes[2];
        for (int h = 0; h < 2; ++h) {
            const __m256i stored = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
            signed_weights[h] = _mm256_xor_si256(stored, flip);
            magnitudes[h] = _mm256_abs_epi8(signed_weights[h]);
        }
        for (int r = 0; r < R; ++r) {
            const __m256i quad = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(q + r * padded_k)[k4]);
            for (int h = 0; h < 2; ++h) {
                const __m256i pairs = _mm256_maddubs_epi16(magnitudes[h], _mm256_sign_epi8(quad, signed_weights[h]));
                acc[h][r] = _mm256_add_epi32(acc[h][r], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int h = 0; h < 2; ++h) {
        const int64_t n = n0 + 8 * h, count = N - n < 8 ? N - n : 8;
        if (count <= 0) break;
        const __m256 column_scales = _mm256_loadu_ps(scales + n);  // the scales are padded to whole tiles
        for (int r = 0; r < R; ++r) {
            const __m256 scale = _mm256_mul_ps(column_scales, _mm256_set1_ps(row_scales[r]));
            store8(out + r * N + n, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[h][r]), scale), count);
        }
    }
}

// Rounds 8 values to int8 as `to_int8` does (a NaN, INT_MIN once converted, becomes -127 as in the VNNI version),
// stores their bytes at `out` and adds them to `sum`.
static inline void store_rounded8(__m256 rounded, int8_t* out, __m256i& sum) {
    __m256i whole = _mm256_cvtps_epi32(rounded);
    whole = _mm256_max_epi32(_mm256_min_epi32(whole, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
    sum = _mm256_add_epi32(sum, whole);
    const __m256i words = _mm256_packs_epi32(whole, whole), bytes = _mm256_packs_epi16(words, words);
    const __m256i gathered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(gathered));
}

// `quantize_row_portable` 8 values at a time, for K a multiple of 8.
template <typename T>
static void quantize_row_avx2(const T* x, int64_t K, int64_t padded_k, QuantRow row, const QuantRow* fine) {
    const __m256 magnitude_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 largest = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 v = load8(x + k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        largest = _mm256_max_ps(largest, _mm256_and_ps(v, magnitude_mask));
    }
    const float top = reduce_max8(largest);
    const bool has_nan = _mm256_movemask_ps(nan) != 0;
    const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m256i sum = _mm256_setzero_si256(), fine_sum = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 scaled = _mm256_mul_ps(load8(x + k), inverse);
        const __m256 rounded = _mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        store_rounded8(rounded, row.q + k, sum);
        if (fine) {
            const __m256 rest = _mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(FINE));
            store_rounded8(_mm256_round_ps(rest, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), fine->q + k,
                           fine_sum);
        }
    }
    std::memset(row.q + K, 0, padded_k - K);
    *row.scale = has_nan ? NAN : top / 127.f;
    *row.offset = 128 * reduce_add8(sum);
    if (fine) {
        std::memset(fine->q + K, 0, padded_k - K);
        *fine->scale = has_nan ? NAN : top / (127.f * FINE);
        *fine->offset = 128 * reduce_add8(fine_sum);
    }
}

template <typename T>
static void matmul_avx2(const int8_t* q, const float* row_scales, int64_t M, int64_t padded_k, const uint8_t* w,
                        const float* scales, int64_t N, T* out, int threads) {
    const int64_t tiles = (N + TILE - 1) / TILE;
    #pragma omp parallel for num_threads(threads) schedule(static) if (tiles > 1)
    for (int64_t t = 0; t < tiles; ++t) {
        const uint8_t* tile = w + t * TILE * padded_k;
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS)
            tile_rows_avx2<ROWS>(tile, padded_k, q + m * padded_k, row_scales + m, scales, N, t * TILE, out + m * N);
        for (; m + 2 <= M; m += 2)  // a token's two rounded rows (`fine`) at batch 1 share each weight load
            tile_rows_avx2<2>(tile, padded_k, q + m * padded_k, row_scales + m, scales, N, t * TILE, out + m * N);
        for (; m < M; ++m)
            tile_rows_avx2<1>(tile, padded_k, q + m * padded_k, row_scales + m, scales, N, t * TILE, out + m * N);
    }
}
#endif

extern "C" const char* w8a8_instructions() { return KERNEL_INSTRUCTIONS; }  // "AVX512-VNNI", "AVX2" or "portable"

// The rounded rows of a call: M rows, or 2M with `fine` (row m's two at 2m and 2m + 1), each padded_k bytes, with
// their scales and offsets; with `fine` also the float products of up to 2 FINE_ROWS rows, which sum in pairs into
// the output (for the 49152-column head, 64 rows take 25 MB).
constexpr int64_t FINE_ROWS = 64;
struct Scratch {  // partial: (2 min(M, FINE_ROWS), N) with `fine`, else nullptr
    int8_t* q; float* row_scales; int32_t* offsets; float* partial;
};

template <typename T>
static void multiply(const int8_t* q, const float* row_scales, const int32_t* offsets, int64_t rows, int64_t padded_k,
                     const uint8_t* w, const float* scales, int64_t N, T* out, int threads, bool portable) {
#ifdef TFORMER_VNNI
    if (!portable) return matmul_vnni(q, row_scales, offsets, rows, padded_k, w, scales, N, out, threads);
#endif
#ifdef TFORMER_AVX2
    if (!portable) return matmul_avx2(q, row_scales, rows, padded_k, w, scales, N, out, threads);
#endif
    matmul_portable(q, row_scales, offsets, rows, padded_k, w, scales, N, out, threads);
}

template <typename T>
static void run(const T* x, int64_t M, int64_t K, int64_t padded_k, const uint8_t* w, const float* scales, int64_t N,
                T* out, int threads, bool portable, Scratch scratch) {
    const bool fine = scratch.partial != nullptr;
    const int64_t per_row = fine ? 2 : 1;
    // both threads from 16,384 values (32 rows x 576): 32 x 1,536 27.1-27.7 -> 22.8-23.2 us (docs/engine.md)
    #pragma omp parallel for num_threads(threads) schedule(static) if (M * K >= 16384)
    for (int64_t m = 0; m < M; ++m) {
        const int64_t i = per_row * m;
        const QuantRow row{scratch.q + i * padded_k, scratch.row_scales + i, scratch.offsets + i};
        const QuantRow rest{row.q + padded_k, row.scale + 1, row.offset + 1};
#ifdef TFORMER_VNNI
        if (!portable) {
            quantize_row(x + m * K, K, padded_k, row, fine ? &rest : nullptr);
            continue;
        }
#endif
#ifdef TFORMER_AVX2
        if (!portable && K % 8 == 0) {
            quantize_row_avx2(x + m * K, K, padded_k, row, fine ? &rest : nullptr);
            continue;
        }
#endif
        quantize_row_portable(x + m * K, K, padded_k, row, fine ? &rest : nullptr);
    }
    if (!fine)
        return multiply(scratch.q, scratch.row_scales, scratch.offsets, M, padded_k, w, scales, N, out, threads,
                        portable);
    for (int64_t m0 = 0; m0 < M; m0 += FINE_ROWS) {  // the products of FINE_ROWS rows at a time: a bounded scratch
        const int64_t rows = M - m0 < FINE_ROWS ? M - m0 : FINE_ROWS;
        multiply(scratch.q + 2 * m0 * padded_k, scratch.row_scales + 2 * m0, scratch.offsets + 2 * m0, 2 * rows,
                 padded_k, w, scales, N, scratch.partial, threads, portable);
        #pragma omp parallel for num_threads(threads) schedule(static) if (rows * N > 65536)
        for (int64_t m = 0; m < rows; ++m) {
            const float* coarse = scratch.partial + 2 * m * N;
            for (int64_t n = 0; n < N; ++n) store(out + (m0 + m) * N + n, coarse[n] + coarse[N + n]);
        }
    }
}

// tformer::w8a8_matmul(Tensor x, Tensor packed, Tensor scales, int out_features, bool portable=False,
// bool fine=False) -> Tensor, defined in w8a8.py. The checks repeat the ones the kernel relies on, so a bad call
// raises instead of reading out of bounds.
static Tensor w8a8_matmul_op(Tensor x, Tensor packed, Tensor scales, int64_t out_features, bool portable, bool fine) {
    using torch::headeronly::ScalarType;
    const bool bf16 = x.scalar_type() == ScalarType::BFloat16;
    if (!bf16 && x.scalar_type() != ScalarType::Float)
        throw std::invalid_argument("w8a8_matmul: x must be bfloat16 or float32");
    const int64_t tiles = (out_features + TILE - 1) / TILE;
    if (x.dim() != 2 || packed.scalar_type() != ScalarType::Byte || packed.dim() != 3 || packed.size(0) != tiles ||
        packed.size(2) != 64 || packed.size(1) != (x.size(1) + 3) / 4 || scales.scalar_type() != ScalarType::Float ||
        scales.dim() != 1 || scales.size(0) != tiles * TILE || !packed.is_contiguous() || !scales.is_contiguous())
        throw std::invalid_argument("w8a8_matmul: x (M, K), packed uint8 (ceil(N / 16), ceil(K / 4), 64) and "
                                    "float32 scales (16 ceil(N / 16)) for N = out_features");
    if (!x.is_contiguous()) x = torch::stable::contiguous(x);
    const int64_t M = x.size(0), K = x.size(1), padded_k = 4 * packed.size(1), N = out_features;
    Tensor out = torch::stable::new_empty(x, {M, N});
    if (M == 0) return out;
    const int64_t rows = fine ? 2 * M : M, q_bytes = ((rows * padded_k + 63) / 64) * 64;
    const int64_t partial_rows = fine ? 2 * (M < FINE_ROWS ? M : FINE_ROWS) : 0;
    const int64_t bytes = q_bytes + 8 * rows + partial_rows * N * int64_t(sizeof(float));
    const ScratchMemory memory(bytes);
    int8_t* q = static_cast<int8_t*>(memory.data());
    if (q == nullptr) throw std::runtime_error("w8a8_matmul: no memory for the quantized activations");
    float* row_scales = reinterpret_cast<float*>(q + q_bytes);
    int32_t* offsets = reinterpret_cast<int32_t*>(row_scales + rows);
    const Scratch scratch{q, row_scales, offsets, fine ? reinterpret_cast<float*>(offsets + rows) : nullptr};
    const int threads = int(torch::stable::get_num_threads());
    const uint8_t* w = static_cast<const uint8_t*>(packed.data_ptr());
    const float* s = static_cast<const float*>(scales.data_ptr());
    if (bf16)
        run(static_cast<const uint16_t*>(x.data_ptr()), M, K, padded_k, w, s, N,
            static_cast<uint16_t*>(out.data_ptr()), threads, portable, scratch);
    else
        run(static_cast<const float*>(x.data_ptr()), M, K, padded_k, w, s, N, static_cast<float*>(out.data_ptr()),
            threads, portable, scratch);
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) { m.impl("w8a8_matmul", TORCH_BOX(&w8a8_matmul_op)); }
