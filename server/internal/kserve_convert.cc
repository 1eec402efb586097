#include "server/internal/kserve_convert.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <utility>
#include <variant>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/json.h"
#include "core/status.h"
#include "server/internal/quote.h"

namespace accel::server::internal {
namespace {

using InputTensor = inference::ModelInferRequest::InferInputTensor;
using OutputTensor = inference::ModelInferResponse::InferOutputTensor;

// Far above any real request; keeps shape products from overflowing and a
// hostile shape from sizing a huge allocation.
constexpr int64_t kMaxElements = int64_t{1} << 32;
// JSON in a parameter or in the sampling_parameters input: one flat object
// (a list of stop strings is the deepest thing in it), a few dozen keys.
JsonLimits ParameterJsonLimits() {
  JsonLimits limits;
  limits.max_depth = 4;
  limits.max_keys = 1024;
  return limits;
}

// ---------------------------------------------------------------------------
// Little-endian raw data.

uint64_t LoadLittleEndian(const char* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) {
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  }
  return v;
}

void AppendLittleEndian(uint64_t v, size_t bytes, std::string* out) {
  for (size_t i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// Element size of a fixed-size datatype, or 0 (BYTES, or unknown).
size_t ElementSize(absl::string_view datatype) {
  if (datatype == "BOOL" || datatype == "INT8" || datatype == "UINT8") return 1;
  if (datatype == "INT16" || datatype == "UINT16" || datatype == "FP16" || datatype == "BF16") {
    return 2;
  }
  if (datatype == "INT32" || datatype == "UINT32" || datatype == "FP32") return 4;
  if (datatype == "INT64" || datatype == "UINT64" || datatype == "FP64") return 8;
  return 0;
}

bool IsSignedInt(absl::string_view datatype) {
  return datatype == "INT8" || datatype == "INT16" || datatype == "INT32" || datatype == "INT64";
}
bool IsUnsignedInt(absl::string_view datatype) {
  return datatype == "UINT8" || datatype == "UINT16" || datatype == "UINT32" ||
         datatype == "UINT64";
}

std::string TensorLabel(const InputTensor& tensor) {
  return absl::StrCat("input ", Quote(tensor.name()));
}

// The typed-form element count must match the shape.
absl::Status CheckCount(const InputTensor& tensor, absl::string_view field, int64_t have,
                        int64_t want) {
  if (have == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(TensorLabel(tensor), ": contents.", field, " has ", have, " elements; shape [",
                   absl::StrJoin(tensor.shape(), ","), "] needs ", want));
}

// The raw-form byte count must match the shape.
absl::Status CheckRawSize(const InputTensor& tensor, const std::string& raw, int64_t count,
                          size_t element_size) {
  if (raw.size() == static_cast<size_t>(count) * element_size) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(TensorLabel(tensor), ": raw_input_contents has ", raw.size(), " bytes; shape [",
                   absl::StrJoin(tensor.shape(), ","), "] of ", tensor.datatype(), " needs ",
                   count * static_cast<int64_t>(element_size)));
}

absl::Status WrongDatatype(const InputTensor& tensor, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(TensorLabel(tensor), ": datatype must be ",
                                                 expected, ", got ", Quote(tensor.datatype())));
}

// Unsigned values (UINT64 as sent) keep their full range here; DecodeInts
// narrows them.
absl::StatusOr<std::vector<uint64_t>> DecodeUnsignedRaw(const InputTensor& tensor,
                                                        const std::string& raw, int64_t count) {
  const size_t size = ElementSize(tensor.datatype());
  ACCEL_RETURN_IF_ERROR(CheckRawSize(tensor, raw, count, size));
  std::vector<uint64_t> out(static_cast<size_t>(count));
  for (size_t i = 0; i < out.size(); ++i) out[i] = LoadLittleEndian(raw.data() + i * size, size);
  return out;
}

int64_t SignExtend(uint64_t v, size_t bytes) {
  if (bytes == 0 || bytes >= 8) return static_cast<int64_t>(v);
  const uint64_t sign = uint64_t{1} << (8 * bytes - 1);
  return static_cast<int64_t>((v ^ sign) - sign);
}

absl::StatusOr<std::vector<double>> DecodeFloats(const InputTensor& tensor,
                                                 const std::string* raw) {
  ACCEL_ASSIGN_OR_RETURN(const int64_t count, ElementCount(tensor));
  const std::string& type = tensor.datatype();
  std::vector<double> out;
  if (type == "FP32") {
    if (raw != nullptr) {
      ACCEL_RETURN_IF_ERROR(CheckRawSize(tensor, *raw, count, 4));
      for (int64_t i = 0; i < count; ++i) {
        const auto bits = static_cast<uint32_t>(LoadLittleEndian(raw->data() + i * 4, 4));
        float f;
        std::memcpy(&f, &bits, sizeof(f));
        out.push_back(f);
      }
    } else {
      ACCEL_RETURN_IF_ERROR(
          CheckCount(tensor, "fp32_contents", tensor.contents().fp32_contents_size(), count));
      out.assign(tensor.contents().fp32_contents().begin(),
                 tensor.contents().fp32_contents().end());
    }
  } else if (type == "FP64") {
    if (raw != nullptr) {
      ACCEL_RETURN_IF_ERROR(CheckRawSize(tensor, *raw, count, 8));
      for (int64_t i = 0; i < count; ++i) {
        const uint64_t bits = LoadLittleEndian(raw->data() + i * 8, 8);
        double d;
        std::memcpy(&d, &bits, sizeof(d));
        out.push_back(d);
      }
    } else {
      ACCEL_RETURN_IF_ERROR(
          CheckCount(tensor, "fp64_contents", tensor.contents().fp64_contents_size(), count));
      out.assign(tensor.contents().fp64_contents().begin(),
                 tensor.contents().fp64_contents().end());
    }
  } else {
    return WrongDatatype(tensor, "FP32 or FP64");
  }
  return out;
}

absl::StatusOr<std::vector<bool>> DecodeBools(const InputTensor& tensor, const std::string* raw) {
  if (tensor.datatype() != "BOOL") return WrongDatatype(tensor, "BOOL");
  ACCEL_ASSIGN_OR_RETURN(const int64_t count, ElementCount(tensor));
  std::vector<bool> out;
  if (raw != nullptr) {
    ACCEL_RETURN_IF_ERROR(CheckRawSize(tensor, *raw, count, 1));
    for (char c : *raw) out.push_back(c != 0);
  } else {
    ACCEL_RETURN_IF_ERROR(
        CheckCount(tensor, "bool_contents", tensor.contents().bool_contents_size(), count));
    out.assign(tensor.contents().bool_contents().begin(), tensor.contents().bool_contents().end());
  }
  return out;
}

// ---------------------------------------------------------------------------
// Sampling knobs: one set of names, three ways to send them.

// A knob's value as the client sent it, before it is read as the knob's type.
using Value = std::variant<bool, int64_t, uint64_t, double, std::string, std::vector<std::string>,
                           std::vector<int64_t>>;

const char* TypeName(const Value& v) {
  switch (v.index()) {
    case 0:
      return "a bool";
    case 1:
    case 2:
      return "an integer";
    case 3:
      return "a number";
    case 4:
      return "a string";
    case 5:
      return "a list of strings";
    default:
      return "a list of integers";
  }
}

enum class KnobType { kInt, kSeed, kDouble, kBool, kStrings, kInts };

struct Knob {
  const char* name;       // as the client writes it
  const char* canonical;  // aliases share one
  KnobType type;
};

// vLLM's SamplingParams names first, then the TensorRT-LLM ensemble's aliases.
constexpr Knob kKnobs[] = {
    {"max_tokens", "max_tokens", KnobType::kInt},
    {"max_new_tokens", "max_tokens", KnobType::kInt},
    {"temperature", "temperature", KnobType::kDouble},
    {"top_k", "top_k", KnobType::kInt},
    {"top_p", "top_p", KnobType::kDouble},
    {"min_p", "min_p", KnobType::kDouble},
    {"repetition_penalty", "repetition_penalty", KnobType::kDouble},
    {"seed", "seed", KnobType::kSeed},
    {"random_seed", "seed", KnobType::kSeed},
    {"stop", "stop", KnobType::kStrings},
    {"stop_words", "stop", KnobType::kStrings},
    {"stop_token_ids", "stop_token_ids", KnobType::kInts},
    {"ignore_eos", "ignore_eos", KnobType::kBool},
    {"return_logprobs", "return_logprobs", KnobType::kBool},
    {"stream", "stream", KnobType::kBool},
    {"exclude_input_in_output", "exclude_input_in_output", KnobType::kBool},
    // Triton's vLLM backend asks for these outputs one by one; we return them
    // anyway, so the flags are accepted and change nothing.
    {"return_finish_reason", "return_finish_reason", KnobType::kBool},
    {"return_num_input_tokens", "return_num_input_tokens", KnobType::kBool},
    {"return_num_output_tokens", "return_num_output_tokens", KnobType::kBool},
    // TensorRT-LLM clients send these with their neutral values.
    {"beam_width", "beam_width", KnobType::kInt},
    {"bad_words", "bad_words", KnobType::kStrings},
};

const Knob* FindKnob(absl::string_view name) {
  for (const Knob& knob : kKnobs) {
    if (name == knob.name) return &knob;
  }
  return nullptr;
}

std::string KnownKnobNames() {
  std::vector<std::string> names;
  for (const Knob& knob : kKnobs) names.emplace_back(knob.name);
  return absl::StrJoin(names, ", ");
}

// Triton's reserved request parameters (extension_parameters.md): they steer
// Triton itself, and a client written for Triton may send them to us.
bool IsReservedParameter(absl::string_view key) {
  static const std::set<absl::string_view>* const kReserved = new std::set<absl::string_view>{
      "sequence_id", "sequence_start", "sequence_end",      "priority",
      "timeout",     "headers",        "binary_data_output"};
  return absl::StartsWith(key, "triton_") || kReserved->count(key) > 0;
}

absl::Status KnobError(absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

absl::StatusOr<int64_t> AsInt(const Value& v, absl::string_view where) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&v)) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return KnobError(where, "is too large");
    }
    return static_cast<int64_t>(*u);
  }
  if (const auto* d = std::get_if<double>(&v)) {
    // JSON writers print 100 as 100.0 sometimes; a whole number is fine.
    if (std::trunc(*d) == *d && std::fabs(*d) < 9.0e15) return static_cast<int64_t>(*d);
    return KnobError(where, absl::StrCat("must be an integer, got ", *d));
  }
  if (const auto* s = std::get_if<std::string>(&v)) {
    // Triton's vLLM examples send every sampling value as a string.
    int64_t i;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*s), &i)) return i;
    return KnobError(where, absl::StrCat("must be an integer, got ", Quote(*s)));
  }
  return KnobError(where, absl::StrCat("must be an integer, got ", TypeName(v)));
}

