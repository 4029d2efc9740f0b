// Decode attention straight over the paged KV cache on the CPU: each (sequence, KV head) reads its keys and
// values once, through its block table, instead of gathering them into a padded copy first. The cache is in the
// query's dtype or 8-bit floats (FP8 e4m3 / e5m2), dequantized one block at a time as it is read.
// Only the ATen headers it uses and torch/library.h (no torch/extension.h, no pybind11): it compiles in about a
// third of the time, and the op is called through torch.ops.tokenfleet.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

struct Shape {
  int64_t heads, kv_heads, head_dim, slots, table_width, block_size;
};

// How the inner loops see a cache block: in place when the cache holds T, or as floats dequantized once per block
// into a per-thread buffer (shared by the G query heads of a KV head) when it holds FP8 bytes. Dequantization
// scales are applied outside the inner loops: the key scale is folded into the query, the value scale into the
// output.
template <typename T>
struct InPlace {
  using Stored = T;
  using Elem = T;
  const T* operator()(const T* block, int64_t /*count*/, float* /*buffer*/) const { return block; }
};

inline float float_from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint32_t bits_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

// An 8-bit float (M mantissa bits, exponent bias BIAS) to float32 with integer and float operations that compile to
// plain SIMD instructions, no table gathers. Exact for every finite code; the NaN / inf codes are never stored
// (quantizing saturates).
template <int M, int BIAS>
inline float fp8_to_float(uint8_t x) {
  const uint32_t magnitude = x & 0x7Fu;
  // normal: move exponent and mantissa into place and rebias the exponent
  const float normal = float_from_bits((magnitude << (23 - M)) + (static_cast<uint32_t>(127 - BIAS) << 23));
  // subnormal (exponent field 0): mantissa * 2^(1 - BIAS - M), a normal float32
  const float subnormal = static_cast<float>(static_cast<int32_t>(magnitude)) * (1.f / (1u << (BIAS - 1 + M)));
  const float value = magnitude < (1u << M) ? subnormal : normal;
  return float_from_bits(bits_of(value) | (static_cast<uint32_t>(x & 0x80u) << 24));
}

template <int M, int BIAS>
struct Fp8Block {
  using Stored = uint8_t;
  using Elem = float;
  const float* operator()(const uint8_t* block, int64_t count, float* buffer) const {
#pragma omp simd
    for (int64_t i = 0; i < count; ++i) buffer[i] = fp8_to_float<M, BIAS>(block[i]);
    return buffer;
  }
};
using E4m3Block = Fp8Block<3, 7>;
using E5m2Block = Fp8Block<2, 15>;

struct Scales {
  float query;  // softmax scale times the key scale
  float value;
};

// Calls fn(t, row) for each of the first `len` token rows of a sequence, walking its block table block by block.
template <typename Read, typename Fn>
inline void for_each_token(const typename Read::Stored* cache, Read read, float* buffer, const int64_t* table,
                           int64_t len, const Shape& s, Fn&& fn) {
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const int64_t stop = std::min(s.block_size, len - t);
    const auto* block = read(cache + table[b] * s.block_size * s.head_dim, stop * s.head_dim, buffer);
    for (int64_t i = 0; i < stop; ++i, ++t) fn(t, block + i * s.head_dim);
  }
}

// The next block of a sequence is anywhere in the cache (its table's order, not memory's): asked for ahead, it
// arrives while this one is computed, where the hardware prefetcher would only start at its first miss.
template <typename C>
inline void prefetch_block(const C* block, int64_t count) {
  const char* bytes = reinterpret_cast<const char*>(block);
  for (int64_t at = 0; at < count * static_cast<int64_t>(sizeof(C)); at += 64) __builtin_prefetch(bytes + at);
}

