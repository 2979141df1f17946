// One query per beam over keys that beams share without copies (see beam_attention.py).
//
// q (R, H, D): row r's query heads; k, v (rows, Hkv, L, D): a cache whose row r holds the keys its beam wrote; the
// table (R, T) names, for each beam and position t < T, the cache row that holds that beam's key at t (a beam that
// continues another shares that one's earlier keys). out (R, H, D) = softmax(scale q K^T) V, the scores and sums
// in fp32. Query heads h * H / Hkv .. (h + 1) * H / Hkv - 1 read KV head h. One task per (row, KV head).
#include "native.h"

#include <omp.h>

template <typename T>
static void attend(const T* q, const T* k, const T* v, const int64_t* table, T* out, int64_t R, int64_t H,
                   int64_t Hkv, int64_t n_keys, int64_t L, int64_t D, float scale, int threads) {
    const int64_t group = H / Hkv;
    // a thread's share should outweigh waking it: a few thousand products at least
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && R * H * n_keys * D >= 65536)
    for (int64_t task = 0; task < R * Hkv; ++task) {
        const int64_t r = task / Hkv, g = task % Hkv;
        const int64_t* rows = table + r * n_keys;
        std::vector<float> scores(group * n_keys), query(group * D), acc(group * D, 0.f);
        for (int64_t j = 0; j < group; ++j)
            for (int64_t d = 0; d < D; ++d) query[j * D + d] = to_float(q[(r * H + g * group + j) * D + d]) * scale;
        for (int64_t t = 0; t < n_keys; ++t) {
            const T* key = k + ((rows[t] * Hkv + g) * L + t) * D;
            for (int64_t j = 0; j < group; ++j) {
                const float* qj = query.data() + j * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qj[d] * to_float(key[d]);
                scores[j * n_keys + t] = s;
            }
        }
        for (int64_t j = 0; j < group; ++j) {
            float* row = scores.data() + j * n_keys;
            float top = row[0];
            for (int64_t t = 1; t < n_keys; ++t) top = std::fmax(top, row[t]);
            float sum = 0.f;
            for (int64_t t = 0; t < n_keys; ++t) {
                row[t] = std::exp(row[t] - top);
                sum += row[t];
            }
            const float inverse = 1.f / sum;
            for (int64_t t = 0; t < n_keys; ++t) row[t] *= inverse;
        }
        for (int64_t t = 0; t < n_keys; ++t) {
            const T* value = v + ((rows[t] * Hkv + g) * L + t) * D;
            for (int64_t j = 0; j < group; ++j) {
                const float w = scores[j * n_keys + t];
                float* a = acc.data() + j * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] += w * to_float(value[d]);
            }
        }
        for (int64_t j = 0; j < group; ++j)
            for (int64_t d = 0; d < D; ++d) store(out + (r * H + g * group + j) * D + d, acc[j * D + d]);
    }
}

extern "C" {
void beam_attention_f32(const float* q, const float* k, const float* v, const int64_t* table, float* out, int64_t R,
                        int64_t H, int64_t Hkv, int64_t n_keys, int64_t L, int64_t D, float scale, int threads) {
    attend(q, k, v, table, out, R, H, Hkv, n_keys, L, D, scale, threads);
}
void beam_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* table,
                         uint16_t* out, int64_t R, int64_t H, int64_t Hkv, int64_t n_keys, int64_t L, int64_t D,
                         float scale, int threads) {
    attend(q, k, v, table, out, R, H, Hkv, n_keys, L, D, scale, threads);
}
}
