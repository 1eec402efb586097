#include "loader/config.h"

#include <algorithm>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

#include "core/json.h"
#include "core/status.h"
#include "loader/loader.h"

namespace accel::loader {
namespace {

using Json = nlohmann::json;

// The largest model dimension a config may give (see FieldReader::Size).
constexpr int64_t kMaxSize = int64_t{1} << 26;
using OrderedJson = nlohmann::ordered_json;

// Reads known fields out of a JSON object, remembering which it consumed and
// stopping at the first type error, which names the source and the field.
class FieldReader {
 public:
  FieldReader(const Json& object, absl::string_view label) : object_(object), label_(label) {}

  const Json* Get(absl::string_view name) {
    consumed_.insert(std::string(name));
    auto it = object_.find(std::string(name));
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  void Int(absl::string_view name, int64_t* out) {
    if (const Json* v = Get(name)) {
      if (auto i = AsInt(*v))
        *out = *i;
      else
        Fail(name, "a non-negative integer", *v);
    }
  }
  // A model dimension. Bounded so products of two (vocab x hidden) and byte
  // counts stay far inside int64 (an n_embd of 2^63 overflowed 4 x n_embd).
  void Size(absl::string_view name, int64_t* out) {
    if (const Json* v = Get(name)) {
      auto i = AsInt(*v);
      if (i && *i <= kMaxSize) {
        *out = *i;
      } else {
        Fail(name, absl::StrCat("an integer from 0 to ", kMaxSize), *v);
      }
    }
  }
  void OptionalInt(absl::string_view name, std::optional<int64_t>* out) {
    if (const Json* v = Get(name)) {
      if (auto i = AsInt(*v))
        *out = *i;
      else
        Fail(name, "a non-negative integer", *v);
    }
  }
  void Number(absl::string_view name, double* out) {
    if (const Json* v = Get(name)) {
      if (v->is_number())
        *out = v->get<double>();
      else
        Fail(name, "a number", *v);
    }
  }
  void OptionalNumber(absl::string_view name, std::optional<double>* out) {
    double value = 0;
    if (Get(name) == nullptr) return;
    Number(name, &value);
    *out = value;
  }
  // A number that may be null: absent keeps *out (a family default), null
  // clears it, a number sets it.
  void NullableNumber(absl::string_view name, std::optional<double>* out) {
    consumed_.insert(std::string(name));
    auto it = object_.find(std::string(name));
    if (it == object_.end()) return;
    if (it->is_null()) {
      out->reset();
    } else if (it->is_number()) {
      *out = it->get<double>();
    } else {
      Fail(name, "a number or null", *it);
    }
  }
  // An integer that may be null, like NullableNumber.
  void NullableInt(absl::string_view name, std::optional<int64_t>* out) {
    consumed_.insert(std::string(name));
    auto it = object_.find(std::string(name));
    if (it == object_.end()) return;
    if (it->is_null()) {
      out->reset();
    } else if (auto i = AsInt(*it)) {
      *out = *i;
    } else {
      Fail(name, "a non-negative integer or null", *it);
    }
  }
  void OptionalSize(absl::string_view name, std::optional<int64_t>* out) {
    int64_t value = 0;
    if (Get(name) == nullptr) return;
    Size(name, &value);
    *out = value;
  }
  void OptionalString(absl::string_view name, std::optional<std::string>* out) {
    std::string value;
    if (Get(name) == nullptr) return;
    String(name, &value);
    *out = value;
  }
  // A list of non-negative integers; returns whether the field was there.
  bool Ints(absl::string_view name, std::vector<int64_t>* out) {
    const Json* v = Get(name);
    if (v == nullptr) return false;
    if (!v->is_array()) {
      Fail(name, "a list of non-negative integers", *v);
      return true;
    }
    for (const Json& item : *v) {
      auto i = AsInt(item);
      if (!i) {
        Fail(name, "a list of non-negative integers", *v);
        return true;
      }
      out->push_back(*i);
    }
    return true;
  }
  void Bool(absl::string_view name, bool* out) {
    if (const Json* v = Get(name)) {
      if (v->is_boolean())
        *out = v->get<bool>();
      else
        Fail(name, "true or false", *v);
    }
  }
  void OptionalBool(absl::string_view name, std::optional<bool>* out) {
    bool value = false;
    if (Get(name) == nullptr) return;
    Bool(name, &value);
    *out = value;
  }
  void String(absl::string_view name, std::string* out) {
    if (const Json* v = Get(name)) {
      if (v->is_string())
        *out = v->get<std::string>();
      else
        Fail(name, "a string", *v);
    }
  }
  void Strings(absl::string_view name, std::vector<std::string>* out) {
    if (const Json* v = Get(name)) {
      if (!v->is_array()) return Fail(name, "a list of strings", *v);
      for (const Json& s : *v) {
        if (!s.is_string()) return Fail(name, "a list of strings", *v);
        out->push_back(s.get<std::string>());
      }
    }
  }
  // One id or a list of ids (eos_token_id).
  void Ids(absl::string_view name, std::vector<int64_t>* out) {
    if (const Json* v = Get(name)) {
      if (auto i = AsInt(*v)) {
        out->push_back(*i);
        return;
      }
      if (!v->is_array()) return Fail(name, "a token id or a list of token ids", *v);
      for (const Json& id : *v) {
        auto i = AsInt(id);
        if (!i) return Fail(name, "a token id or a list of token ids", *v);
        out->push_back(*i);
      }
    }
  }

  void Fail(absl::string_view name, absl::string_view expected, const Json& got) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(label_, ": field '", name, "': expected ", expected, ", got ", got.dump()));
    }
  }

