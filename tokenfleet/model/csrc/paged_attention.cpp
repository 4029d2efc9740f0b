// Decode and prefill attention straight over the paged KV cache on the CPU: each (sequence, KV head) reads its keys
// and values once, through its block table, instead of gathering them into a padded copy first; a prefill chunk's
// positions attend a few at a time, causally, each to its own prefix only (PyTorch's SDPA on a chunk computed most of
// the masked half too). The cache is in the query's dtype or 8-bit floats (FP8 e4m3 / e5m2), dequantized one block at
// a time as it is read.
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENFLEET_AVX2 1
#endif

namespace {

template <typename T>
inline float as_float(T x) { return static_cast<float>(x); }

struct Shape {
  int64_t heads, kv_heads, head_dim, slots, table_width, block_size;
  // a decode reads its context once: the next block is prefetched. A prefill tile's context is the one the tile
  // before it read, still in the cache: prefetching it again only costs instructions.
  bool streams;
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

// A 16-token block's scores for R query rows at once (R = 1 or 2): the accumulators have a fixed width, so they
// live in registers (two chains per row, for the FMA's latency) instead of going through memory on every one of the
// head_dim steps, and a pair of rows shares each load of the keys.
template <int R, typename E>
inline void scores_of_16_rows(const float* qf, const E* block, int64_t D, float* scores, int64_t len, int64_t stop) {
  float even[R][16] = {}, odd[R][16] = {};
  int64_t d = 0;
  for (; d + 1 < D; d += 2) {
    const E* k0 = block + d * 16;
    const E* k1 = k0 + 16;
    for (int r = 0; r < R; ++r) {
      const float q0 = qf[r * D + d], q1 = qf[r * D + d + 1];
#pragma omp simd
      for (int i = 0; i < 16; ++i) {
        even[r][i] += q0 * as_float(k0[i]);
        odd[r][i] += q1 * as_float(k1[i]);
      }
    }
  }
  if (d < D) {
    const E* k0 = block + d * 16;
    for (int r = 0; r < R; ++r) {
      const float q0 = qf[r * D + d];
#pragma omp simd
      for (int i = 0; i < 16; ++i) even[r][i] += q0 * as_float(k0[i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < stop; ++i) scores[r * len + i] = even[r][i] + odd[r][i];
}

#ifdef TOKENFLEET_AVX2
// R rows' scores against a 16-token block of float keys ([D][16]): 2R accumulator registers, each key vector loaded
// once for the R rows; at R = 6, twelve independent FMA chains cover the FMA's latency. The loops over rows are
// unrolled so that GCC keeps the accumulators in registers (as a loop, it stores them to the stack every step).
template <int R>
inline void scores_rx16(const float* qf, const float* block, int64_t D, float* scores, int64_t len, int64_t stop) {
  __m256 lo_acc[R], hi_acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 lo = _mm256_loadu_ps(block + d * 16), hi = _mm256_loadu_ps(block + d * 16 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 q = _mm256_broadcast_ss(qf + r * D + d);
      lo_acc[r] = _mm256_fmadd_ps(q, lo, lo_acc[r]);
      hi_acc[r] = _mm256_fmadd_ps(q, hi, hi_acc[r]);
    }
  }
  float rows[R][16];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(rows[r], lo_acc[r]);
    _mm256_storeu_ps(rows[r] + 8, hi_acc[r]);
  }
  for (int r = 0; r < R; ++r) std::copy(rows[r], rows[r] + stop, scores + r * len);
}
#endif

template <typename E>
inline void scores_of_16(const float* qf, const E* block, int64_t D, int64_t rows, float* scores, int64_t len,
                         int64_t stop) {
  int64_t r = 0;
#ifdef TOKENFLEET_AVX2
  if constexpr (std::is_same<E, float>::value) {
    for (; r + 5 < rows; r += 6) scores_rx16<6>(qf + r * D, block, D, scores + r * len, len, stop);
    if (r + 3 < rows) {
      scores_rx16<4>(qf + r * D, block, D, scores + r * len, len, stop);
      r += 4;
    }
    if (r + 2 < rows) {  // a decode's G = 3 query heads of a KV head
      scores_rx16<3>(qf + r * D, block, D, scores + r * len, len, stop);
      r += 3;
    }
  }
#endif
  for (; r + 1 < rows; r += 2) scores_of_16_rows<2>(qf + r * D, block, D, scores + r * len, len, stop);
  if (r < rows) scores_of_16_rows<1>(qf + r * D, block, D, scores + r * len, len, stop);
}

// Scores of `rows` query rows (pre-scaled, float) against the first `len` context tokens. Keys are stored
// transposed inside a block ([head_dim][block_size]), so a block's scores are head_dim vector multiply-adds, with
// no horizontal sums; each block is read (and dequantized) once for all rows.
template <typename Read>
void block_scores(const float* qf, const typename Read::Stored* k, Read read, float* buffer, const int64_t* table,
                  int64_t len, const Shape& s, int64_t rows, float* scores) {
  using E = typename Read::Elem;
  const int64_t D = s.head_dim, B = s.block_size;
  for (int64_t t0 = 0, b = 0; t0 < len; t0 += B, ++b) {
    if (s.streams && t0 + B < len) prefetch_block(k + table[b + 1] * B * D, B * D);
    const E* block = read(k + table[b] * B * D, B * D, buffer);
    const int64_t stop = std::min(B, len - t0);
    if (B == 16) {
      scores_of_16(qf, block, D, rows, scores + t0, len, stop);
      continue;
    }
    for (int64_t g = 0; g < rows; ++g) {
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

// R rows' weighted sums of the values (in place in the cache) with weights p (row r's at p + r * len): head_dim
// DD floats per row accumulate in registers across the context, written out once; a pair of rows shares each
// value's load.
template <int DD, int R, typename E>
inline void weighted_values(const E* v, const int64_t* table, int64_t len, const Shape& s, const float* p,
                            float* out) {
  float acc[R][DD] = {};
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const int64_t stop = std::min(s.block_size, len - t);
    const E* block = v + table[b] * s.block_size * DD;
    if (s.streams && t + stop < len) prefetch_block(v + table[b + 1] * s.block_size * DD, s.block_size * DD);
    for (int64_t i = 0; i < stop; ++i, ++t) {
      const E* value = block + i * DD;
      for (int r = 0; r < R; ++r) {
        const float w = p[r * len + t];
#pragma omp simd
        for (int d = 0; d < DD; ++d) acc[r][d] += w * as_float(value[d]);
      }
    }
  }
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + DD, out + r * DD);
}

#ifdef TOKENFLEET_AVX2
// R rows' weighted sums over float values ([block_size][D] per block), one 16-float slice of head_dim at a time:
// 2R accumulators, and each value slice's two vectors loaded once for the R rows (unrolled as scores_rx16).
template <int R>
inline void weighted_rx16(const float* v, const int64_t* table, int64_t len, const Shape& s, const float* p,
                          int64_t slice, float* out) {
  const int64_t D = s.head_dim;
  __m256 lo_acc[R], hi_acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  for (int64_t t = 0, b = 0; t < len; ++b) {
    const int64_t stop = std::min(s.block_size, len - t);
    const float* block = v + table[b] * s.block_size * D + slice;
    if (s.streams && t + stop < len) prefetch_block(v + table[b + 1] * s.block_size * D, s.block_size * D);
    for (int64_t i = 0; i < stop; ++i, ++t) {
      const __m256 lo = _mm256_loadu_ps(block + i * D), hi = _mm256_loadu_ps(block + i * D + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 w = _mm256_broadcast_ss(p + r * len + t);
        lo_acc[r] = _mm256_fmadd_ps(w, lo, lo_acc[r]);
        hi_acc[r] = _mm256_fmadd_ps(w, hi, hi_acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * D + slice, lo_acc[r]);
    _mm256_storeu_ps(out + r * D + slice + 8, hi_acc[r]);
  }
}
#endif

template <int DD, typename E>
inline void weighted_rows(const E* v, const int64_t* table, int64_t len, const Shape& s, const float* p,
                          int64_t rows, float* out) {
  int64_t r = 0;
#ifdef TOKENFLEET_AVX2
  if constexpr (std::is_same<E, float>::value) {
    for (; r + 5 < rows; r += 6)
      for (int64_t slice = 0; slice < DD; slice += 16)
        weighted_rx16<6>(v, table, len, s, p + r * len, slice, out + r * DD);
    for (; r + 2 < rows; r += 3)
      for (int64_t slice = 0; slice < DD; slice += 16)
        weighted_rx16<3>(v, table, len, s, p + r * len, slice, out + r * DD);
  }
#endif
  // two rows of 32 floats keep 8 accumulators and a value's 4 loads in the 16 vector registers of AVX2
  if (DD == 32)
    for (; r + 1 < rows; r += 2) weighted_values<DD, 2>(v, table, len, s, p + r * len, out + r * DD);
  for (; r < rows; ++r) weighted_values<DD, 1>(v, table, len, s, p + r * len, out + r * DD);
}

// Per-thread buffers of attend_rows.
struct Buffers {
  std::vector<float> qf, scores, acc, block, out_scale;
};

// Query rows that share one KV head (a decode's G heads; or a prefill tile's positions x G heads), each attending to
// the first limits[r] tokens of one sequence's context: scores, softmax, weighted sum of the values. qf holds the
// rows pre-scaled (softmax scale x key scale); the result, already divided by each row's softmax sum and multiplied
// by the value scale, is left in buf.acc ([rows][D]).
template <typename Read>
void attend_rows(const typename Read::Stored* k, const typename Read::Stored* v, Read read, const int64_t* table,
                 const int64_t* limits, int64_t rows, const Shape& s, float value_scale, Buffers& buf) {
  using E = typename Read::Elem;
  const int64_t D = s.head_dim;
  const int64_t len = *std::max_element(limits, limits + rows);
  buf.scores.resize(rows * len);
  buf.acc.resize(rows * D);
  buf.out_scale.resize(rows);
  float* scores = buf.scores.data();
  block_scores(buf.qf.data(), k, read, buf.block.data(), table, len, s, rows, scores);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = scores + r * len;
    const int64_t lim = limits[r];
    const float peak = *std::max_element(row, row + lim);
#pragma omp simd
    for (int64_t t = 0; t < lim; ++t) row[t] = expf(row[t] - peak);
    std::fill(row + lim, row + len, 0.f);  // past this row's position: masked
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < lim; ++t) sum += row[t];
    buf.out_scale[r] = value_scale / sum;
  }
  constexpr bool in_place = std::is_same<typename Read::Stored, E>::value;  // nothing to dequantize per row
  float* acc = buf.acc.data();
  if (in_place && D == 32) {
    weighted_rows<32>(v, table, len, s, scores, rows, acc);
  } else if (in_place && D == 64) {
    weighted_rows<64>(v, table, len, s, scores, rows, acc);
  } else if (in_place && D == 128) {
    weighted_rows<128>(v, table, len, s, scores, rows, acc);
  } else {
    std::fill(buf.acc.begin(), buf.acc.end(), 0.f);
    for_each_token(v, read, buf.block.data(), table, len, s, [&](int64_t t, const E* value) {
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * len + t];
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] += p * as_float(value[d]);
      }
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ar[d] *= buf.out_scale[r];
  }
}

template <typename T>
inline void load_rows(const T* q, int64_t count, float scale, float* qf) {
  for (int64_t i = 0; i < count; ++i) qf[i] = as_float(q[i]) * scale;
}

template <typename T>
inline void store_rows(const float* acc, int64_t count, T* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(acc[i]);
}

Buffers buffers_for(const Shape& s, int64_t rows, bool dequantizes) {
  return Buffers{std::vector<float>(rows * s.head_dim), {}, {},
                 std::vector<float>(dequantizes ? s.block_size * s.head_dim : 0), {}};
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
    Buffers buf = buffers_for(s, G, dequantizes);
    std::vector<int64_t> limits(G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / s.kv_heads, kh = item % s.kv_heads;
      const int64_t head_offset = (seq * s.heads + kh * G) * D;
      load_rows(qp + head_offset, G * D, scales.query, buf.qf.data());
      std::fill(limits.begin(), limits.end(), lp[seq]);
      attend_rows(kp + kh * s.slots * D, vp + kh * s.slots * D, read, tp + seq * s.table_width, limits.data(), G, s,
                  scales.value, buf);
      store_rows(buf.acc.data(), G * D, op + head_offset);
    }
  });
}

// Positions of one prefill chunk that one work item attends together: their TILE x G query rows share each key and
// value block read. Small enough that the positions' causal limits waste little (at most TILE - 1 masked tokens).
constexpr int64_t TILE = 4;

struct Tile {
  int64_t chunk, first;  // the chunk, and the tile's first position within it (0-based, in query rows)
};

template <typename T, typename Read>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, Read read,
             const at::Tensor& tables, const at::Tensor& query_lens, const at::Tensor& starts, at::Tensor& out,
             const Shape& s, Scales scales) {
  using C = typename Read::Stored;
  const int64_t chunks = tables.size(0), G = s.heads / s.kv_heads, D = s.head_dim, H = s.heads;
  const int64_t* qlen = query_lens.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  std::vector<int64_t> row_of(chunks);  // each chunk's first query row
  std::vector<Tile> tiles;
  for (int64_t c = 0, row = 0; c < chunks; row += qlen[c], ++c) {
    row_of[c] = row;
    for (int64_t first = 0; first < qlen[c]; first += TILE) tiles.push_back({c, first});
    TORCH_CHECK(qlen[c] >= 0 && start[c] >= 0 && start[c] + qlen[c] <= s.table_width * s.block_size,
                "a chunk reaches past its block table");
  }
  TORCH_CHECK(static_cast<int64_t>(row_of.empty() ? 0 : row_of.back() + qlen[chunks - 1]) == q.size(0),
              "the query lengths must add up to q's rows");
  const T* qp = q.data_ptr<T>();
  const C* kp = static_cast<const C*>(k_cache.data_ptr());
  const C* vp = static_cast<const C*>(v_cache.data_ptr());
  const int64_t* tp = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const bool dequantizes = !std::is_same<C, typename Read::Elem>::value;
  // A tile's work grows with its position (a causal triangle) and parallel_for hands each thread a contiguous run of
  // items: taken from both ends alternately, every run mixes short and long tiles.
  const int64_t count = static_cast<int64_t>(tiles.size());
  std::vector<Tile> mixed(count);
  for (int64_t k = 0; k < count; ++k) mixed[k] = tiles[k % 2 == 0 ? k / 2 : count - 1 - k / 2];
  const int64_t items = count * s.kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Buffers buf = buffers_for(s, TILE * G, dequantizes);
    std::vector<int64_t> limits(TILE * G);
    for (int64_t item = begin; item < end; ++item) {
      const Tile tile = mixed[item / s.kv_heads];
      const int64_t kh = item % s.kv_heads;
      const int64_t positions = std::min(TILE, qlen[tile.chunk] - tile.first);
      for (int64_t i = 0; i < positions; ++i) {
        const int64_t row = row_of[tile.chunk] + tile.first + i;
        load_rows(qp + (row * H + kh * G) * D, G * D, scales.query, buf.qf.data() + i * G * D);
        // the position attends to its sequence's tokens 0..position: its own key and value are in the cache already
        std::fill(limits.begin() + i * G, limits.begin() + (i + 1) * G, start[tile.chunk] + tile.first + i + 1);
      }
      attend_rows(kp + kh * s.slots * D, vp + kh * s.slots * D, read, tp + tile.chunk * s.table_width, limits.data(),
                  positions * G, s, scales.value, buf);
      for (int64_t i = 0; i < positions; ++i) {
        const int64_t row = row_of[tile.chunk] + tile.first + i;
        store_rows(buf.acc.data() + i * G * D, G * D, op + (row * H + kh * G) * D);
      }
    }
  });
}

