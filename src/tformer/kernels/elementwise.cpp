// Fused elementwise kernels for serving bfloat16 activations (see elementwise.py): RMSNorm, the rotary embedding
// and SwiGLU's SiLU-gated product, each one pass over memory where torch's eager formula runs 4-10 ops.
// Built by tformer.inference.native.load (-O3 -march=native -fopenmp) against torch's stable C ABI, which
// registers the ops at the end. RMSNorm and rotary are plain loops the compiler vectorizes for whatever the CPU has;
// SiLU runs on explicit AVX-512 or AVX2 lanes (`Lanes`), a scalar loop of the same operations taking the rest.
#pragma GCC optimize("fp-contract=off")  // every product and sum rounds on its own, as in torch's eager ops
#include <cmath>
#include <cstdint>
#include <stdexcept>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "native.h"

using torch::stable::Tensor;

// Work below this many elements runs on the calling thread: a fork and join costs more than it saves.
constexpr int64_t PARALLEL_ELEMENTS = int64_t(1) << 15;

// exp(x) in float: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), then 2^n e^r with e^r a degree-6
// polynomial (Cephes' expf coefficients) in fused multiply-adds: within 2 ulp of the exact value. x is first
// clamped so that 2^n stays a normal float (e^x below e^-87.3 is 2^-126; above e^88.4 it is 2.4e38). `Lanes`
// does the same operations in the same order on a vector, so every lane equals this function's result (and every
// build on a CPU with multiply-adds gives the same bits). The multiply-adds halve the work of a compute-bound loop
// (SiLU ran at ~1 ns an element on a Xeon whose AVX-512 unit issues one operation a cycle).
constexpr float EXP_LOW = -87.33654f, EXP_HIGH = 88.37626f, LOG2E = 1.44269504088896341f;
constexpr float ROUNDER = 12582912.f;  // 1.5 * 2^23: x + ROUNDER - ROUNDER rounds x to an integer, to nearest even
constexpr float LN2_HIGH = 0.693359375f, LN2_LOW = -2.12194440e-4f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// a * b + c, rounded once where the CPU multiplies and adds in one instruction (every AVX2 and AVX-512 CPU, ARMv8),
// else twice: a CPU without it (x86-64's baseline) would compute std::fma in software, ~30x slower (30 ns a SiLU).
static inline float multiply_add(float a, float b, float c) {
#ifdef __FP_FAST_FMAF
    return std::fma(a, b, c);
#else
    return a * b + c;
#endif
}

static inline float exp_float(float x) {
    x = std::fmin(std::fmax(x, EXP_LOW), EXP_HIGH);
    const float n = multiply_add(x, LOG2E, ROUNDER) - ROUNDER;
    const float r = multiply_add(n, -LN2_LOW, multiply_add(n, -LN2_HIGH, x));
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; ++i) p = multiply_add(p, r, EXP_POLY[i]);
    p = multiply_add(p * r, r, r) + 1.0f;
    return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);  // times 2^n, n in [-126, 127]
}

static inline float silu_float(float g) { return g / (1.f + exp_float(-g)); }

#if defined(__AVX512F__) || defined(TFORMER_AVX2)
// The vector operations exp_float and silu_float need, on 16 lanes (AVX-512) or 8 (AVX2).
struct Lanes {
#if defined(__AVX512F__)
    using V = __m512;
    static constexpr int N = 16;
    static V set(float x) { return _mm512_set1_ps(x); }
    static V add(V a, V b) { return _mm512_add_ps(a, b); }
    static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
    static V div(V a, V b) { return _mm512_div_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
    static V clamp(V x, float low, float high) {  // a NaN becomes `low`, as std::fmax makes it
        return _mm512_min_ps(_mm512_max_ps(x, set(low)), set(high));
    }
    static V pow2(V n) {  // 2^n for integer-valued n in [-126, 127]
        const __m512i exponent = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
        return _mm512_castsi512_ps(_mm512_slli_epi32(exponent, 23));
    }
    static V load(const uint16_t* p) { return load16(p); }
    static void store(uint16_t* p, V v) { store16(p, v); }
    static V round_bf16(V v) {  // v rounded to bfloat16 (to nearest even), still in float; NaN from arithmetic only
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int32_t(0xffff0000u))));
    }