absl::StatusOr<uint64_t> AsSeed(const Value& v, absl::string_view where) {
  if (const auto* u = std::get_if<uint64_t>(&v)) return *u;
  if (const auto* s = std::get_if<std::string>(&v)) {
    uint64_t u;
    if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*s), &u)) return u;
    return KnobError(where, absl::StrCat("must be an integer >= 0, got ", Quote(*s)));
  }
  ACCEL_ASSIGN_OR_RETURN(const int64_t i, AsInt(v, where));
  if (i < 0) return KnobError(where, absl::StrCat("must be >= 0, got ", i));
  return static_cast<uint64_t>(i);
}

absl::StatusOr<double> AsDouble(const Value& v, absl::string_view where) {
  double d;
  if (const auto* x = std::get_if<double>(&v)) {
    d = *x;
  } else if (const auto* i = std::get_if<int64_t>(&v)) {
    d = static_cast<double>(*i);
  } else if (const auto* u = std::get_if<uint64_t>(&v)) {
    d = static_cast<double>(*u);
  } else if (const auto* s = std::get_if<std::string>(&v)) {
    if (!absl::SimpleAtod(absl::StripAsciiWhitespace(*s), &d)) {
      return KnobError(where, absl::StrCat("must be a number, got ", Quote(*s)));
    }
  } else {
    return KnobError(where, absl::StrCat("must be a number, got ", TypeName(v)));
  }
  if (!std::isfinite(d)) return KnobError(where, "must be a finite number");
  return d;
}