// A 16-token block's scores for query heads g: the accumulators have a fixed width, so they live in registers
// (two chains, for the FMA's latency) instead of going through memory on every one of the head_dim steps.
template <typename E>
inline void scores_of_16(const float* qf, const E* block, int64_t D, int64_t G, float* scores, int64_t len,
                         int64_t stop) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    float even[16] = {0.f}, odd[16] = {0.f};
    int64_t d = 0;
    for (; d + 1 < D; d += 2) {
      const E* k0 = block + d * 16;
      const E* k1 = k0 + 16;
      const float q0 = qg[d], q1 = qg[d + 1];
#pragma omp simd
      for (int i = 0; i < 16; ++i) {
        even[i] += q0 * as_float(k0[i]);
        odd[i] += q1 * as_float(k1[i]);
      }
    }
    if (d < D) {
      const E* k0 = block + d * 16;
#pragma omp simd
      for (int i = 0; i < 16; ++i) even[i] += qg[d] * as_float(k0[i]);
    }
    float* row = scores + g * len;
    for (int64_t i = 0; i < stop; ++i) row[i] = even[i] + odd[i];
  }
}

// Scores of query heads g (pre-scaled, float) against every context token. Keys are stored transposed inside a
// block ([head_dim][block_size]), so a block's scores are head_dim vector multiply-adds, with no horizontal sums.
template <typename Read>
void block_scores(const float* qf, const typename Read::Stored* k, Read read, float* buffer, const int64_t* table,
                  int64_t len, const Shape& s, int64_t G, float* scores) {
  using E = typename Read::Elem;
  const int64_t D = s.head_dim, B = s.block_size;
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += B, ++b) {
    if (t0 + B < len) prefetch_block(k + table[b + 1] * B * D, B * D);
    const E* block = read(k + table[b] * B * D, B * D, buffer);
    const int64_t stop = std::min(B, len - t0);
    if (B == 16) {
      scores_of_16(qf, block, D, G, scores + t0, len, stop);
      continue;
    }
    for (int64_t g = 0; g < G; ++g) {
      float* row = scores + g * len + t0;
      const float* qg = qf + g * D;
      float acc[256] = {0.f};  // block_size <= 256 (checked by the caller)
      for (int64_t d = 0; d < D; ++d) {
        const float qd = qg[d];
        const E* keys = block + d * B;
#pragma omp simd
        for (int64_t i = 0; i < B; ++i) acc[i] += qd * as_float(keys[i]);
      }
      std::copy(acc, acc + stop, row);
    }
  }
}

// One query head's weighted sum of the values (in place in the cache) with weights p: a head_dim of DD floats
// accumulates in registers across the whole context, written out once.
template <int DD, typename E>
inline void weighted_values(const E* v, const int64_t* table, int64_t len, const Shape& s, const float* p,
                            float* out) {
  float acc[DD] = {0.f};
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const int64_t stop = std::min(s.block_size, len - t);
    const E* block = v + table[b] * s.block_size * DD;
    if (t + stop < len) prefetch_block(v + table[b + 1] * s.block_size * DD, s.block_size * DD);
    for (int64_t i = 0; i < stop; ++i, ++t) {
      const float w = p[t];
      const E* value = block + i * DD;
#pragma omp simd
      for (int d = 0; d < DD; ++d) acc[d] += w * as_float(value[d]);
    }
  }
  std::copy(acc, acc + DD, out);
}

// Per-thread buffers of attend_one.
struct Buffers {
  std::vector<float> qf, scores, acc, block;
};

// One sequence, one KV head and the G query heads that share it: scores, softmax, weighted sum of values.
template <typename T, typename Read>
void attend_one(const T* q, const typename Read::Stored* k, const typename Read::Stored* v, Read read,
                const int64_t* table, int64_t len, T* out, const Shape& s, Scales scales, Buffers& buf) {
  using E = typename Read::Elem;
  const int64_t G = s.heads / s.kv_heads, D = s.head_dim;
  for (int64_t i = 0; i < G * D; ++i) buf.qf[i] = as_float(q[i]) * scales.query;
  buf.scores.resize(G * len);
  float* scores = buf.scores.data();
  block_scores(buf.qf.data(), k, read, buf.block.data(), table, len, s, G, scores);
  float out_scale[64];  // value scale / softmax sum; G <= 64 query heads per KV head (checked by the caller)
  for (int64_t g = 0; g < G; ++g) {
    float* row = scores + g * len;
    const float peak = *std::max_element(row, row + len);
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) row[t] = expf(row[t] - peak);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) sum += row[t];
    out_scale[g] = scales.value / sum;
  }
  constexpr bool in_place = std::is_same<typename Read::Stored, E>::value;  // nothing to dequantize per head
  if (in_place && (D == 32 || D == 64 || D == 128)) {
    for (int64_t g = 0; g < G; ++g) {
      float* ag = buf.acc.data() + g * D;
      if (D == 32) weighted_values<32>(v, table, len, s, scores + g * len, ag);
      if (D == 64) weighted_values<64>(v, table, len, s, scores + g * len, ag);
      if (D == 128) weighted_values<128>(v, table, len, s, scores + g * len, ag);
    }
  } else {
    std::fill(buf.acc.begin(), buf.acc.end(), 0.f);
    for_each_token(v, read, buf.block.data(), table, len, s, [&](int64_t t, const E* value) {
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * len + t];
        float* ag = buf.acc.data() + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * as_float(value[d]);
      }
    });
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(buf.acc[g * D + d] * out_scale[g]);
}

