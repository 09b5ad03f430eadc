// The native engine's decode step on a CPU, in fp32: every layer of a Llama-style model (RMSNorm, rotary,
// grouped-query attention, SwiGLU; optional linear biases) for every row of the step in one call from Python.
//
// Why it is written by hand (see cpu_decode.py): at one row a decode step is a chain of matrix-vector
// products, bound by how fast the weights stream from memory, and about 40 small operations a layer. Neither
// library torch calls streams the weights at the memory's speed for a single column (oneDNN 19-33 GB/s over
// SmolLM2's shapes, MKL 11-12 GB/s on one thread), and each small torch operation costs a few microseconds of
// dispatch, more than its arithmetic. Here, up to own_rows rows, the products are one weight row's dot products
// with every row of the step after another (one sequential stream of the weight per thread, the step's rows held
// in the cache); at more rows they are oneDNN's on the engine's packed copies (cpu_decode.py's own_rows says
// where, per CPU); the rest runs in place on small buffers. The math is the general path's (forward.py's `_decode_layer`), which the tests compare it to.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#include <sleef.h>  // torch's vectorised math library (libtorch_cpu exports it): the exp of torch's own kernels
#endif

namespace {

// The vector registers this build has: 16 floats (AVX-512), 8 (AVX2 with FMA) or none (then plain loops).
#if defined(__AVX512F__)
#define ALIGNER_VECTORS 1
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define ALIGNER_VECTORS 1
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float vsum(Vec v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  return _mm_cvtss_f32(half);
}
#endif

// w . x over n floats. Four independent accumulators keep the fused multiply-adds from waiting on each other.
inline float dot(const float* w, const float* x, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(ALIGNER_VECTORS)
  Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (; k + 4 * kLanes <= n; k += 4 * kLanes) {
    a0 = vfma(vload(w + k), vload(x + k), a0);
    a1 = vfma(vload(w + k + kLanes), vload(x + k + kLanes), a1);
    a2 = vfma(vload(w + k + 2 * kLanes), vload(x + k + 2 * kLanes), a2);
    a3 = vfma(vload(w + k + 3 * kLanes), vload(x + k + 3 * kLanes), a3);
  }
  for (; k + kLanes <= n; k += kLanes) a0 = vfma(vload(w + k), vload(x + k), a0);
  sum = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#endif
  for (; k < n; ++k) sum += w[k] * x[k];
  return sum;
}

#if defined(ALIGNER_VECTORS)
// sums[j] = w . x[j] for the R rows x [R, n] (rows n apart): the weight row read once for all of them, one
// accumulator a row (R of them: R >= 2 keeps the multiply-adds from waiting on each other).
template <int R>
inline void dots(const float* w, const float* x, int64_t n, float* sums) {
  Vec acc[R];
  for (int j = 0; j < R; ++j) acc[j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const Vec weight = vload(w + k);
    for (int j = 0; j < R; ++j) acc[j] = vfma(weight, vload(x + j * n + k), acc[j]);
  }
  for (int j = 0; j < R; ++j) {
    float sum = vsum(acc[j]);
    for (int64_t t = k; t < n; ++t) sum += w[t] * x[j * n + t];
    sums[j] = sum;
  }
}
#endif

// The most rows the products below serve (cpu_decode.py's own_rows chooses how many, up to this); 1 where the
// build has no vector registers. More rows, in groups of 8 a weight row, lost to oneDNN on an AMD EPYC with AVX2
// (0.94x its speed at 12 rows, 0.79x at 16).
#if defined(ALIGNER_VECTORS)
constexpr int64_t kMaxOwnRows = 8;
#else
constexpr int64_t kMaxOwnRows = 1;
#endif

// x[i] = exp(x[i]) over n floats: Sleef's vectorised exp (what torch's silu and softmax call), std::exp for the
// tail and where neither vector set is there.
inline void exp_in_place(float* x, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, Sleef_expf16_u10(_mm512_loadu_ps(x + i)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Sleef_expf8_u10avx2(_mm256_loadu_ps(x + i)));
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

// out = silu(gate) * up = gate / (1 + exp(-gate)) * up over n floats (out may be gate).
inline void silu_times(const float* gate, const float* up, float* out, int64_t n, float* scratch) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = -gate[i];
  exp_in_place(scratch, n);
  for (int64_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + scratch[i]) * up[i];
}

// out[t] = sum_k a[k] * M[k][t0 + t] for the W columns t0 .. t0 + W - 1 of M [count, >= t0 + W] (rows `row`
// apart), the sums kept in registers over the count rows (W = 64: four independent vectors of 16, so the
// multiply-adds do not wait on each other) instead of read and written back for each row.
template <int W>
inline void combine_block(const float* a, const float* M, int64_t row, int64_t count, int64_t t0, float* out) {
  float sum[W] = {};
  for (int64_t k = 0; k < count; ++k) {
    const float weight = a[k];
    const float* m = M + k * row + t0;
    for (int t = 0; t < W; ++t) sum[t] += weight * m[t];
  }
  std::copy(sum, sum + W, out + t0);
}

// out [width] = a [count] @ M [count, width] (rows `row` apart): attention's scores (a query over the keys
// [d, len]) and its weighted sum (the probabilities over the values [len, d]).
inline void vector_matrix(const float* a, const float* M, int64_t row, int64_t count, int64_t width, float* out) {
  int64_t t0 = 0;
  for (; t0 + 64 <= width; t0 += 64) combine_block<64>(a, M, row, count, t0, out);
  for (; t0 + 16 <= width; t0 += 16) combine_block<16>(a, M, row, count, t0, out);
  for (int64_t t = t0; t < width; ++t) {
    float sum = 0.0f;
    for (int64_t k = 0; k < count; ++k) sum += a[k] * M[k * row + t];
    out[t] = sum;
  }
}

// Rows a thread takes at least: below this a product runs on one thread (a fork costs more than it saves).
constexpr int64_t kRowsPerThread = 32;
// The largest head the step's rotary scratch holds (cpu_decode.py refuses larger ones).
constexpr int64_t kMaxHeadDim = 1024;

// y[b][r] = W[r] . x[b] (+ bias[r]) (+ residual[b][r]) for the rows b of x [batch, in] (batch <= kMaxOwnRows) and
// rows r of W [out, in] (row-major): each weight row streamed once from memory for every row of x, which stays in
// the cache. y may be the residual (each entry is read, then written).
void rows_times_matrix(const float* W, const float* x, int64_t batch, const float* bias, const float* residual,
                       float* y, int64_t out, int64_t in) {
  at::parallel_for(0, out, kRowsPerThread, [&](int64_t begin, int64_t end) {
    float sums[kMaxOwnRows];
    for (int64_t r = begin; r < end; ++r) {
      const float* w = W + r * in;
      switch (batch) {
#if defined(ALIGNER_VECTORS)
        case 2: dots<2>(w, x, in, sums); break;
        case 3: dots<3>(w, x, in, sums); break;
        case 4: dots<4>(w, x, in, sums); break;
        case 5: dots<5>(w, x, in, sums); break;
        case 6: dots<6>(w, x, in, sums); break;
        case 7: dots<7>(w, x, in, sums); break;
        case 8: dots<8>(w, x, in, sums); break;
#endif
        default: sums[0] = dot(w, x, in);
      }
      for (int64_t b = 0; b < batch; ++b) {
        const float value = sums[b] + (bias ? bias[r] : 0.0f);
        y[b * out + r] = residual ? value + residual[b * out + r] : value;
      }
    }
  });
}

// out = x * rsqrt(mean(x^2) + eps) * weight (torch's RMSNorm in fp32).
void rms_norm(const float* x, const float* weight, float eps, float* out, int64_t n) {
  double squares = 0.0;
  for (int64_t i = 0; i < n; ++i) squares += static_cast<double>(x[i]) * x[i];
  const float inverse = 1.0f / std::sqrt(static_cast<float>(squares / n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * weight[i] * inverse;
}

// x * cos + roll(x, d / 2) * sin over one head (sin holds the rotate-half signs, as the engine's tables do).
void rotate(float* x, const float* cos, const float* sin, int64_t d, float* scratch) {
  std::copy(x, x + d, scratch);
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) x[i] = scratch[i] * cos[i] + scratch[(i + half) % d] * sin[i];
}

const float* optional_data(const c10::optional<torch::Tensor>& tensor) {
  return tensor.has_value() ? tensor->data_ptr<float>() : nullptr;
}

// The product the general path runs at more than one row: oneDNN's linear on the weight's packed copy
// (cpu_products.pack), x [batch, in] -> [batch, out] (+ bias): the same call as cpu_products._onednn_linear,
// which the general path makes. Called boxed: the op's schema is all we rely on.
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<c10::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// A linear layer: its weight [out, in], bias or none, and the weight's oneDNN-packed copy (the steps of more than
// one row need it; none where the engine does not pack).
struct Linear {
  torch::Tensor weight;
  c10::optional<torch::Tensor> bias, packed;
};

// y [batch, out] = x [batch, in] W^T (+ bias) (+ residual [batch, out]; y may be the residual: each entry is read,
// then written). Up to own_rows rows: the products above on the weight itself; more: oneDNN on the packed copy.
void linear(const Linear& layer, const float* x, int64_t batch, int64_t own_rows, const float* residual, float* y) {
  const int64_t out = layer.weight.size(0), in = layer.weight.size(1);
  if (batch <= own_rows) {
    rows_times_matrix(layer.weight.data_ptr<float>(), x, batch, optional_data(layer.bias), residual, y, out, in);
    return;
  }
  const torch::Tensor product = onednn_linear(
      torch::from_blob(const_cast<float*>(x), {batch, in}, torch::kFloat32), *layer.packed, layer.bias);
  const float* values = product.data_ptr<float>();
  const int64_t count = batch * out;
  if (residual) {
    for (int64_t i = 0; i < count; ++i) y[i] = values[i] + residual[i];
  } else {
    std::copy(values, values + count, y);
  }
}

struct LayerWeights {
  torch::Tensor input_norm, mlp_norm;
  Linear qkv, proj, fc1, fc2;
};

// The model's weights (references to the training tensors, whose updates in place are seen, and to the packed
// copies the engine made for this generate call: CpuDecode is made again at every bind) and the step's buffers.
class DecodeModel {
 public:
  // own_rows: the most rows a step runs through the products above (more go to oneDNN); cpu_decode.py's
  // own_rows chooses it for the CPU.
  DecodeModel(std::vector<LayerWeights> layers, torch::Tensor embedding, torch::Tensor final_norm, Linear output,
              int64_t heads, int64_t groups, int64_t head_dim, double scale, double eps, int64_t own_rows)
      : layers_(std::move(layers)), embedding_(embedding), final_norm_(final_norm), output_(std::move(output)),
        heads_(heads), groups_(groups), head_dim_(head_dim), scale_(static_cast<float>(scale)),
        eps_(static_cast<float>(eps)), own_rows_(own_rows) {
    TORCH_CHECK(1 <= own_rows && own_rows <= kMaxOwnRows, "cpu_decode: own_rows ", own_rows, " outside 1 .. ",
                kMaxOwnRows);
    hidden_size_ = embedding_.size(1);
    ffn_ = layers_.empty() ? 0 : layers_[0].fc2.weight.size(1);
    qkv_rows_ = (heads_ + 2 * groups_) * head_dim_;
    packed_ = output_.packed.has_value();
    for (const LayerWeights& layer : layers_)
      for (const Linear* part : {&layer.qkv, &layer.proj, &layer.fc1, &layer.fc2})
        packed_ = packed_ && part->packed.has_value();
  }

  // One token a row (tokens [batch]); row b's key and value go to cache column columns[b] (also the token's
  // position less the row's left padding: the rotary tables say which), and every row reads columns
  // 0 .. kv_len - 1. cos, sin [batch, d]: the rotary angles of each row's token; bias [batch * groups, kv_len]
  // (rows bias_stride apart) added to the attention scores (0, or the dtype's minimum where a column is not the
  // row's to see), or none; keys [layers, >= batch, groups, d, len] and values [layers, >= batch, groups, len, d].
  // Returns the logits [batch, vocab].
  torch::Tensor step(const torch::Tensor& tokens, const torch::Tensor& columns, int64_t kv_len,
                     const torch::Tensor& cos, const torch::Tensor& sin, const c10::optional<torch::Tensor>& bias,
                     const torch::Tensor& keys, const torch::Tensor& values) {
    // What the raw reads and writes below rely on: a wrong call fails here, never as memory corruption.
    TORCH_CHECK(tokens.dim() == 1 && tokens.numel() >= 1 && tokens.scalar_type() == torch::kLong &&
                    tokens.is_contiguous(), "cpu_decode: tokens [batch] long");
    const int64_t batch = tokens.numel();
    TORCH_CHECK(batch <= own_rows_ || packed_, "cpu_decode: a step of ", batch, " rows needs the packed weights");
    TORCH_CHECK(columns.numel() == batch && columns.scalar_type() == torch::kLong && columns.is_contiguous(),
                "cpu_decode: columns [batch] long");
    TORCH_CHECK(cos.numel() == batch * head_dim_ && sin.numel() == batch * head_dim_ && cos.is_contiguous() &&
                    sin.is_contiguous(), "cpu_decode: cos and sin [batch, ", head_dim_, "] contiguous");
    TORCH_CHECK(keys.dim() == 5 && values.dim() == 5 && keys.stride(4) == 1 && values.stride(4) == 1 &&
                    keys.size(0) == static_cast<int64_t>(layers_.size()) && keys.size(2) == groups_ &&
                    keys.size(3) == head_dim_ && values.size(4) == head_dim_ && keys.size(1) >= batch &&
                    values.size(1) >= batch,
                "cpu_decode: keys [layers, rows, groups, d, len] and values [layers, rows, groups, len, d]");
    TORCH_CHECK(0 < kv_len && kv_len <= keys.size(4) && kv_len <= values.size(3), "cpu_decode: kv_len ", kv_len,
                " outside the cache");
    const int64_t* column = columns.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(0 <= column[b] && column[b] < kv_len, "cpu_decode: column ", column[b], " outside the cache");
    TORCH_CHECK(!bias.has_value() || (bias->dim() == 2 && bias->scalar_type() == torch::kFloat &&
                                      bias->size(0) == batch * groups_ &&
                                      bias->size(1) == kv_len && bias->stride(1) == 1),
                "cpu_decode: bias [batch * groups, kv_len]");
    const int64_t* token = tokens.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(0 <= token[b] && token[b] < embedding_.size(0), "cpu_decode: token ", token[b],
                  " outside the vocabulary");
    resize(batch, kv_len);
    for (int64_t b = 0; b < batch; ++b) {
      const float* row = embedding_.data_ptr<float>() + token[b] * hidden_size_;
      std::copy(row, row + hidden_size_, hidden_.begin() + b * hidden_size_);
    }
    const Step at{batch, column, kv_len, cos.data_ptr<float>(), sin.data_ptr<float>(), optional_data(bias),
                  bias.has_value() ? bias->stride(0) : 0};
    for (size_t index = 0; index < layers_.size(); ++index) {
      const Cache cache{keys.data_ptr<float>() + index * keys.stride(0), keys.stride(1), keys.stride(2),
                        keys.stride(3), values.data_ptr<float>() + index * values.stride(0), values.stride(1),
                        values.stride(2), values.stride(3)};
      layer(layers_[index], at, cache);
    }
    for (int64_t b = 0; b < batch; ++b)
      rms_norm(hidden_.data() + b * hidden_size_, final_norm_.data_ptr<float>(), eps_,
               normed_.data() + b * hidden_size_, hidden_size_);
    if (batch > own_rows_)
      return onednn_linear(torch::from_blob(normed_.data(), {batch, hidden_size_}, torch::kFloat32),
                           *output_.packed, output_.bias);
    torch::Tensor logits = torch::empty({batch, output_.weight.size(0)}, output_.weight.options());
    linear(output_, normed_.data(), batch, own_rows_, nullptr, logits.data_ptr<float>());
    return logits;
  }

 private:
  // What a step's layers share: its rows, their cache columns, the attended columns, rotary tables and bias.
  struct Step {
    int64_t batch;
    const int64_t* columns;
    int64_t kv_len;
    const float *cos, *sin, *bias;
    int64_t bias_stride;
  };
  // One layer's cache: keys [rows, groups, d, len] and values [rows, groups, len, d], by their strides (elements).
  struct Cache {
    float* keys;
    int64_t key_batch, key_group, key_row;  // between batch rows; groups; feature rows of a group (the length)
    float* values;
    int64_t value_batch, value_group, value_row;  // between batch rows; groups; columns of a group
  };

  void resize(int64_t batch, int64_t kv_len) {
    hidden_.resize(batch * hidden_size_);
    normed_.resize(batch * hidden_size_);
    qkv_.resize(batch * qkv_rows_);
    context_.resize(batch * heads_ * head_dim_);
    intermediate_.resize(batch * 2 * ffn_);
    activated_.resize(batch * ffn_);
    negated_.resize(batch * ffn_);
    scores_.resize(batch * heads_ * kv_len);
  }

  void layer(const LayerWeights& w, const Step& at, const Cache& cache) {
    const int64_t d = head_dim_, per_group = heads_ / groups_, hidden = hidden_size_, batch = at.batch;
    const int64_t kv_len = at.kv_len;
    for (int64_t b = 0; b < batch; ++b)
      rms_norm(hidden_.data() + b * hidden, w.input_norm.data_ptr<float>(), eps_, normed_.data() + b * hidden,
               hidden);
    linear(w.qkv, normed_.data(), batch, own_rows_, nullptr, qkv_.data());
    // qkv per row and group: [q_1 .. q_per_group, k, v] (megatron's interleaved layout); rotary on the queries
    // and the key, then the key and value into the row's cache at its column
    float scratch[kMaxHeadDim];
    for (int64_t b = 0; b < batch; ++b) {
      const float* cos = at.cos + b * d;
      const float* sin = at.sin + b * d;
      const int64_t column = at.columns[b];
      for (int64_t g = 0; g < groups_; ++g) {
        float* block = qkv_.data() + b * qkv_rows_ + g * (per_group + 2) * d;
        for (int64_t h = 0; h <= per_group; ++h) rotate(block + h * d, cos, sin, d, scratch);
        const float* key = block + per_group * d;
        const float* value = key + d;
        float* keys_g = cache.keys + b * cache.key_batch + g * cache.key_group;
        for (int64_t i = 0; i < d; ++i) keys_g[i * cache.key_row + column] = key[i];
        std::copy(value, value + d,
                  cache.values + b * cache.value_batch + g * cache.value_group + column * cache.value_row);
      }
    }
    // attention, a (row, head) pair at a time: scores over the attended columns plus the row's bias, softmax,
    // the values' weighted sum
    const bool threaded = batch * kv_len * d * heads_ >= (1 << 16);
    at::parallel_for(0, batch * heads_, threaded ? 1 : batch * heads_, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t b = pair / heads_, head = pair % heads_;
        const int64_t g = head / per_group, q_index = head % per_group;
        const float* query = qkv_.data() + b * qkv_rows_ + (g * (per_group + 2) + q_index) * d;
        const float* keys_g = cache.keys + b * cache.key_batch + g * cache.key_group;
        float* s = scores_.data() + pair * kv_len;
        vector_matrix(query, keys_g, cache.key_row, d, kv_len, s);
        const float* bias = at.bias ? at.bias + (b * groups_ + g) * at.bias_stride : nullptr;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < kv_len; ++j) {
          s[j] = s[j] * scale_ + (bias ? bias[j] : 0.0f);
          top = std::max(top, s[j]);
        }
        for (int64_t j = 0; j < kv_len; ++j) s[j] -= top;
        exp_in_place(s, kv_len);
        float total = 0.0f;
        for (int64_t j = 0; j < kv_len; ++j) total += s[j];
        const float inverse = 1.0f / total;
        for (int64_t j = 0; j < kv_len; ++j) s[j] *= inverse;
        vector_matrix(s, cache.values + b * cache.value_batch + g * cache.value_group, cache.value_row, kv_len, d,
                      context_.data() + pair * d);
      }
    });
    // hidden += proj(context) (+ bias), in place
    linear(w.proj, context_.data(), batch, own_rows_, hidden_.data(), hidden_.data());
    for (int64_t b = 0; b < batch; ++b)
      rms_norm(hidden_.data() + b * hidden, w.mlp_norm.data_ptr<float>(), eps_, normed_.data() + b * hidden,
               hidden);
    linear(w.fc1, normed_.data(), batch, own_rows_, nullptr, intermediate_.data());
    // silu(gate) * up, rows split over the threads where there are many (scratch: the gate's half, used)
    at::parallel_for(0, batch, std::max<int64_t>(1, 8192 / std::max<int64_t>(ffn_, 1)), [&](int64_t begin,
                                                                                            int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        float* gate = intermediate_.data() + b * 2 * ffn_;
        silu_times(gate, gate + ffn_, activated_.data() + b * ffn_, ffn_, negated_.data() + b * ffn_);
      }
    });
    linear(w.fc2, activated_.data(), batch, own_rows_, hidden_.data(), hidden_.data());
  }

  std::vector<LayerWeights> layers_;
  torch::Tensor embedding_, final_norm_;
  Linear output_;
  int64_t heads_, groups_, head_dim_, hidden_size_, ffn_, qkv_rows_;
  float scale_, eps_;
  int64_t own_rows_;
  bool packed_;
  std::vector<float> hidden_, normed_, qkv_, context_, intermediate_, activated_, negated_, scores_;
};

