// The native engine's decode step for one sequence on a CPU, in fp32: every layer of a Llama-style model
// (RMSNorm, rotary, grouped-query attention, SwiGLU; optional linear biases) in one call from Python.
//
// Why it is written by hand (see cpu_decode.py): at one row a decode step is a chain of matrix-vector
// products, bound by how fast the weights stream from memory, and about 40 small operations a layer. Neither
// library torch calls streams the weights at the memory's speed for a single column (oneDNN 19-33 GB/s over
// SmolLM2's shapes, MKL 11-12 GB/s on one thread), and each small torch operation costs a few microseconds of
// dispatch, more than its arithmetic. Here the products are one row's dot product after another (one
// sequential stream of the weight per thread, the vector held in L1), and the rest runs in place on
// small buffers. The math is the general path's (forward.py's `_decode_layer`), which the tests compare it to.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// w . x over n floats. Four independent accumulators keep the fused multiply-adds from waiting on each other.
inline float dot(const float* w, const float* x, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; k + 64 <= n; k += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 32), _mm512_loadu_ps(x + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 48), _mm512_loadu_ps(x + k + 48), a3);
  }
  for (; k + 16 <= n; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
  sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 32 <= n; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= n; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
  __m256 all = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  sum = _mm_cvtss_f32(half);
#endif
  for (; k < n; ++k) sum += w[k] * x[k];
  return sum;
}

// Rows a thread takes at least: below this a product runs on one thread (a fork costs more than it saves).
constexpr int64_t kRowsPerThread = 32;
// The largest head the step's rotary scratch holds (cpu_decode.py refuses larger ones).
constexpr int64_t kMaxHeadDim = 1024;