template <typename T, typename Read>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, Read read,
            const at::Tensor& tables, const at::Tensor& lens, at::Tensor& out, const Shape& s, Scales scales) {
  using C = typename Read::Stored;
  const int64_t n = q.size(0), G = s.heads / s.kv_heads, D = s.head_dim;
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const bool dequantizes = !std::is_same<C, typename Read::Elem>::value;
  at::parallel_for(0, n * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    Buffers buf{std::vector<float>(G * D), {}, std::vector<float>(G * D),
                std::vector<float>(dequantizes ? s.block_size * D : 0)};
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, kh = item % s.kv_heads;
      const int64_t head_offset = (seq * s.heads + kh * G) * D;
      attend_one(qp + head_offset, kp + kh * s.slots * D, vp + kh * s.slots * D, read, tp + seq * s.table_width,
                 lp[seq], op + head_offset, s, scales, buf);
    }
  });
}

}  // namespace

// q: [n, H, D]; k_cache, v_cache: [KVH, blocks, block_size * D] (keys [D][block_size] inside a block, values
// [block_size][D]), in q's dtype or FP8; block_tables: [n, W] int64; context_lens: [n] int64. A cached key is
// k_cache * k_scale, a cached value v_cache * v_scale.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale, double k_scale,
                                  double v_scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "keys and values must share a dtype");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= 64, "unsupported head grouping");
  TORCH_CHECK(block_size <= 256, "block_size above 256 is not supported by the CPU kernel");
  auto out = at::empty_like(q);
  const Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1) * block_size, tables.size(1), block_size};
  const Scales scales{static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
  const auto stored = k_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (stored == at::kFloat8_e4m3fn) {
      decode<scalar_t>(q, k_cache, v_cache, E4m3Block{}, tables, lens, out, s, scales);
    } else if (stored == at::kFloat8_e5m2) {
      decode<scalar_t>(q, k_cache, v_cache, E5m2Block{}, tables, lens, out, s, scales);
    } else {
      TORCH_CHECK(stored == q.scalar_type(), "the KV cache must be in the query's dtype or FP8");
      decode<scalar_t>(q, k_cache, v_cache, InPlace<scalar_t>{}, tables, lens, out, s, scales);
    }
  });
  return out;
}

namespace {

template <typename T>
void silu_and_mul_rows(const T* in, T* out, int64_t begin, int64_t end, int64_t d, int64_t stride) {
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = in + r * stride;
    const T* up = gate + d;
    T* row = out + r * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) {
      const float g = as_float(gate[j]);
      // clamped: fast-math assumes finite values, and exp(80) is still one
      row[j] = static_cast<T>(g / (1.0f + std::exp(std::min(-g, 80.0f))) * as_float(up[j]));
    }
  }
}

}  // namespace

// The MLP's SiLU(gate) * up in one pass over x = [gate | up] ([rows, 2d], rows contiguous), as vLLM's
// silu_and_mul: PyTorch's F.silu(gate) * up reads and writes two intermediate tensors, and its expf is slower.
at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [rows, 2d] with contiguous rows");
  const int64_t rows = x.size(0), d = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) { silu_and_mul_rows(in, y, begin, end, d, stride); });
  });
  return out;
}

TORCH_LIBRARY(tokenfleet, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "int block_size, float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor",
      &paged_decode_attention);
}