#else
    using V = __m256;
    static constexpr int N = 8;
    static V set(float x) { return _mm256_set1_ps(x); }
    static V add(V a, V b) { return _mm256_add_ps(a, b); }
    static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
    static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
    static V div(V a, V b) { return _mm256_div_ps(a, b); }
    static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
    static V clamp(V x, float low, float high) {  // max(x, low) with x first: a NaN becomes `low`
        return _mm256_min_ps(_mm256_max_ps(x, set(low)), set(high));
    }
    static V pow2(V n) {
        const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
        return _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23));
    }
    static V load(const uint16_t* p) { return load8(p); }
    static V round_bf16(V v) {
        const __m256i bits = _mm256_castps_si256(v);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
        return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(int32_t(0xffff0000u))));
    }
    static void store(uint16_t* p, V v) {  // 8 bfloat16s, rounded to nearest even, a NaN kept quiet
        const __m256i bits = _mm256_castps_si256(v), quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        const __m256i rounded = _mm256_blendv_epi8(_mm256_castps_si256(round_bf16(v)), quiet, nan);
        const __m256i halves = _mm256_packus_epi32(_mm256_srli_epi32(rounded, 16), _mm256_setzero_si256());
        const __m256i packed = _mm256_permute4x64_epi64(halves, 0x08);  // the two lanes' low quadwords together
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    }
#endif
    static V exp(V x) {
        x = clamp(x, EXP_LOW, EXP_HIGH);
        const V n = sub(fma(x, set(LOG2E), set(ROUNDER)), set(ROUNDER));
        const V r = fma(n, set(-LN2_LOW), fma(n, set(-LN2_HIGH), x));
        V p = set(EXP_POLY[0]);
        for (int i = 1; i < 6; ++i) p = fma(p, r, set(EXP_POLY[i]));
        p = add(fma(mul(p, r), r, r), set(1.0f));
        return mul(p, pow2(n));
    }
    static V silu(V g) { return div(g, add(set(1.f), exp(sub(set(0.f), g)))); }
};
#endif

// out[r] = weight * bf16(x[r] / sqrt(mean(x[r]^2) + eps)), each row's sum of squares in 16 running sums.
static void rms_norm_rows(const uint16_t* x, int64_t stride, const uint16_t* weight, uint16_t* out, int64_t rows,
                          int64_t dim, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_ELEMENTS && threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* row = x + r * stride;
        float sums[16] = {};
        int64_t j = 0;
        for (; j + 16 <= dim; j += 16) {
            #pragma omp simd
            for (int l = 0; l < 16; ++l) {
                const float v = bf16_float(row[j + l]);
                sums[l] += v * v;
            }
        }
        for (int l = 0; j < dim; ++j, ++l) sums[l] += bf16_float(row[j]) * bf16_float(row[j]);
        for (int width = 8; width > 0; width /= 2)
            for (int l = 0; l < width; ++l) sums[l] += sums[l + width];
        const float scale = 1.f / std::sqrt(sums[0] / float(dim) + eps);
        uint16_t* o = out + r * dim;
        #pragma omp simd
        for (int64_t k = 0; k < dim; ++k)
            o[k] = float_bf16(bf16_float(weight[k]) * bf16_float(float_bf16(bf16_float(row[k]) * scale)));
    }
}

// x (B, T, H, D) in bfloat16 with any strides but the last, cos and sin (B or 1, T, D) float32:
// out (B, T, H, D) = x cos + rotate_half(x) sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
static void rotary_rows(const uint16_t* x, const int64_t* stride, const float* cos, const float* sin,
                        int64_t angle_batch_stride, uint16_t* out, int64_t B, int64_t T, int64_t H, int64_t D,
                        int threads) {
    const int64_t half = D / 2;
    #pragma omp parallel for collapse(2) num_threads(threads) if (B * T * H * D >= PARALLEL_ELEMENTS && threads > 1)
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const float* c = cos + b * angle_batch_stride + t * D;
            const float* s = sin + b * angle_batch_stride + t * D;
            for (int64_t h = 0; h < H; ++h) {
                const uint16_t* row = x + b * stride[0] + t * stride[1] + h * stride[2];
                uint16_t* o = out + ((b * T + t) * H + h) * D;
                #pragma omp simd
                for (int64_t k = 0; k < half; ++k)
                    o[k] = float_bf16(bf16_float(row[k]) * c[k] + -(bf16_float(row[k + half]) * s[k]));
                #pragma omp simd
                for (int64_t k = half; k < D; ++k)
                    o[k] = float_bf16(bf16_float(row[k]) * c[k] + bf16_float(row[k - half]) * s[k]);
            }
        }
}

// out[r] = bf16(silu(gate[r])) * up[r], silu(g) = g / (1 + e^-g) rounded to bfloat16 first, as torch's two ops do.
static void silu_mul_rows(const uint16_t* gate, int64_t gate_stride, const uint16_t* up, int64_t up_stride,
                          uint16_t* out, int64_t rows, int64_t dim, int threads) {
    #pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_ELEMENTS && threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* g = gate + r * gate_stride;
        const uint16_t* u = up + r * up_stride;
        uint16_t* o = out + r * dim;
        int64_t k = 0;
#if defined(__AVX512F__) || defined(TFORMER_AVX2)
        for (; k + Lanes::N <= dim; k += Lanes::N) {
            const Lanes::V silu = Lanes::round_bf16(Lanes::silu(Lanes::load(g + k)));
            Lanes::store(o + k, Lanes::mul(silu, Lanes::load(u + k)));
        }
#endif
        for (; k < dim; ++k)
            o[k] = float_bf16(bf16_float(float_bf16(silu_float(bf16_float(g[k])))) * bf16_float(u[k]));
    }
}