  std::map<std::string, std::string> Extra() const {
    std::map<std::string, std::string> extra;
    for (const auto& [key, value] : object_.items()) {
      if (!consumed_.count(key)) extra.emplace(key, value.dump());
    }
    return extra;
  }
  const absl::Status& status() const { return status_; }

 private:
  static std::optional<int64_t> AsInt(const Json& v) {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return static_cast<int64_t>(u);
    }
    if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
    return std::nullopt;
  }

  const Json& object_;
  absl::string_view label_;
  std::set<std::string> consumed_;
  absl::Status status_;
};

absl::StatusOr<Json> ParseObject(absl::string_view text, absl::string_view label) {
  // Configs nest a few levels; unknown fields are kept and written back, so
  // deep nesting would also make ToJson() quadratic (found by config_fuzz).
  JsonLimits limits;
  limits.max_depth = 32;
  ACCEL_ASSIGN_OR_RETURN(Json json, ParseJson(text, label, limits));
  if (!json.is_object())
    return absl::InvalidArgumentError(absl::StrCat(label, ": not a JSON object"));
  return json;
}

void PutExtra(OrderedJson& out, const std::map<std::string, std::string>& extra) {
  for (const auto& [key, text] : extra) {
    if (out.contains(key)) continue;
    // Our own dump of the field, so it parses; linear even for a large one.
    absl::StatusOr<OrderedJson> value = ParseOrderedJson(text, key);
    out[key] = value.ok() ? *std::move(value) : OrderedJson();
  }
}

void PutIds(OrderedJson& out, const char* name, const std::vector<int64_t>& ids) {
  if (ids.size() == 1) out[name] = ids[0];
  if (ids.size() > 1) out[name] = ids;
}

bool IsGpt2(const ModelConfig& c) { return c.model_type == "gpt2"; }
bool IsGemma(const ModelConfig& c) {
  return c.model_type == "gemma2" || c.model_type == "gemma3_text";
}
// Mixtral's name for the expert count; the Qwen MoE families say num_experts.
const char* NumExpertsKey(const ModelConfig& c) {
  return c.model_type == "mixtral" ? "num_local_experts" : "num_experts";
}

}  // namespace

int64_t ModelConfig::head_size() const {
  if (head_dim > 0) return head_dim;
  return num_attention_heads > 0 ? hidden_size / num_attention_heads : 0;
}