absl::StatusOr<bool> AsBool(const Value& v, absl::string_view where) {
  if (const auto* b = std::get_if<bool>(&v)) return *b;
  if (const auto* i = std::get_if<int64_t>(&v); i != nullptr && (*i == 0 || *i == 1)) {
    return *i == 1;
  }
  if (const auto* u = std::get_if<uint64_t>(&v); u != nullptr && *u <= 1) return *u == 1;
  if (const auto* s = std::get_if<std::string>(&v)) {
    const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(*s));
    if (lower == "true" || lower == "1") return true;
    if (lower == "false" || lower == "0") return false;
    return KnobError(where, absl::StrCat("must be true or false, got ", Quote(*s)));
  }
  return KnobError(where, absl::StrCat("must be true or false, got ", TypeName(v)));
}

// A string is one stop string, or a JSON list of them (how a list travels in
// a string parameter). "[INST]" is not JSON and stays one string.
absl::StatusOr<std::vector<std::string>> AsStrings(const Value& v, absl::string_view where) {
  if (const auto* list = std::get_if<std::vector<std::string>>(&v)) return *list;
  if (const auto* ints = std::get_if<std::vector<int64_t>>(&v); ints != nullptr && ints->empty()) {
    return std::vector<std::string>{};
  }
  if (const auto* s = std::get_if<std::string>(&v)) {
    if (absl::StartsWith(absl::StripLeadingAsciiWhitespace(*s), "[")) {
      absl::StatusOr<nlohmann::json> j = ParseJson(*s, where, ParameterJsonLimits());
      if (j.ok() && j->is_array() && std::all_of(j->begin(), j->end(), [](const nlohmann::json& e) {
            return e.is_string();
          })) {
        return j->get<std::vector<std::string>>();
      }
    }
    return std::vector<std::string>{*s};
  }
  return KnobError(where, absl::StrCat("must be a string or a list of strings, got ", TypeName(v)));
}