// Calls fn(read) with the reader of the cache's dtype: in place in q's dtype, or FP8 dequantized per block.
template <typename T, typename Fn>
void with_reader(const at::Tensor& k_cache, Fn&& fn) {
  const auto stored = k_cache.scalar_type();
  if (stored == at::kFloat8_e4m3fn) {
    fn(E4m3Block{});
  } else if (stored == at::kFloat8_e5m2) {
    fn(E5m2Block{});
  } else {
    TORCH_CHECK(stored == c10::CppTypeToScalarType<T>::value, "the KV cache must be in the query's dtype or FP8");
    fn(InPlace<T>{});
  }
}

void check_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                 int64_t block_size) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(tables.scalar_type() == at::kLong, "int64 block tables");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "keys and values must share a dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0 && q.size(1) / k_cache.size(0) <= 64, "unsupported head grouping");
  TORCH_CHECK(block_size <= 256, "block_size above 256 is not supported by the CPU kernel");
}

}  // namespace

// q: [n, H, D]; k_cache, v_cache: [KVH, blocks, block_size * D] (keys [D][block_size] inside a block, values
// [block_size][D]), in q's dtype or FP8; block_tables: [n, W] int64; context_lens: [n] int64. A cached key is
// k_cache * k_scale, a cached value v_cache * v_scale.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t block_size, double scale, double k_scale,
                                  double v_scale) {
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  check_cache(q, k_cache, v_cache, tables, block_size);
  TORCH_CHECK(lens.scalar_type() == at::kLong, "int64 context lengths");
  auto out = at::empty_like(q);
  const Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1) * block_size, tables.size(1), block_size, true};
  const Scales scales{static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    with_reader<scalar_t>(k_cache, [&](auto read) {
      decode<scalar_t>(q, k_cache, v_cache, read, tables, lens, out, s, scales);
    });
  });
  return out;
}