absl::Status ModelConfig::Validate() const {
  const bool gpt2 = IsGpt2(*this);
  auto need = [&](const char* name, const char* gpt2_name, int64_t v) -> absl::Status {
    if (v > 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("config.json: field '", gpt2 ? gpt2_name : name,
                                                   "' must be a positive integer"));
  };
  ACCEL_RETURN_IF_ERROR(need("vocab_size", "vocab_size", vocab_size));
  ACCEL_RETURN_IF_ERROR(need("hidden_size", "n_embd", hidden_size));
  ACCEL_RETURN_IF_ERROR(need("num_hidden_layers", "n_layer", num_hidden_layers));
  ACCEL_RETURN_IF_ERROR(need("num_attention_heads", "n_head", num_attention_heads));
  ACCEL_RETURN_IF_ERROR(need("intermediate_size", "n_inner", intermediate_size));
  if (head_dim == 0 && hidden_size % num_attention_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: hidden_size ", hidden_size,
                                                   " is not divisible by num_attention_heads ",
                                                   num_attention_heads));
  }
  if (num_attention_heads % kv_heads() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: num_attention_heads ", num_attention_heads,
                     " is not divisible by num_key_value_heads ", kv_heads()));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view text, absl::string_view label) {
  ACCEL_ASSIGN_OR_RETURN(Json json, ParseObject(text, label));
  FieldReader r(json, label);
  ModelConfig c;
  r.Strings("architectures", &c.architectures);
  r.String("model_type", &c.model_type);
  const bool gpt2 = IsGpt2(c);
  r.Size("vocab_size", &c.vocab_size);
  if (gpt2) {
    c.tie_word_embeddings = true;
    c.hidden_act = "gelu_new";
    c.norm_eps = 1e-5;
    r.Size("n_embd", &c.hidden_size);
    r.Size("n_layer", &c.num_hidden_layers);
    r.Size("n_head", &c.num_attention_heads);
    r.Size("n_positions", &c.max_position_embeddings);
    r.Size("n_inner", &c.intermediate_size);
    if (c.intermediate_size == 0) {
      // n_inner: null means 4 x n_embd, which must respect the same bound
      // (found by config_fuzz: a larger one did not survive ToJson()).
      c.intermediate_size = 4 * c.hidden_size;
      if (c.intermediate_size > kMaxSize) {
        if (const Json* n_embd = r.Get("n_embd")) {
          r.Fail("n_embd", absl::StrCat("at most ", kMaxSize / 4, " when n_inner is null"),
                 *n_embd);
        }
      }
    }
    r.Number("layer_norm_epsilon", &c.norm_eps);
    r.String("activation_function", &c.hidden_act);
  } else {
    r.Size("hidden_size", &c.hidden_size);
    r.Size("intermediate_size", &c.intermediate_size);
    r.Size("num_hidden_layers", &c.num_hidden_layers);
    r.Size("num_attention_heads", &c.num_attention_heads);
    r.Size("num_key_value_heads", &c.num_key_value_heads);
    if (IsGemma(c)) {
      // transformers' Gemma2Config / Gemma3TextConfig defaults, for fields a
      // config leaves out (configuration_gemma2.py, configuration_gemma3.py).
      c.tie_word_embeddings = true;
      c.head_dim = 256;
      c.hidden_activation = "gelu_pytorch_tanh";
      c.query_pre_attn_scalar = 256;
      c.sliding_window = 4096;
      if (c.model_type == "gemma2") {
        c.attn_logit_softcapping = 50.0;
        c.final_logit_softcapping = 30.0;
      } else {
        c.rope_theta = 1'000'000.0;
        c.rope_local_base_freq = 10'000.0;
        c.sliding_window_pattern = 6;
      }
    }
    // Qwen3Config names head_dim with a default of 128, not hidden / heads.
    if (c.model_type == "qwen3") c.head_dim = 128;
    r.Size("head_dim", &c.head_dim);
    r.Size("max_position_embeddings", &c.max_position_embeddings);
    r.Number("rms_norm_eps", &c.norm_eps);
    r.Number("rope_theta", &c.rope_theta);
    r.Bool("attention_bias", &c.attention_bias);
    r.NullableInt("sliding_window", &c.sliding_window);
    r.String("hidden_act", &c.hidden_act);
    if (const Json* scaling = r.Get("rope_scaling")) {
      if (!scaling->is_object()) {
        r.Fail("rope_scaling", "an object", *scaling);
      } else {
        RopeScaling rs;
        for (const auto& [key, value] : scaling->items()) {
          if ((key == "rope_type" || key == "type") && value.is_string()) {
            rs.rope_type = value.get<std::string>();
          } else if (value.is_number()) {
            rs.numbers[key] = value.get<double>();
          } else if (value.is_array() && !value.empty() &&
                     std::all_of(value.begin(), value.end(),
                                 [](const Json& x) { return x.is_number(); })) {
            std::vector<double>& list = rs.lists[key];
            for (const Json& x : value) list.push_back(x.get<double>());
          } else {
            r.Fail(absl::StrCat("rope_scaling.", key), "a number or a list of numbers", value);
          }
        }
        c.rope_scaling = std::move(rs);
      }
    }
    // Mixture of experts.
    r.Size(NumExpertsKey(c), &c.moe.num_experts);
    r.Size("num_experts_per_tok", &c.moe.num_experts_per_tok);
    r.OptionalSize("moe_intermediate_size", &c.moe.moe_intermediate_size);
    r.OptionalSize("shared_expert_intermediate_size", &c.moe.shared_expert_intermediate_size);
    r.OptionalBool("norm_topk_prob", &c.moe.norm_topk_prob);
    r.OptionalSize("decoder_sparse_step", &c.moe.decoder_sparse_step);
    c.moe.has_mlp_only_layers = r.Ints("mlp_only_layers", &c.moe.mlp_only_layers);
    // Gemma.
    r.OptionalString("hidden_activation", &c.hidden_activation);
    r.NullableNumber("query_pre_attn_scalar", &c.query_pre_attn_scalar);
    r.NullableNumber("attn_logit_softcapping", &c.attn_logit_softcapping);
    r.NullableNumber("final_logit_softcapping", &c.final_logit_softcapping);
    r.OptionalSize("sliding_window_pattern", &c.sliding_window_pattern);
    r.Strings("layer_types", &c.layer_types);
    r.NullableNumber("rope_local_base_freq", &c.rope_local_base_freq);
    // Phi-3, and Qwen's window switch.
    r.OptionalSize("original_max_position_embeddings", &c.original_max_position_embeddings);
    if (const Json* v = r.Get("partial_rotary_factor")) {
      if (v->is_number()) {
        c.partial_rotary_factor = v->get<double>();
      } else {
        r.Fail("partial_rotary_factor", "a number", *v);
      }
    }
    r.OptionalBool("use_sliding_window", &c.use_sliding_window);
    r.OptionalBool("qkv_bias", &c.qkv_bias);
  }
  r.Bool("tie_word_embeddings", &c.tie_word_embeddings);
  r.String("torch_dtype", &c.torch_dtype);
  r.OptionalInt("bos_token_id", &c.bos_token_id);
  r.Ids("eos_token_id", &c.eos_token_ids);
  r.OptionalInt("pad_token_id", &c.pad_token_id);
  if (!r.status().ok()) return r.status();
  c.extra = r.Extra();
  return c;
}