absl::StatusOr<std::vector<int64_t>> AsInts(const Value& v, absl::string_view where) {
  if (const auto* list = std::get_if<std::vector<int64_t>>(&v)) return *list;
  if (const auto* strings = std::get_if<std::vector<std::string>>(&v);
      strings != nullptr && strings->empty()) {
    return std::vector<int64_t>{};
  }
  if (const auto* s = std::get_if<std::string>(&v)) {
    absl::StatusOr<nlohmann::json> j = ParseJson(*s, where, ParameterJsonLimits());
    if (j.ok() && j->is_array() && std::all_of(j->begin(), j->end(), [](const nlohmann::json& e) {
          return e.is_number_integer();
        })) {
      return j->get<std::vector<int64_t>>();
    }
    return KnobError(where, absl::StrCat("must be a list of integers, got ", Quote(*s)));
  }
  if (std::holds_alternative<int64_t>(v) || std::holds_alternative<uint64_t>(v)) {
    ACCEL_ASSIGN_OR_RETURN(const int64_t i, AsInt(v, where));
    return std::vector<int64_t>{i};
  }
  return KnobError(where, absl::StrCat("must be a list of integers, got ", TypeName(v)));
}

// Applies knobs to a KServeRequest, refusing one knob set twice (by alias
// or by two sources), since which one wins would be a guess.
class KnobSetter {
 public:
  explicit KnobSetter(KServeRequest* out) : out_(out) {}

  absl::Status Set(const Knob& knob, const Value& value, const std::string& where) {
    auto [it, inserted] = seen_.emplace(knob.canonical, where);
    if (!inserted) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", knob.canonical, " is already set by ", it->second));
    }
    engine::GenerationRequest& p = out_->params;
    const absl::string_view name = knob.canonical;
    switch (knob.type) {
      case KnobType::kInt: {
        ACCEL_ASSIGN_OR_RETURN(const int64_t i, AsInt(value, where));
        if (name == "max_tokens") {
          if (i < 0) return KnobError(where, absl::StrCat("must be >= 0, got ", i));
          p.max_new_tokens = i;
        } else if (name == "top_k") {
          p.sampling.top_k = i;
        } else if (name == "beam_width" && i != 1) {
          return KnobError(
              where, absl::StrCat("beam search is not supported; got ", i, ", only 1 is accepted"));
        }
        return absl::OkStatus();
      }
      case KnobType::kSeed: {
        ACCEL_ASSIGN_OR_RETURN(p.sampling.seed, AsSeed(value, where));
        return absl::OkStatus();
      }
      case KnobType::kDouble: {
        ACCEL_ASSIGN_OR_RETURN(const double d, AsDouble(value, where));
        if (name == "temperature") p.sampling.temperature = d;
        if (name == "top_p") p.sampling.top_p = d;
        if (name == "min_p") p.sampling.min_p = d;
        if (name == "repetition_penalty") p.sampling.repetition_penalty = d;
        return absl::OkStatus();
      }
      case KnobType::kBool: {
        ACCEL_ASSIGN_OR_RETURN(const bool b, AsBool(value, where));
        if (name == "ignore_eos") p.ignore_eos = b;
        if (name == "return_logprobs") p.logprobs = b;
        if (name == "stream") out_->stream = b;
        if (name == "exclude_input_in_output") out_->exclude_input = b;
        return absl::OkStatus();
      }
      case KnobType::kStrings: {
        ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> strings, AsStrings(value, where));
        // TensorRT-LLM clients send "" to mean "none".
        strings.erase(std::remove(strings.begin(), strings.end(), std::string()), strings.end());
        if (name == "bad_words") {
          if (!strings.empty()) return KnobError(where, "bad words are not supported");
        } else {
          p.stop_strings = std::move(strings);
        }
        return absl::OkStatus();
      }
      case KnobType::kInts: {
        ACCEL_ASSIGN_OR_RETURN(p.stop_token_ids, AsInts(value, where));
        return absl::OkStatus();
      }
    }
    return absl::OkStatus();
  }

 private:
  KServeRequest* const out_;
  std::map<std::string, std::string> seen_;  // canonical name -> where it was set
};

absl::StatusOr<Value> ParameterValue(const inference::InferParameter& parameter,
                                     absl::string_view where) {
  switch (parameter.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return Value(parameter.bool_param());
    case inference::InferParameter::kInt64Param:
      return Value(parameter.int64_param());
    case inference::InferParameter::kStringParam:
      return Value(parameter.string_param());
    case inference::InferParameter::kDoubleParam:
      return Value(parameter.double_param());
    case inference::InferParameter::kUint64Param:
      return Value(parameter.uint64_param());
    case inference::InferParameter::PARAMETER_CHOICE_NOT_SET:
      break;
  }
  return KnobError(where, "has no value");
}

