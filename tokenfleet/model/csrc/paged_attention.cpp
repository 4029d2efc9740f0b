// Decode attention straight over the paged KV cache on the CPU: each (sequence, KV head) reads its keys and
// values once, through its block table, instead of gathering them into a padded copy first.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

struct Shape {
  int64_t heads, kv_heads, head_dim, slots, table_width, block_size;
};

// Calls fn(t, row) for each of the first `len` token rows of a sequence, walking its block table block by block.
template <typename T, typename Fn>
inline void for_each_token(const T* cache, const int64_t* table, int64_t len, const Shape& s, Fn&& fn) {
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const T* block = cache + table[b] * s.block_size * s.head_dim;
    const int64_t stop = std::min(s.block_size, len - t);
    for (int64_t i = 0; i < stop; ++i, ++t) fn(t, block + i * s.head_dim);
  }
}

// Scores of query heads g (pre-scaled, float) against every context token. Keys are stored transposed inside a
// block ([head_dim][block_size]), so a block's scores are head_dim vector multiply-adds, with no horizontal sums.
template <typename T>
void block_scores(const float* qf, const T* k, const int64_t* table, int64_t len, const Shape& s, int64_t G,
                  float* scores) {
  const int64_t D = s.head_dim, B = s.block_size;
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += B, ++b) {
    const T* block = k + table[b] * B * D;
    const int64_t stop = std::min(B, len - t0);
    for (int64_t g = 0; g < G; ++g) {
      float* row = scores + g * len + t0;
      const float* qg = qf + g * D;
      float acc[256] = {0.f};  // block_size <= 256 (checked by the caller)
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qg[d];
        const T* keys = block + d * B;
#pragma omp simd
        for (int64_t i = 0; i < B; ++i) acc[i] += qd * as_float(keys[i]);
      }
      std::copy(acc, acc + stop, row);
    }
  }
}

// One sequence, one KV head and the G query heads that share it: scores, softmax, weighted sum of values.
template <typename T>
void attend_one(const T* q, const T* k, const T* v, const int64_t* table, int64_t len, T* out,
                const Shape& s, float scale, std::vector<float>& qf, std::vector<float>& scores,
                std::vector<float>& acc) {
  const int64_t G = s.heads / s.kv_heads, D = s.head_dim;
  for (int64_t i = 0; i < G * D; ++i) qf[i] = as_float(q[i]) * scale;
  scores.resize(G * len);
  block_scores<T>(qf.data(), k, table, len, s, G, scores.data());
  float inv_sum[64];  // G <= 64 query heads per KV head (checked by the caller)
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores.data() + g * len;
    const float peak = *std::max_element(row, row + len);
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] = expf(row[t] - peak);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += row[t];
    inv_sum[g] = 1.f / sum;
  }
  std::fill(acc.begin(), acc.end(), 0.f);
  for_each_token(v, table, len, s, [&](int64_t t, const T* value) {
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[g * len + t];
      float* ag = acc.data() + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * as_float(value[d]);
    }
  });
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
}

template <typename T>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
            const at::Tensor& lens, at::Tensor& out, const Shape& s, float scale) {
  const int64_t n = q.size(0), G = s.heads / s.kv_heads, D = s.head_dim;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores, acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, kh = item % s.kv_heads;
      const int64_t head_offset = (seq * s.heads + kh * G) * D;
      attend_one<T>(qp + head_offset, kp + kh * s.slots * D, vp + kh * s.slots * D, tp + seq * s.table_width,
                    lp[seq], op + head_offset, s, scale, qf, scores, acc);
    }
  });
}

}  // namespace

// q: [n, H, D]; k_cache, v_cache: [KVH, blocks, block_size * D] (keys [D][block_size] inside a block, values
// [block_size][D]); block_tables: [n, W] int64; context_lens: [n] int64.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= 64, "unsupported head grouping");
  TORCH_CHECK(block_size <= 256, "block_size above 256 is not supported by the CPU kernel");
  auto out = at::empty_like(q);
  const Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1) * block_size, tables.size(1), block_size};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q, k_cache, v_cache, tables, lens, out, s, static_cast<float>(scale));
  });
  return out;
}