std::string ModelConfig::ToJson() const {
  OrderedJson out = OrderedJson::object();
  if (!architectures.empty()) out["architectures"] = architectures;
  if (!model_type.empty()) out["model_type"] = model_type;
  out["vocab_size"] = vocab_size;
  if (IsGpt2(*this)) {
    out["n_embd"] = hidden_size;
    out["n_layer"] = num_hidden_layers;
    out["n_head"] = num_attention_heads;
    out["n_positions"] = max_position_embeddings;
    out["n_inner"] = intermediate_size;
    out["layer_norm_epsilon"] = norm_eps;
    out["activation_function"] = hidden_act;
  } else {
    out["hidden_size"] = hidden_size;
    out["intermediate_size"] = intermediate_size;
    out["num_hidden_layers"] = num_hidden_layers;
    out["num_attention_heads"] = num_attention_heads;
    out["num_key_value_heads"] = kv_heads();
    // Where the family's default is not hidden / heads, a 0 is written too,
    // so that reading it back does not bring the default in.
    if (head_dim > 0 || IsGemma(*this) || model_type == "qwen3") out["head_dim"] = head_dim;
    out["max_position_embeddings"] = max_position_embeddings;
    out["rms_norm_eps"] = norm_eps;
    out["rope_theta"] = rope_theta;
    if (rope_scaling) {
      OrderedJson rs = OrderedJson::object();
      if (!rope_scaling->rope_type.empty()) rs["rope_type"] = rope_scaling->rope_type;
      for (const auto& [key, value] : rope_scaling->numbers) rs[key] = value;
      for (const auto& [key, value] : rope_scaling->lists) rs[key] = value;
      out["rope_scaling"] = rs;
    }
    out["attention_bias"] = attention_bias;
    if (sliding_window) {
      out["sliding_window"] = *sliding_window;
    } else if (IsGemma(*this)) {
      out["sliding_window"] = nullptr;  // Gemma's default is 4096
    }
    out["hidden_act"] = hidden_act;
    if (moe.num_experts > 0) out[NumExpertsKey(*this)] = moe.num_experts;
    if (moe.num_experts_per_tok > 0) out["num_experts_per_tok"] = moe.num_experts_per_tok;
    if (moe.moe_intermediate_size) out["moe_intermediate_size"] = *moe.moe_intermediate_size;
    if (moe.shared_expert_intermediate_size)
      out["shared_expert_intermediate_size"] = *moe.shared_expert_intermediate_size;
    if (moe.norm_topk_prob) out["norm_topk_prob"] = *moe.norm_topk_prob;
    if (moe.decoder_sparse_step) out["decoder_sparse_step"] = *moe.decoder_sparse_step;
    if (moe.has_mlp_only_layers) out["mlp_only_layers"] = moe.mlp_only_layers;
    if (hidden_activation) out["hidden_activation"] = *hidden_activation;
    // Gemma's soft-caps and scalar have non-null defaults: write a null to keep one off.
    const auto nullable = [&](const char* name, const std::optional<double>& v) {
      if (v) {
        out[name] = *v;
      } else if (IsGemma(*this)) {
        out[name] = nullptr;
      }
    };
    nullable("query_pre_attn_scalar", query_pre_attn_scalar);
    nullable("attn_logit_softcapping", attn_logit_softcapping);
    nullable("final_logit_softcapping", final_logit_softcapping);
    if (sliding_window_pattern) out["sliding_window_pattern"] = *sliding_window_pattern;
    if (!layer_types.empty()) out["layer_types"] = layer_types;
    nullable("rope_local_base_freq", rope_local_base_freq);
    if (original_max_position_embeddings)
      out["original_max_position_embeddings"] = *original_max_position_embeddings;
    if (partial_rotary_factor) out["partial_rotary_factor"] = *partial_rotary_factor;
    if (use_sliding_window) out["use_sliding_window"] = *use_sliding_window;
    if (qkv_bias) out["qkv_bias"] = *qkv_bias;
  }
  out["tie_word_embeddings"] = tie_word_embeddings;
  if (!torch_dtype.empty()) out["torch_dtype"] = torch_dtype;
  if (bos_token_id) out["bos_token_id"] = *bos_token_id;
  PutIds(out, "eos_token_id", eos_token_ids);
  if (pad_token_id) out["pad_token_id"] = *pad_token_id;
  PutExtra(out, extra);
  return out.dump(2) + "\n";
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(absl::string_view text,
                                                       absl::string_view label) {
  ACCEL_ASSIGN_OR_RETURN(Json json, ParseObject(text, label));
  FieldReader r(json, label);
  GenerationConfig g;
  r.OptionalInt("bos_token_id", &g.bos_token_id);
  r.Ids("eos_token_id", &g.eos_token_ids);
  r.OptionalInt("pad_token_id", &g.pad_token_id);
  r.OptionalBool("do_sample", &g.do_sample);
  r.OptionalNumber("temperature", &g.temperature);
  r.OptionalInt("top_k", &g.top_k);
  r.OptionalNumber("top_p", &g.top_p);
  r.OptionalNumber("min_p", &g.min_p);
  r.OptionalNumber("repetition_penalty", &g.repetition_penalty);
  r.OptionalInt("max_new_tokens", &g.max_new_tokens);
  r.OptionalInt("max_length", &g.max_length);
  if (!r.status().ok()) return r.status();
  g.extra = r.Extra();
  return g;
}

std::string GenerationConfig::ToJson() const {
  OrderedJson out = OrderedJson::object();
  if (bos_token_id) out["bos_token_id"] = *bos_token_id;
  PutIds(out, "eos_token_id", eos_token_ids);
  if (pad_token_id) out["pad_token_id"] = *pad_token_id;
  if (do_sample) out["do_sample"] = *do_sample;
  if (temperature) out["temperature"] = *temperature;
  if (top_k) out["top_k"] = *top_k;
  if (top_p) out["top_p"] = *top_p;
  if (min_p) out["min_p"] = *min_p;
  if (repetition_penalty) out["repetition_penalty"] = *repetition_penalty;
  if (max_new_tokens) out["max_new_tokens"] = *max_new_tokens;
  if (max_length) out["max_length"] = *max_length;
  PutExtra(out, extra);
  return out.dump(2) + "\n";
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseModelConfig(text, path);
}

absl::StatusOr<GenerationConfig> ReadGenerationConfig(const std::string& path) {
  ACCEL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseGenerationConfig(text, path);
}

}  // namespace accel::loader