// Prefill chunks' causal attention over the paged cache, the chunks' own keys and values written there first.
// q: [P, H, D], the chunks' query rows one chunk after another; block_tables: [C, W] int64; query_lens: [C] (they
// sum to P); context_starts: [C], the tokens of each sequence before its chunk. Row i of chunk c is position
// context_starts[c] + i and attends to the sequence's tokens 0..that position. Caches as paged_decode_attention's.
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                   at::Tensor query_lens, at::Tensor context_starts, int64_t block_size, double scale,
                                   double k_scale, double v_scale) {
  auto tables = block_tables.contiguous();
  auto lens = query_lens.contiguous();
  auto starts = context_starts.contiguous();
  check_cache(q, k_cache, v_cache, tables, block_size);
  TORCH_CHECK(lens.scalar_type() == at::kLong && starts.scalar_type() == at::kLong, "int64 lengths and starts");
  TORCH_CHECK(lens.size(0) == tables.size(0) && starts.size(0) == tables.size(0), "one length and start per table");
  auto out = at::empty_like(q);
  const Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1) * block_size, tables.size(1), block_size, false};
  const Scales scales{static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    with_reader<scalar_t>(k_cache, [&](auto read) {
      prefill<scalar_t>(q, k_cache, v_cache, read, tables, lens, starts, out, s, scales);
    });
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

// x * rsqrt(mean(x^2) + eps) in float, rounded to T, times the weight: the same roundings as RMSNorm in PyTorch
template <typename T>
void rms_norm_rows(const T* in, const T* weight, T* out, int64_t begin, int64_t end, int64_t d, int64_t stride,
                   float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* row = in + r * stride;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < d; ++j) squares += as_float(row[j]) * as_float(row[j]);
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(d) + eps);
    T* y = out + r * d;
#pragma omp simd
    for (int64_t j = 0; j < d; ++j)
      y[j] = static_cast<T>(as_float(static_cast<T>(as_float(row[j]) * inv)) * as_float(weight[j]));
  }
}

}  // namespace

// RMSNorm in one pass over each row of x ([rows, d], rows contiguous): PyTorch's version makes six passes (square,
// mean, add, rsqrt, two multiplies), each reading and writing a tensor of the activation's size.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, d] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "one weight per column");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "the weight must be in x's dtype");
  const int64_t rows = x.size(0), d = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    scalar_t* y = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      rms_norm_rows(in, w, y, begin, end, d, stride, static_cast<float>(eps));
    });
  });
  return out;
}

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
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
      "int block_size, float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor",
      &paged_decode_attention);
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_lens, "
      "Tensor context_starts, int block_size, float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor",
      &paged_prefill_attention);
}