absl::StatusOr<Value> JsonValue(const nlohmann::json& j, absl::string_view where) {
  switch (j.type()) {
    case nlohmann::json::value_t::boolean:
      return Value(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return Value(j.get<uint64_t>());
    case nlohmann::json::value_t::number_float:
      return Value(j.get<double>());
    case nlohmann::json::value_t::string:
      return Value(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      if (j.empty()) return Value(std::vector<std::string>{});
      if (std::all_of(j.begin(), j.end(), [](const nlohmann::json& e) { return e.is_string(); })) {
        return Value(j.get<std::vector<std::string>>());
      }
      if (std::all_of(j.begin(), j.end(),
                      [](const nlohmann::json& e) { return e.is_number_integer(); })) {
        return Value(j.get<std::vector<int64_t>>());
      }
      return KnobError(where, "must be a list of strings or a list of integers");
    }
    default:
      return KnobError(where, absl::StrCat("cannot be ", j.type_name()));
  }
}

absl::Status ApplySamplingJson(const std::string& text, KnobSetter* setter) {
  absl::StatusOr<nlohmann::json> parsed =
      ParseJson(text, "input \"sampling_parameters\"", ParameterJsonLimits());
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(parsed.status().message(),
                     "; expected one flat JSON object such as {\"temperature\": 0.7, "
                     "\"max_tokens\": 64}"));
  }
  const nlohmann::json& j = *parsed;
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("input \"sampling_parameters\": expected a JSON object, got ", j.type_name()));
  }
  for (const auto& [key, value] : j.items()) {
    const std::string where = absl::StrCat("sampling_parameters ", Quote(key));
    const Knob* knob = FindKnob(key);
    if (knob == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not a known sampling parameter; known: ", KnownKnobNames()));
    }
    if (value.is_null()) continue;  // vLLM's None: the default
    ACCEL_ASSIGN_OR_RETURN(const Value v, JsonValue(value, where));
    ACCEL_RETURN_IF_ERROR(setter->Set(*knob, v, where));
  }
  return absl::OkStatus();
}

// A knob sent as an input tensor (TensorRT-LLM's convention): one element,
// or any number for the list knobs (stop_words).
absl::StatusOr<Value> TensorValue(const Knob& knob, const InputTensor& tensor,
                                  const std::string* raw) {
  const std::string& type = tensor.datatype();
  const bool list = knob.type == KnobType::kStrings || knob.type == KnobType::kInts;
  ACCEL_ASSIGN_OR_RETURN(const int64_t count, ElementCount(tensor));
  if (!list && count != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(TensorLabel(tensor), ": must hold one element, has ", count));
  }
  if (type == "BYTES") {
    ACCEL_ASSIGN_OR_RETURN(std::vector<std::string> strings, DecodeBytes(tensor, raw));
    if (list) return Value(std::move(strings));
    return Value(std::move(strings[0]));
  }
  if (type == "BOOL") {
    ACCEL_ASSIGN_OR_RETURN(const std::vector<bool> bools, DecodeBools(tensor, raw));
    if (list) return KnobError(TensorLabel(tensor), "cannot be BOOL");
    return Value(static_cast<bool>(bools[0]));
  }
  if (type == "FP32" || type == "FP64") {
    ACCEL_ASSIGN_OR_RETURN(const std::vector<double> doubles, DecodeFloats(tensor, raw));
    if (list) return KnobError(TensorLabel(tensor), absl::StrCat("cannot be ", type));
    return Value(doubles[0]);
  }
  if (type == "UINT64" && !list) {
    // A random_seed may use all 64 bits.
    if (raw != nullptr) {
      ACCEL_ASSIGN_OR_RETURN(const std::vector<uint64_t> u, DecodeUnsignedRaw(tensor, *raw, 1));
      return Value(u[0]);
    }
    ACCEL_RETURN_IF_ERROR(
        CheckCount(tensor, "uint64_contents", tensor.contents().uint64_contents_size(), 1));
    return Value(tensor.contents().uint64_contents(0));
  }
  if (IsSignedInt(type) || IsUnsignedInt(type)) {
    ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> ints, DecodeInts(tensor, raw));
    if (list) return Value(std::move(ints));
    return Value(ints[0]);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(TensorLabel(tensor), ": datatype ", Quote(type), " is not accepted here"));
}

// ---------------------------------------------------------------------------
// Outputs.

const std::vector<std::string>& KnownOutputs() {
  static const std::vector<std::string>* const kOutputs = new std::vector<std::string>{
      kTextOutput, kOutputIds, kOutputLogProbs, kFinishReason, kNumInputTokens, kNumOutputTokens};
  return *kOutputs;
}

OutputTensor* AddOutput(absl::string_view name, absl::string_view datatype,
                        const std::vector<int64_t>& shape,
                        inference::ModelInferResponse* response) {
  OutputTensor* out = response->add_outputs();
  out->set_name(std::string(name));
  out->set_datatype(std::string(datatype));
  for (int64_t d : shape) out->add_shape(d);
  return out;
}

void AddBytesOutput(absl::string_view name, const std::vector<std::string>& values, bool raw,
                    inference::ModelInferResponse* response) {
  OutputTensor* out = AddOutput(name, "BYTES", {static_cast<int64_t>(values.size())}, response);
  if (raw) {
    response->add_raw_output_contents(EncodeRawBytes(values));
  } else {
    for (const std::string& v : values) out->mutable_contents()->add_bytes_contents(v);
  }
}

