// Fused elementwise kernels for serving bfloat16 activations (see elementwise.py): RMSNorm, the rotary embedding
// and SwiGLU's SiLU-gated product, each one pass over memory where torch's eager formula runs 4-10 ops.
// Built by tformer.inference.native.load (-O3 -march=native -fopenmp) against torch's stable C ABI, which
// registers the ops at the end. Plain loops: the compiler vectorizes them for whatever the CPU has.
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

// bfloat16 <-> float without branches, so that loops over them vectorize; rounds to nearest even as torch does.
static inline float bf16_float(uint16_t x) {
    return __builtin_bit_cast(float, uint32_t(x) << 16);
}
static inline uint16_t float_bf16(float x) {
    const uint32_t bits = __builtin_bit_cast(uint32_t, x);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t((bits >> 16) | 0x40u) : uint16_t(rounded);  // NaN stays
}

// exp(x) in float: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r is exact), then 2^n e^r with e^r a
// degree-6 polynomial (Cephes' expf coefficients): within 2 ulp of the exact value. Branch-free, so it vectorizes.
static inline float exp_float(float x) {
    x = x < -87.33654f ? -87.33654f : x > 88.72283f ? 88.72283f : x;  // e^x stays a normal float
    const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // rounded: 1.5 * 2^23 leaves no fraction
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const float scale = __builtin_bit_cast(float, (int32_t(n) + 127) << 23);  // 2^n for n in [-126, 127]
    return n > 127.f ? p * 2.f * 1.70141183e38f : p * scale;
}

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
        #pragma omp simd
        for (int64_t k = 0; k < dim; ++k) {
            const float v = bf16_float(g[k]);
            const float silu = bf16_float(float_bf16(v / (1.f + exp_float(-v))));
            o[k] = float_bf16(silu * bf16_float(u[k]));
        }
    }
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