// How many of torch's threads at::parallel_for runs here: 1 where the extension was built without OpenMP (then
// at::parallel_for runs its whole range on the calling thread, whatever torch.get_num_threads() says).
int64_t parallel_threads() {
  std::atomic<int64_t> threads{0};
  at::parallel_for(0, 1024, 1, [&](int64_t, int64_t) { ++threads; });
  return threads;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<Linear>(module, "Linear")
      .def(pybind11::init([](torch::Tensor weight, c10::optional<torch::Tensor> bias,
                             c10::optional<torch::Tensor> packed) { return Linear{weight, bias, packed}; }));
  pybind11::class_<LayerWeights>(module, "LayerWeights")
      .def(pybind11::init([](torch::Tensor input_norm, torch::Tensor mlp_norm, Linear qkv, Linear proj, Linear fc1,
                             Linear fc2) { return LayerWeights{input_norm, mlp_norm, qkv, proj, fc1, fc2}; }));
  pybind11::class_<DecodeModel>(module, "DecodeModel")
      .def(pybind11::init<std::vector<LayerWeights>, torch::Tensor, torch::Tensor, Linear, int64_t, int64_t, int64_t,
                          double, double, int64_t>())
      .def("step", &DecodeModel::step, pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("parallel_threads", &parallel_threads);
  module.attr("max_own_rows") = kMaxOwnRows;
}