void AddUint32Output(absl::string_view name, const std::vector<int64_t>& values, bool raw,
                     inference::ModelInferResponse* response) {
  OutputTensor* out = AddOutput(name, "UINT32", {static_cast<int64_t>(values.size())}, response);
  if (raw) {
    std::string bytes;
    for (int64_t v : values) AppendLittleEndian(static_cast<uint32_t>(v), 4, &bytes);
    response->add_raw_output_contents(std::move(bytes));
  } else {
    for (int64_t v : values) out->mutable_contents()->add_uint_contents(static_cast<uint32_t>(v));
  }
}

// output_ids / output_log_probs: [G] for a rank-1 input_ids, else [N, G max].
std::vector<int64_t> RowsShape(const KServeRequest& request, size_t rows, size_t width) {
  if (request.ids_rank == 1) return {static_cast<int64_t>(width)};
  return {static_cast<int64_t>(rows), static_cast<int64_t>(width)};
}

void AddIdsOutput(const KServeRequest& request, const std::vector<GenerationResult>& results,
                  inference::ModelInferResponse* response) {
  size_t width = 0;
  for (const GenerationResult& r : results) width = std::max(width, r.token_ids.size());
  OutputTensor* out =
      AddOutput(kOutputIds, "INT64", RowsShape(request, results.size(), width), response);
  std::string bytes;
  for (const GenerationResult& r : results) {
    for (size_t j = 0; j < width; ++j) {
      const int64_t id = j < r.token_ids.size() ? r.token_ids[j] : kOutputIdsPad;
      if (request.raw) {
        AppendLittleEndian(static_cast<uint64_t>(id), 8, &bytes);
      } else {
        out->mutable_contents()->add_int64_contents(id);
      }
    }
  }
  if (request.raw) response->add_raw_output_contents(std::move(bytes));
}

void AddLogProbsOutput(const KServeRequest& request, const std::vector<GenerationResult>& results,
                       inference::ModelInferResponse* response) {
  size_t width = 0;
  for (const GenerationResult& r : results) width = std::max(width, r.token_ids.size());
  OutputTensor* out =
      AddOutput(kOutputLogProbs, "FP32", RowsShape(request, results.size(), width), response);
  std::string bytes;
  for (const GenerationResult& r : results) {
    for (size_t j = 0; j < width; ++j) {
      const float lp = j < r.logprobs.size() ? r.logprobs[j] : 0.0f;
      if (request.raw) {
        uint32_t bits;
        std::memcpy(&bits, &lp, sizeof(bits));
        AppendLittleEndian(bits, 4, &bytes);
      } else {
        out->mutable_contents()->add_fp32_contents(lp);
      }
    }
  }
  if (request.raw) response->add_raw_output_contents(std::move(bytes));
}

}  // namespace

// ---------------------------------------------------------------------------
// Tensors.

absl::StatusOr<int64_t> ElementCount(const InputTensor& tensor) {
  int64_t count = 1;
  for (int64_t d : tensor.shape()) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorLabel(tensor), ": shape [", absl::StrJoin(tensor.shape(), ","),
                       "] has a negative dimension; send the actual sizes"));
    }
    if (d > 0 && count > kMaxElements / d) {
      return absl::InvalidArgumentError(absl::StrCat(
          TensorLabel(tensor), ": shape [", absl::StrJoin(tensor.shape(), ","), "] is too large"));
    }
    count *= d;
  }
  return count;
}