// y[r] = W[r] . x (+ bias[r]) (+ residual[r]) for rows 0 .. out - 1 of W [out, in] (row-major).
void matrix_vector(const float* W, const float* x, const float* bias, const float* residual, float* y, int64_t out,
                   int64_t in) {
  at::parallel_for(0, out, kRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float value = dot(W + r * in, x, in);
      if (bias) value += bias[r];
      if (residual) value += residual[r];
      y[r] = value;
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

struct LayerWeights {
  torch::Tensor input_norm, qkv, proj, mlp_norm, fc1, fc2;
  c10::optional<torch::Tensor> qkv_bias, proj_bias, fc1_bias, fc2_bias;
};

// The model's weights (references to the training tensors: updates in place are seen) and the step's buffers.
class DecodeModel {
 public:
  DecodeModel(std::vector<LayerWeights> layers, torch::Tensor embedding, torch::Tensor final_norm,
              torch::Tensor output, int64_t heads, int64_t groups, int64_t head_dim, double scale, double eps)
      : layers_(std::move(layers)), embedding_(embedding), final_norm_(final_norm), output_(output), heads_(heads),
        groups_(groups), head_dim_(head_dim), scale_(static_cast<float>(scale)), eps_(static_cast<float>(eps)) {
    hidden_size_ = embedding_.size(1);
    ffn_ = layers_.empty() ? 0 : layers_[0].fc2.size(1);
    const int64_t qkv_rows = (heads_ + 2 * groups_) * head_dim_;
    hidden_.resize(hidden_size_);
    normed_.resize(hidden_size_);
    qkv_.resize(qkv_rows);
    context_.resize(heads_ * head_dim_);
    intermediate_.resize(2 * ffn_);
  }

  // One token (tokens [1] long) at cache column `column` (also its position), attending to columns
  // 0 .. kv_len - 1. cos, sin [d] the rotary angles at the position; keys [layers, rows, groups, d, len] and
  // values [layers, rows, groups, len, d], row 0 used. Returns the logits [1, vocab].
  torch::Tensor step(const torch::Tensor& tokens, int64_t column, int64_t kv_len, const torch::Tensor& cos,
                     const torch::Tensor& sin, const torch::Tensor& keys, const torch::Tensor& values) {
    // What the raw reads and writes below rely on: a wrong call fails here, never as memory corruption.
    TORCH_CHECK(tokens.numel() == 1 && tokens.scalar_type() == torch::kLong, "cpu_decode: one long token");
    TORCH_CHECK(cos.numel() == head_dim_ && sin.numel() == head_dim_ && cos.is_contiguous() && sin.is_contiguous(),
                "cpu_decode: cos and sin of ", head_dim_, " contiguous values");
    TORCH_CHECK(keys.dim() == 5 && values.dim() == 5 && keys.stride(4) == 1 && values.stride(4) == 1 &&
                    keys.size(0) == static_cast<int64_t>(layers_.size()) && keys.size(2) == groups_ &&
                    keys.size(3) == head_dim_ && values.size(4) == head_dim_,
                "cpu_decode: keys [layers, rows, groups, d, len] and values [layers, rows, groups, len, d]");
    TORCH_CHECK(0 <= column && column < kv_len && kv_len <= keys.size(4) && kv_len <= values.size(3),
                "cpu_decode: column ", column, " and kv_len ", kv_len, " outside the cache");
    const int64_t token = tokens.data_ptr<int64_t>()[0];
    TORCH_CHECK(0 <= token && token < embedding_.size(0), "cpu_decode: token ", token, " outside the vocabulary");
    const float* row = embedding_.data_ptr<float>() + token * hidden_size_;
    std::copy(row, row + hidden_size_, hidden_.begin());
    std::vector<float> scores(static_cast<size_t>(heads_ * kv_len));
    for (size_t index = 0; index < layers_.size(); ++index) {
      const Cache cache{keys.data_ptr<float>() + index * keys.stride(0), keys.stride(2), keys.stride(3),
                        values.data_ptr<float>() + index * values.stride(0), values.stride(2), values.stride(3)};
      layer(layers_[index], column, kv_len, cos.data_ptr<float>(), sin.data_ptr<float>(), cache, scores.data());
    }
    rms_norm(hidden_.data(), final_norm_.data_ptr<float>(), eps_, normed_.data(), hidden_size_);
    const int64_t vocab = output_.size(0);
    torch::Tensor logits = torch::empty({1, vocab}, output_.options());
    matrix_vector(output_.data_ptr<float>(), normed_.data(), nullptr, nullptr, logits.data_ptr<float>(), vocab,
                  hidden_size_);
    return logits;
  }

 private:
  // One layer's cache of row 0: keys [groups, d, len] and values [groups, len, d], by their strides (elements).
  struct Cache {
    float* keys;
    int64_t key_group, key_row;  // between groups; between feature rows of a group (the cache's length)
    float* values;
    int64_t value_group, value_row;  // between groups; between columns of a group
  };

  void layer(const LayerWeights& w, int64_t column, int64_t kv_len, const float* cos, const float* sin,
             const Cache& cache, float* scores) {
    const int64_t d = head_dim_, per_group = heads_ / groups_, hidden = hidden_size_;
    const int64_t key_group = cache.key_group, key_row = cache.key_row;
    const int64_t value_group = cache.value_group, value_row = cache.value_row;
    float* key_cache = cache.keys;
    float* value_cache = cache.values;
    rms_norm(hidden_.data(), w.input_norm.data_ptr<float>(), eps_, normed_.data(), hidden);
    matrix_vector(w.qkv.data_ptr<float>(), normed_.data(), optional_data(w.qkv_bias), nullptr, qkv_.data(),
                  w.qkv.size(0), hidden);
    // qkv per group: [q_1 .. q_per_group, k, v] (megatron's interleaved layout); rotary on the queries and the key
    float scratch[kMaxHeadDim];
    for (int64_t g = 0; g < groups_; ++g) {
      float* block = qkv_.data() + g * (per_group + 2) * d;
      for (int64_t h = 0; h <= per_group; ++h) rotate(block + h * d, cos, sin, d, scratch);
      const float* key = block + per_group * d;
      const float* value = key + d;
      float* keys_g = key_cache + g * key_group;
      for (int64_t i = 0; i < d; ++i) keys_g[i * key_row + column] = key[i];
      std::copy(value, value + d, value_cache + g * value_group + column * value_row);
    }
    // attention, head by head: scores over the seen columns, softmax, the values' weighted sum
    const bool threaded = kv_len * d * heads_ >= (1 << 16);
    at::parallel_for(0, heads_, threaded ? 1 : heads_, [&](int64_t begin, int64_t end) {
      for (int64_t head = begin; head < end; ++head) {
        const int64_t g = head / per_group, q_index = head % per_group;
        const float* query = qkv_.data() + (g * (per_group + 2) + q_index) * d;
        const float* keys_g = key_cache + g * key_group;
        float* s = scores + head * kv_len;
        std::fill(s, s + kv_len, 0.0f);
        for (int64_t i = 0; i < d; ++i) {
          const float q = query[i];
          const float* key_row_i = keys_g + i * key_row;
          for (int64_t j = 0; j < kv_len; ++j) s[j] += q * key_row_i[j];
        }
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < kv_len; ++j) top = std::max(top, s[j] *= scale_);
        float total = 0.0f;
        for (int64_t j = 0; j < kv_len; ++j) total += (s[j] = std::exp(s[j] - top));
        const float inverse = 1.0f / total;
        float* out = context_.data() + head * d;
        std::fill(out, out + d, 0.0f);
        const float* values_g = value_cache + g * value_group;
        for (int64_t j = 0; j < kv_len; ++j) {
          const float p = s[j] * inverse;
          const float* v = values_g + j * value_row;
          for (int64_t i = 0; i < d; ++i) out[i] += p * v[i];
        }
      }
    });
    // hidden += proj(context) (+ bias), in place: each row of the product reads hidden[r] once, then writes it
    matrix_vector(w.proj.data_ptr<float>(), context_.data(), optional_data(w.proj_bias), hidden_.data(),
                  hidden_.data(), hidden, heads_ * d);
    rms_norm(hidden_.data(), w.mlp_norm.data_ptr<float>(), eps_, normed_.data(), hidden);
    matrix_vector(w.fc1.data_ptr<float>(), normed_.data(), optional_data(w.fc1_bias), nullptr, intermediate_.data(),
                  2 * ffn_, hidden);
    float* gate = intermediate_.data();
    const float* up = gate + ffn_;
    for (int64_t i = 0; i < ffn_; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // silu(gate) * up
    matrix_vector(w.fc2.data_ptr<float>(), gate, optional_data(w.fc2_bias), hidden_.data(), hidden_.data(), hidden,
                  ffn_);
  }

  std::vector<LayerWeights> layers_;
  torch::Tensor embedding_, final_norm_, output_;
  int64_t heads_, groups_, head_dim_, hidden_size_, ffn_;
  float scale_, eps_;
  std::vector<float> hidden_, normed_, qkv_, context_, intermediate_;
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
  pybind11::class_<LayerWeights>(module, "LayerWeights")
      .def(pybind11::init([](torch::Tensor input_norm, torch::Tensor qkv, c10::optional<torch::Tensor> qkv_bias,
                             torch::Tensor proj, c10::optional<torch::Tensor> proj_bias, torch::Tensor mlp_norm,
                             torch::Tensor fc1, c10::optional<torch::Tensor> fc1_bias, torch::Tensor fc2,
                             c10::optional<torch::Tensor> fc2_bias) {
        return LayerWeights{input_norm, qkv, proj, mlp_norm, fc1, fc2, qkv_bias, proj_bias, fc1_bias, fc2_bias};
      }));
  pybind11::class_<DecodeModel>(module, "DecodeModel")
      .def(pybind11::init<std::vector<LayerWeights>, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def("step", &DecodeModel::step, pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("parallel_threads", &parallel_threads);
}