// The lanes SiLU runs on in this build, for `elementwise.instructions()`: "AVX-512", "AVX2", or "portable" for the
// scalar loop alone (about 10 ns an element on a Xeon against 0.7), which `elementwise.silu_mul` leaves to torch.
extern "C" const char* elementwise_instructions() {
#if defined(__AVX512F__)
    return "AVX-512";
#elif defined(TFORMER_AVX2)
    return "AVX2";
#else
    return "portable";
#endif
}

static bool is_bf16(const Tensor& t) { return t.scalar_type() == torch::headeronly::ScalarType::BFloat16; }
static bool is_float(const Tensor& t) { return t.scalar_type() == torch::headeronly::ScalarType::Float; }
static const uint16_t* bf16_data(const Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); }

// tformer::rms_norm(Tensor x, Tensor weight, float eps) -> Tensor: x (rows, dim) with contiguous rows.
static Tensor rms_norm_op(Tensor x, Tensor weight, double eps) {
    if (!is_bf16(x) || !is_bf16(weight) || x.dim() != 2 || x.stride(1) != 1 || weight.dim() != 1 ||
        weight.size(0) != x.size(1) || !weight.is_contiguous())
        throw std::invalid_argument("rms_norm: x (rows, dim) and weight (dim,) in bfloat16, x's rows contiguous");
    Tensor out = torch::stable::new_empty(x, {x.size(0), x.size(1)});
    rms_norm_rows(bf16_data(x), x.stride(0), bf16_data(weight), static_cast<uint16_t*>(out.data_ptr()), x.size(0),
                  x.size(1), float(eps), int(torch::stable::get_num_threads()));
    return out;
}

// tformer::rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor: x (B, T, H, D), cos and sin (B or 1, T, D).
static Tensor rotary_op(Tensor x, Tensor cos, Tensor sin) {
    if (!is_bf16(x) || !is_float(cos) || !is_float(sin) || x.dim() != 4 || x.stride(3) != 1 || x.size(3) % 2 ||
        cos.dim() != 3 || sin.dim() != 3 || !cos.is_contiguous() || !sin.is_contiguous() ||
        (cos.size(0) != x.size(0) && cos.size(0) != 1) || cos.size(1) != x.size(1) || cos.size(2) != x.size(3) ||
        sin.size(0) != cos.size(0) || sin.size(1) != cos.size(1) || sin.size(2) != cos.size(2))
        throw std::invalid_argument("rotary: x (B, T, H, D) in bfloat16 with D even and contiguous, cos and sin "
                                    "(B or 1, T, D) contiguous float32");
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
    Tensor out = torch::stable::new_empty(x, {B, T, H, D});
    const int64_t stride[3] = {x.stride(0), x.stride(1), x.stride(2)};
    rotary_rows(bf16_data(x), stride, static_cast<const float*>(cos.data_ptr()),
                static_cast<const float*>(sin.data_ptr()), cos.size(0) == 1 ? 0 : T * D,
                static_cast<uint16_t*>(out.data_ptr()), B, T, H, D, int(torch::stable::get_num_threads()));
    return out;
}

// tformer::silu_mul(Tensor gate, Tensor up) -> Tensor: gate and up (rows, dim) with contiguous rows.
static Tensor silu_mul_op(Tensor gate, Tensor up) {
    if (!is_bf16(gate) || !is_bf16(up) || gate.dim() != 2 || up.dim() != 2 || gate.size(0) != up.size(0) ||
        gate.size(1) != up.size(1) || gate.stride(1) != 1 || up.stride(1) != 1)
        throw std::invalid_argument("silu_mul: gate and up (rows, dim) in bfloat16, their rows contiguous");
    Tensor out = torch::stable::new_empty(gate, {gate.size(0), gate.size(1)});
    silu_mul_rows(bf16_data(gate), gate.stride(0), bf16_data(up), up.stride(0), static_cast<uint16_t*>(out.data_ptr()),
                  gate.size(0), gate.size(1), int(torch::stable::get_num_threads()));
    return out;
}

STABLE_TORCH_LIBRARY_IMPL(tformer, CPU, m) {
    m.impl("rms_norm", TORCH_BOX(&rms_norm_op));
    m.impl("rotary", TORCH_BOX(&rotary_op));
    m.impl("silu_mul", TORCH_BOX(&silu_mul_op));
}