absl::StatusOr<std::vector<std::string>> DecodeBytes(const InputTensor& tensor,
                                                     const std::string* raw) {
  if (tensor.datatype() != "BYTES") return WrongDatatype(tensor, "BYTES");
  ACCEL_ASSIGN_OR_RETURN(const int64_t count, ElementCount(tensor));
  if (raw == nullptr) {
    ACCEL_RETURN_IF_ERROR(
        CheckCount(tensor, "bytes_contents", tensor.contents().bytes_contents_size(), count));
    return std::vector<std::string>(tensor.contents().bytes_contents().begin(),
                                    tensor.contents().bytes_contents().end());
  }
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < raw->size()) {
    if (raw->size() - pos < 4) {
      return absl::InvalidArgumentError(absl::StrCat(
          TensorLabel(tensor), ": raw_input_contents element ", out.size(), " at byte ", pos,
          " is cut short: its 4-byte length prefix has only ", raw->size() - pos, " bytes"));
    }
    const uint64_t length = LoadLittleEndian(raw->data() + pos, 4);
    pos += 4;
    if (raw->size() - pos < length) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorLabel(tensor), ": raw_input_contents element ", out.size(), " says ",
                       length, " bytes but only ", raw->size() - pos, " remain"));
    }
    if (static_cast<int64_t>(out.size()) >= count) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorLabel(tensor), ": raw_input_contents holds more than the ", count,
                       " elements of shape [", absl::StrJoin(tensor.shape(), ","), "]"));
    }
    out.emplace_back(raw->data() + pos, length);
    pos += length;
  }
  if (static_cast<int64_t>(out.size()) != count) {
    return absl::InvalidArgumentError(
        absl::StrCat(TensorLabel(tensor), ": raw_input_contents holds ", out.size(),
                     " elements; shape [", absl::StrJoin(tensor.shape(), ","), "] needs ", count));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> DecodeInts(const InputTensor& tensor, const std::string* raw) {
  const std::string& type = tensor.datatype();
  if (!IsSignedInt(type) && !IsUnsignedInt(type)) {
    return WrongDatatype(tensor, "an integer type (INT64, INT32, ...)");
  }
  ACCEL_ASSIGN_OR_RETURN(const int64_t count, ElementCount(tensor));
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(count));
  const auto too_large = [&](uint64_t v) {
    return absl::InvalidArgumentError(
        absl::StrCat(TensorLabel(tensor), ": value ", v, " does not fit in INT64"));
  };
  if (raw != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(const std::vector<uint64_t> bits,
                           DecodeUnsignedRaw(tensor, *raw, count));
    const size_t size = ElementSize(type);
    for (uint64_t v : bits) {
      if (IsSignedInt(type)) {
        out.push_back(SignExtend(v, size));
      } else {
        if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return too_large(v);
        out.push_back(static_cast<int64_t>(v));
      }
    }
    return out;
  }
  const inference::InferTensorContents& c = tensor.contents();
  if (type == "INT64") {
    ACCEL_RETURN_IF_ERROR(CheckCount(tensor, "int64_contents", c.int64_contents_size(), count));
    out.assign(c.int64_contents().begin(), c.int64_contents().end());
  } else if (type == "UINT64") {
    ACCEL_RETURN_IF_ERROR(CheckCount(tensor, "uint64_contents", c.uint64_contents_size(), count));
    for (uint64_t v : c.uint64_contents()) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return too_large(v);
      out.push_back(static_cast<int64_t>(v));
    }
  } else if (IsSignedInt(type)) {
    ACCEL_RETURN_IF_ERROR(CheckCount(tensor, "int_contents", c.int_contents_size(), count));
    out.assign(c.int_contents().begin(), c.int_contents().end());
  } else {
    ACCEL_RETURN_IF_ERROR(CheckCount(tensor, "uint_contents", c.uint_contents_size(), count));
    out.assign(c.uint_contents().begin(), c.uint_contents().end());
  }
  return out;
}

std::string EncodeRawBytes(const std::vector<std::string>& elements) {
  std::string out;
  size_t size = 0;
  for (const std::string& e : elements) size += 4 + e.size();
  out.reserve(size);
  for (const std::string& e : elements) {
    AppendLittleEndian(e.size(), 4, &out);
    out += e;
  }
  return out;
}

// ---------------------------------------------------------------------------
// Requests.

absl::StatusOr<KServeRequest> ParseInferRequest(const inference::ModelInferRequest& request) {
  KServeRequest out;
  out.raw = request.raw_input_contents_size() > 0;
  if (out.raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents has ", request.raw_input_contents_size(),
                     " entries but the request has ", request.inputs_size(),
                     " inputs; send one entry per input, in the order of inputs"));
  }
  KnobSetter setter(&out);

  // Parameters first, so that errors name the first thing a reader sees.
  // A map's order is unspecified; sort the keys so errors are stable.
  std::vector<std::string> keys;
  for (const auto& [key, value] : request.parameters()) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  for (const std::string& key : keys) {
    if (IsReservedParameter(key)) continue;
    const std::string where = absl::StrCat("parameter ", Quote(key));
    const Knob* knob = FindKnob(key);
    if (knob == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " is not known; known: ", KnownKnobNames()));
    }
    ACCEL_ASSIGN_OR_RETURN(const Value v, ParameterValue(request.parameters().at(key), where));
    ACCEL_RETURN_IF_ERROR(setter.Set(*knob, v, where));
  }

  bool have_text = false;
  std::set<std::string> names;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const InputTensor& tensor = request.inputs(i);
    const std::string* raw = out.raw ? &request.raw_input_contents(i) : nullptr;
    if (!names.insert(tensor.name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorLabel(tensor), " appears more than once"));
    }
    if (out.raw && tensor.has_contents() && tensor.contents().ByteSizeLong() > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(TensorLabel(tensor),
                       ": sets contents while the request uses raw_input_contents; use one form "
                       "for all inputs"));
    }
    if (tensor.name() == kTextInput) {
      ACCEL_ASSIGN_OR_RETURN(out.prompts, DecodeBytes(tensor, raw));
      if (out.prompts.empty()) {
        return absl::InvalidArgumentError("input \"text_input\": has no elements");
      }
      have_text = true;
    } else if (tensor.name() == kInputIds) {
      if (tensor.shape_size() != 1 && tensor.shape_size() != 2) {
        return absl::InvalidArgumentError(
            absl::StrCat("input \"input_ids\": shape [", absl::StrJoin(tensor.shape(), ","),
                         "] must be [length] (one prompt) or [batch, length]"));
      }
      ACCEL_ASSIGN_OR_RETURN(const std::vector<int64_t> ids, DecodeInts(tensor, raw));
      const int64_t rows = tensor.shape_size() == 1 ? 1 : tensor.shape(0);
      const int64_t length = tensor.shape(tensor.shape_size() - 1);
      if (rows == 0 || length == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "input \"input_ids\": shape [", absl::StrJoin(tensor.shape(), ","), "] is empty"));
      }
      out.ids_rank = tensor.shape_size();
      for (int64_t r = 0; r < rows; ++r) {
        out.input_ids.emplace_back(ids.begin() + r * length, ids.begin() + (r + 1) * length);
      }
    } else if (tensor.name() == kSamplingParameters) {
      ACCEL_ASSIGN_OR_RETURN(const std::vector<std::string> json, DecodeBytes(tensor, raw));
      if (json.size() != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("input \"sampling_parameters\": must hold one JSON object, has ",
                         json.size(), " elements"));
      }
      ACCEL_RETURN_IF_ERROR(ApplySamplingJson(json[0], &setter));
    } else if (const Knob* knob = FindKnob(tensor.name()); knob != nullptr) {
      ACCEL_ASSIGN_OR_RETURN(const Value v, TensorValue(*knob, tensor, raw));
      ACCEL_RETURN_IF_ERROR(setter.Set(*knob, v, TensorLabel(tensor)));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          TensorLabel(tensor), " is not known; inputs: text_input or input_ids, optional ",
          "sampling_parameters (JSON), and scalar inputs named as parameters: ", KnownKnobNames()));
    }
  }
  if (have_text && out.ids_rank > 0) {
    return absl::InvalidArgumentError(
        "the request has both text_input and input_ids; send one of them");
  }
  if (!have_text && out.ids_rank == 0) {
    return absl::InvalidArgumentError(
        "the request has neither text_input (BYTES) nor input_ids (INT64 or INT32)");
  }
  if (!out.exclude_input && out.ids_rank > 0) {
    return absl::InvalidArgumentError(
        "exclude_input_in_output=false needs text_input: with input_ids there is no prompt text "
        "to repeat");
  }

  std::set<std::string> requested;
  for (const auto& output : request.outputs()) {
    const std::vector<std::string>& known = KnownOutputs();
    if (std::find(known.begin(), known.end(), output.name()) == known.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("requested output ", Quote(output.name()),
                       " is not known; outputs: ", absl::StrJoin(known, ", ")));
    }
    requested.insert(output.name());
  }
  // Asking for the output is asking for the logprobs.
  if (requested.count(kOutputLogProbs) > 0) out.params.logprobs = true;
  for (const std::string& name : KnownOutputs()) {
    bool wanted;
    if (!requested.empty()) {
      wanted = requested.count(name) > 0;
    } else if (name == kOutputIds) {
      wanted = out.ids_rank > 0;
    } else if (name == kOutputLogProbs) {
      wanted = out.params.logprobs;
    } else {
      wanted = true;
    }
    if (wanted) out.outputs.push_back(name);
  }
  return out;
}

engine::GenerationRequest PromptParams(const KServeRequest& request, size_t i) {
  engine::GenerationRequest params = request.params;
  if (request.ids_rank > 0) {
    params.prompt_ids = request.input_ids[i];
  } else {
    params.prompt = request.prompts[i];
  }
  return params;
}

std::string PromptName(const KServeRequest& request, size_t i) {
  const char* name = request.ids_rank > 0 ? kInputIds : kTextInput;
  if (request.num_prompts() == 1) return name;
  return absl::StrCat(name, "[", i, "]");
}

GenerationResult InitialResult(const KServeRequest& request, size_t i) {
  GenerationResult result;
  if (!request.exclude_input && request.ids_rank == 0) result.text = request.prompts[i];
  return result;
}

// ---------------------------------------------------------------------------
// Responses.

void BuildInferResponse(const KServeRequest& request, const std::vector<GenerationResult>& results,
                        bool final, inference::ModelInferResponse* response) {
  for (const std::string& name : request.outputs) {
    if (name == kTextOutput) {
      std::vector<std::string> texts;
      texts.reserve(results.size());
      for (const GenerationResult& r : results) texts.push_back(r.text);
      AddBytesOutput(name, texts, request.raw, response);
    } else if (name == kOutputIds) {
      AddIdsOutput(request, results, response);
    } else if (name == kOutputLogProbs) {
      AddLogProbsOutput(request, results, response);
    } else if (!final) {
      continue;  // the rest describe a finished generation
    } else if (name == kFinishReason) {
      std::vector<std::string> reasons;
      reasons.reserve(results.size());
      for (const GenerationResult& r : results) reasons.push_back(r.finish_reason);
      AddBytesOutput(name, reasons, request.raw, response);
    } else if (name == kNumInputTokens || name == kNumOutputTokens) {
      std::vector<int64_t> counts;
      counts.reserve(results.size());
      for (const GenerationResult& r : results) {
        counts.push_back(name == kNumInputTokens ? r.prompt_tokens : r.generated_tokens);
      }
      AddUint32Output(name, counts, request.raw, response);
    }
  }
}

}  // namespace accel::server::internal
