#include "train/launch_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fcntl.h>
#include <fstream>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <thread>
#include <unistd.h>
#include <utility>

#include <nlohmann/json.hpp>
#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

#include "core/json.h"

namespace accel::train {
namespace {

using Json = nlohmann::json;

// Accelerate's ClusterConfig fields (commands/config/config_args.py) and the
// legacy keys its loader converts (fp16, dynamo_backend). Anything else in a
// config file is an error.
const std::set<std::string>& KnownKeys() {
  static const auto* keys = new std::set<std::string>{
      "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug",
      "num_processes", "machine_rank", "num_machines", "gpu_ids", "main_process_ip",
      "main_process_port", "rdzv_backend", "same_network", "main_training_function",
      "enable_cpu_affinity", "fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config",
      "megatron_lm_config", "ipex_config", "mpirun_config", "dynamo_config", "downcast_bf16",
      "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands",
      "tpu_vm", "tpu_env",
      // Legacy, converted on load.
      "fp16", "dynamo_backend"};
  return *keys;
}

// ---------------------------------------------------------------------------
// YAML, read by yaml-cpp: anything valid that `accelerate config` writes
// (yaml.safe_dump, or JSON, which is YAML) or a person edits (anchors and
// aliases, `<<` merge keys, flow style, quoting, block scalars, comments).
// Values become JSON, so every file goes through the same field checks.

// yaml-cpp resolves aliases to shared nodes, so a document can name the same
// node many times over (a "billion laughs") or, through an anchor used inside
// itself, loop: conversion stops at these limits rather than exhaust memory or
// the stack.
constexpr int kMaxYamlDepth = 64;
constexpr int64_t kMaxYamlNodes = 100000;
// Keys are names. YAML limits an implicit key to 1024 characters, so a longer
// one (or one whose JSON escapes make it longer: up to 6 characters a byte)
// could not be read back from the JSON that accel-config writes.
constexpr size_t kMaxYamlKeyBytes = 128;

// A value as JSON text. YAML text need not be valid UTF-8, and nlohmann's
// dump() throws on what is not: such bytes become U+FFFD instead.
std::string JsonText(const Json& v) {
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

// `s` with each byte that is not valid UTF-8 replaced by U+FFFD, as JsonText
// would write it: done when reading, so that a config reads back unchanged
// from the JSON written of it.
std::string ValidUtf8(const std::string& s) {
  const bool ascii = std::none_of(s.begin(), s.end(),
                                  [](char c) { return static_cast<unsigned char>(c) >= 0x80; });
  if (ascii) return s;
  return Json::parse(JsonText(Json(s))).get<std::string>();
}

// "file:line:column: what", 1-based as editors count.
absl::Status YamlError(absl::string_view source, const YAML::Mark& mark, absl::string_view what) {
  if (mark.is_null()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", what));
  return absl::InvalidArgumentError(
      absl::StrCat(source, ":", mark.line + 1, ":", mark.column + 1, ": ", what));
}

// A plain (unquoted, untagged) scalar, typed as YAML 1.2's core schema does.
// Not PyYAML's 1.1 (where `no` and `off` are false): `distributed_type: NO`
// means the distributed type NO, as people write it by hand; the legacy
// `mixed_precision: false` of 1.1 readers is still converted (ParseClusterConfig).
Json PlainScalar(absl::string_view s) {
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  int64_t i = 0;
  if (s.find_first_not_of("+-0123456789") == absl::string_view::npos && absl::SimpleAtoi(s, &i)) {
    return i;
  }
  double d = 0;
  if (s.find_first_not_of("+-0123456789.eE") == absl::string_view::npos &&
      s.find_first_of("0123456789") != absl::string_view::npos && absl::SimpleAtod(s, &d) &&
      std::isfinite(d)) {
    return d;
  }
  return std::string(s);
}

class YamlToJson {
 public:
  explicit YamlToJson(absl::string_view source) : source_(source) {}

  // `at`: where to point when `node` itself has no position (an empty value
  // has none; its key does).
  absl::StatusOr<Json> Convert(const YAML::Node& node, const YAML::Mark& at, int depth) {
    const YAML::Mark mark = node.Mark().is_null() ? at : node.Mark();
    if (depth > kMaxYamlDepth) {
      return YamlError(source_, mark,
                       absl::StrCat("nested deeper than ", kMaxYamlDepth,
                                    " levels (an alias inside its own anchor?)"));
    }
    if (++nodes_ > kMaxYamlNodes) {
      return YamlError(source_, mark,
                       absl::StrCat("more than ", kMaxYamlNodes,
                                    " values once aliases are expanded; not a config file"));
    }
    if (node.IsSequence() || node.IsMap()) {
      const std::string& tag = node.Tag();
      if (tag != "?" && tag != "!" && !tag.empty() && tag != "tag:yaml.org,2002:seq" &&
          tag != "tag:yaml.org,2002:map") {
        return YamlError(source_, mark, absl::StrCat("tag ", tag, " is not supported"));
      }
    }
    switch (node.Type()) {
      case YAML::NodeType::Undefined:
      case YAML::NodeType::Null:
        return Json(nullptr);
      case YAML::NodeType::Scalar:
        return Scalar(node, mark);
      case YAML::NodeType::Sequence: {
        Json out = Json::array();
        for (auto it = node.begin(); it != node.end(); ++it) {
          const YAML::Node item = *it;  // a copy: the iterator yields a temporary
          absl::StatusOr<Json> v = Convert(item, mark, depth + 1);
          if (!v.ok()) return v.status();
          out.push_back(*std::move(v));
        }
        return out;
      }
      case YAML::NodeType::Map:
        return Mapping(node, mark, depth);
    }
    return YamlError(source_, mark, "unknown YAML node");
  }

 private:
  absl::StatusOr<Json> Scalar(const YAML::Node& node, const YAML::Mark& mark) {
    const std::string& tag = node.Tag();
    const std::string text = ValidUtf8(node.Scalar());
    if (tag == "!" || tag == "tag:yaml.org,2002:str") return Json(text);  // quoted, or !!str
    if (tag == "?" || tag.empty()) return PlainScalar(text);
    // The core schema's other explicit tags; anything else (PyYAML's
    // !!python/... included) names a type we cannot build, as safe_load refuses.
    const Json typed = PlainScalar(text);
    if ((tag == "tag:yaml.org,2002:int" && typed.is_number_integer()) ||
        (tag == "tag:yaml.org,2002:float" && typed.is_number()) ||
        (tag == "tag:yaml.org,2002:bool" && typed.is_boolean()) ||
        (tag == "tag:yaml.org,2002:null" && typed.is_null())) {
      return typed;
    }
    return YamlError(source_, mark,
                     absl::StrCat("tag ", tag, " on \"", text, "\" is not supported"));
  }

  absl::StatusOr<Json> Mapping(const YAML::Node& node, const YAML::Mark& mark, int depth) {
    Json out = Json::object();
    std::vector<Json> merged;  // `<<: *base` (YAML 1.1 merge keys, which PyYAML reads)
    for (auto it = node.begin(); it != node.end(); ++it) {
      // Copies: the iterator yields a temporary pair.
      const YAML::Node key = it->first;
      const YAML::Node value_node = it->second;
      const YAML::Mark key_mark = key.Mark().is_null() ? mark : key.Mark();
      if (!key.IsScalar()) {
        return YamlError(source_, key_mark, "a key must be text, not a list or mapping");
      }
      absl::StatusOr<Json> value = Convert(value_node, key_mark, depth + 1);
      if (!value.ok()) return value.status();
      if (key.Scalar() == "<<" && key.Tag() == "?") {
        if (value->is_object()) {
          merged.push_back(*std::move(value));
          continue;
        }
        if (value->is_array() && std::all_of(value->begin(), value->end(),
                                             [](const Json& j) { return j.is_object(); })) {
          for (Json& m : *value) merged.push_back(std::move(m));
          continue;
        }
        return YamlError(source_, key_mark, "`<<` merges a mapping or a list of mappings");
      }
      const std::string name = ValidUtf8(key.Scalar());
      if (name.size() > kMaxYamlKeyBytes) {
        return YamlError(source_, key_mark,
                         absl::StrCat("a key of ", name.size(), " bytes (at most ",
                                      kMaxYamlKeyBytes, ": keys are names)"));
      }
      if (out.contains(name)) {
        return YamlError(source_, key_mark, absl::StrCat("duplicate key ", name));
      }
      out[name] = *std::move(value);
    }
    // Keys written in the mapping win over merged ones; among merged
    // mappings the first wins, as YAML's merge key specifies.
    for (const Json& m : merged) {
      for (auto it = m.begin(); it != m.end(); ++it) {
        if (!out.contains(it.key())) out[it.key()] = it.value();
      }
    }
    return out;
  }

  absl::string_view source_;
  int64_t nodes_ = 0;
};

// Where each document of a YAML stream starts (events only, no nodes built).
class DocumentStarts : public YAML::EventHandler {
 public:
  std::vector<YAML::Mark> starts;
  void OnDocumentStart(const YAML::Mark& mark) override { starts.push_back(mark); }
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
  void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
  void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t,
                const std::string&) override {}
  void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                       YAML::EmitterStyle::value) override {}
  void OnSequenceEnd() override {}
  void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t,
                  YAML::EmitterStyle::value) override {}
  void OnMapEnd() override {}
};

absl::StatusOr<Json> ReadYaml(absl::string_view text, absl::string_view source) {
  // yaml-cpp reports malformed text by throwing; the message and the mark
  // (line and column) become the error, never a crash.
  YAML::Node document;
  try {
    // Documents are counted first, two at most. yaml-cpp 0.7's LoadAll never
    // returns when a document's root is followed by a ',' (`{"a": 1},`, an
    // easy slip in a JSON file): the parser makes an empty document of it
    // without consuming it, forever, until memory runs out. Stopping at the
    // second document turns that into an error at the ','.
    std::istringstream stream{std::string(text)};
    YAML::Parser parser(stream);
    DocumentStarts documents;
    while (documents.starts.size() < 2 && parser.HandleNextDocument(documents)) {
    }
    if (documents.starts.empty()) return Json::object();  // empty, or only comments
    if (documents.starts.size() > 1) {
      return YamlError(source, documents.starts[1],
                       "text after the end of the first YAML document (a second document, or a "
                       "stray ','?); a config file is one mapping");
    }
    document = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    return YamlError(source, e.mark, absl::StrCat("invalid YAML: ", e.msg));
  } catch (const std::exception& e) {  // e.g. bad_alloc on absurd input
    return absl::InvalidArgumentError(absl::StrCat(source, ": invalid YAML: ", e.what()));
  }
  absl::StatusOr<Json> root;
  try {
    root = YamlToJson(source).Convert(document, YAML::Mark::null_mark(), 0);
  } catch (const YAML::Exception& e) {
    return YamlError(source, e.mark, absl::StrCat("invalid YAML: ", e.msg));
  }
  if (!root.ok()) return root.status();
  if (root->is_null()) return Json::object();
  if (!root->is_object()) {
    return YamlError(source, document.Mark(),
                     absl::StrCat("the top level is ",
                                  root->is_array() ? std::string("a list")
                                                   : absl::StrCat("the value ", JsonText(*root)),
                                  ", not a mapping of keys"));
  }
  return root;
}

// Field readers: the value's JSON type, or the same as text (a quoted "4").
absl::Status WrongType(absl::string_view source, const std::string& key, const Json& v,
                       absl::string_view expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": ", key, " is ", JsonText(v), ", expected ", expected));
}

absl::StatusOr<bool> BoolField(absl::string_view source, const std::string& key, const Json& v) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_string()) {
    const std::string s = absl::AsciiStrToLower(v.get<std::string>());
    if (s == "true" || s == "yes" || s == "1") return true;
    if (s == "false" || s == "no" || s == "0") return false;
  }
  return WrongType(source, key, v, "true or false");
}

absl::StatusOr<int> IntField(absl::string_view source, const std::string& key, const Json& v,
                             int min, int max) {
  int64_t n = 0;
  bool ok = false;
  if (v.is_number_integer()) {
    n = v.get<int64_t>();
    ok = true;
  } else if (v.is_string()) {
    ok = absl::SimpleAtoi(v.get<std::string>(), &n);
  }
  if (!ok) return WrongType(source, key, v, "an integer");
  if (n < min || n > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": ", key, " is ", n, ", expected [", min, ", ", max, "]"));
  }
  return static_cast<int>(n);
}

absl::StatusOr<std::string> StringField(absl::string_view source, const std::string& key,
                                        const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number()) return JsonText(v);  // gpu_ids: 0
  return WrongType(source, key, v, "text");
}

absl::Status CheckPrecision(absl::string_view what, const std::string& p) {
  if (p == "no" || p == "fp16" || p == "bf16") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, " \"", p, "\": expected no, fp16 or bf16",
                   p == "fp8" ? " (fp8 needs Transformer Engine / MS-AMP, Python only)" : ""));
}

// torchrun's rendezvous backends; accel-launch's is static: machine 0 hosts
// the store at main_process_ip:main_process_port and every machine says its
// rank. Both values of same_network come to the same thing there.
absl::Status CheckRendezvous(absl::string_view what, const std::string& backend) {
  if (backend == "static") return absl::OkStatus();
  if (backend == "c10d" || backend == "etcd" || backend == "etcd-v2") {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", backend,
        "\": accel-launch has no elastic (dynamic) rendezvous; its rendezvous is static: machine "
        "0 hosts it at main_process_ip:main_process_port and each machine passes its "
        "--machine_rank (use static)"));
  }
  return absl::InvalidArgumentError(absl::StrCat(what, " \"", backend, "\": expected static"));
}

// A section that is absent, null or {} (how Accelerate's older versions wrote
// the ones not in use).
bool EmptySection(const Json& f, const std::string& key) {
  if (!f.contains(key)) return true;
  const Json& v = f.at(key);
  return v.is_null() || (v.is_object() && v.empty());
}

absl::Status Refuse(absl::string_view source, absl::string_view key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(source, ": ", key, ": ", why));
}

// Keys Accelerate knows that accel-launch cannot honour: a value that asks
// for them is refused (naming the key) rather than kept and ignored; their
// harmless defaults (NO, 'no', false, {}, null) are accepted. `legacy_dynamo`:
// the file said `dynamo_backend`, which the loader moved into dynamo_config.
absl::Status RefuseWhatLaunchCannotDo(const Json& f, absl::string_view source, bool legacy_dynamo) {
  if (!EmptySection(f, "dynamo_config")) {
    const Json& d = f.at("dynamo_config");
    if (!d.is_object()) return WrongType(source, "dynamo_config", d, "a mapping");
    if (d.contains("dynamo_backend") && !d.at("dynamo_backend").is_null()) {
      const Json& backend = d.at("dynamo_backend");
      if (!backend.is_string() || absl::AsciiStrToUpper(backend.get<std::string>()) != "NO") {
        return Refuse(source, legacy_dynamo ? "dynamo_backend" : "dynamo_config.dynamo_backend",
                      absl::StrCat(JsonText(backend),
                                   ": torch.compile backends exist only in Python; accel programs "
                                   "run eagerly (use NO)"));
      }
    }
  }
  struct Section {
    const char* key;
    const char* why;
  };
  for (const Section& section : {
           Section{"deepspeed_config",
                   "DeepSpeed is Python-only; accel-launch runs plain data parallel (remove the "
                   "section)"},
           Section{"parallelism_config",
                   "N-D parallelism (tensor / context parallel, ParallelismConfig) is not "
                   "implemented in accel; accel-launch runs data parallel or FSDP (remove the "
                   "section)"},
           Section{"fp8_config",
                   "fp8 training needs Transformer Engine / MS-AMP / torchao, Python only "
                   "(remove the section)"},
           Section{"megatron_lm_config",
                   "Megatron-LM is Python-only; accel-launch runs plain data parallel (remove the "
                   "section)"},
       }) {
    if (!EmptySection(f, section.key)) return Refuse(source, section.key, section.why);
  }
  if (!EmptySection(f, "fsdp_config")) {
    const Json& fsdp = f.at("fsdp_config");
    if (!fsdp.is_object()) return WrongType(source, "fsdp_config", fsdp, "a mapping");
    const bool fsdp_type =
        f.contains("distributed_type") && f.at("distributed_type").is_string() &&
        absl::AsciiStrToUpper(f.at("distributed_type").get<std::string>()) == "FSDP";
    if (!fsdp_type) {
      return Refuse(source, "fsdp_config",
                    "set, but distributed_type is not FSDP: it would be ignored (set "
                    "distributed_type: FSDP, or remove the section)");
    }
    for (auto it = fsdp.begin(); it != fsdp.end(); ++it) {
      if (it.value().is_object()) {
        return WrongType(source, absl::StrCat("fsdp_config.", it.key()), it.value(),
                         "a value or a list");
      }
    }
  }
  if (!EmptySection(f, "mpirun_config")) {
    const Json& m = f.at("mpirun_config");
    if (!m.is_object()) return WrongType(source, "mpirun_config", m, "a mapping");
    if (m.contains("mpirun_hostfile") && !m.at("mpirun_hostfile").is_null() &&
        !(m.at("mpirun_hostfile").is_string() &&
          m.at("mpirun_hostfile").get<std::string>().empty())) {
      return Refuse(source, "mpirun_config.mpirun_hostfile",
                    "accel-launch does not start ranks through mpirun; run accel-launch on each "
                    "machine with --num_machines and --machine_rank (or start the program with "
                    "mpirun yourself: the ranks read its variables)");
    }
  }
  if (f.contains("downcast_bf16") && !f.at("downcast_bf16").is_null()) {
    const Json& v = f.at("downcast_bf16");
    const bool off = (v.is_boolean() && !v.get<bool>()) ||
                     (v.is_string() && (absl::AsciiStrToLower(v.get<std::string>()) == "no" ||
                                        absl::AsciiStrToLower(v.get<std::string>()) == "false"));
    if (!off) {
      return Refuse(source, "downcast_bf16",
                    absl::StrCat(JsonText(v),
                                 ": downcasting to bfloat16 is for TPUs (XLA), which accel does "
                                 "not run (use 'no')"));
    }
  }
  if (!EmptySection(f, "ipex_config")) {
    const Json& i = f.at("ipex_config");
    if (!i.is_object()) return WrongType(source, "ipex_config", i, "a mapping");
    if (i.contains("ipex") && !i.at("ipex").is_null()) {
      absl::StatusOr<bool> ipex = BoolField(source, "ipex_config.ipex", i.at("ipex"));
      if (!ipex.ok()) return ipex.status();
      if (*ipex) {
        return Refuse(source, "ipex_config.ipex",
                      "Intel Extension for PyTorch is Python-only (use false)");
      }
    }
  }
  return absl::OkStatus();
}

// accel-launch's FSDP flags: Accelerate's launch arguments of the same names.
constexpr const char* kFsdpFlags[] = {"fsdp_version",
                                      "fsdp_sharding_strategy",
                                      "fsdp_reshard_after_forward",
                                      "fsdp_offload_params",
                                      "fsdp_min_num_params",
                                      "fsdp_auto_wrap_policy",
                                      "fsdp_transformer_layer_cls_to_wrap",
                                      "fsdp_backward_prefetch",
                                      "fsdp_state_dict_type",
                                      "fsdp_forward_prefetch",
                                      "fsdp_use_orig_params",
                                      "fsdp_cpu_ram_efficient_loading",
                                      "fsdp_sync_module_states",
                                      "fsdp_activation_checkpointing",
                                      "fsdp_ignored_modules"};

// An fsdp_config value as the launcher's environment spells it (Python's
// str() of what yaml.safe_load gave, lower-cased where Accelerate lowers):
// text as is, booleans true / false, numbers as written, a list joined by ','.
std::string FsdpValueText(const Json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "true" : "false";
  if (v.is_array()) {
    std::vector<std::string> items;
    for (const Json& item : v) items.push_back(FsdpValueText(item));
    return absl::StrJoin(items, ",");
  }
  return JsonText(v);
}

}  // namespace

absl::StatusOr<std::map<std::string, std::string>> FsdpEnvironment(
    const std::map<std::string, std::string>& settings) {
  auto get = [&](const std::string& name, const std::string& fallback) {
    auto it = settings.find(name);
    return it != settings.end() ? it->second : fallback;
  };
  auto lower = [&](const std::string& name, const std::string& fallback) {
    return absl::AsciiStrToLower(get(name, fallback));
  };
  std::map<std::string, std::string> env;
  env["ACCELERATE_USE_FSDP"] = "true";
  if (lower("fsdp_cpu_ram_efficient_loading", "true") == "true" &&
      lower("fsdp_sync_module_states", "true") != "true") {
    return absl::InvalidArgumentError(
        "fsdp_cpu_ram_efficient_loading true needs fsdp_sync_module_states true (the ranks "
        "that load no weights receive them from rank 0)");
  }
  // Accelerate's prepare_multi_gpu_env, with its launch defaults. Its
  // FSDP_MIN_NUM_PARAMS default is the float 1e8 ("100000000.0"), which
  // int() cannot read back; ours is the integer.
  env["FSDP_VERSION"] = get("fsdp_version", "1");
  env["FSDP_SHARDING_STRATEGY"] = get("fsdp_sharding_strategy", "FULL_SHARD");
  env["FSDP_RESHARD_AFTER_FORWARD"] = lower("fsdp_reshard_after_forward", "true");
  env["FSDP_OFFLOAD_PARAMS"] = lower("fsdp_offload_params", "false");
  env["FSDP_MIN_NUM_PARAMS"] = get("fsdp_min_num_params", "100000000");
  for (const auto& [setting, variable] : std::vector<std::pair<std::string, std::string>>{
           {"fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY"},
           {"fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP"},
           {"fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH"},
           {"fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE"},
           {"fsdp_ignored_modules", "FSDP_IGNORED_MODULES"}}) {
    if (auto it = settings.find(setting); it != settings.end()) env[variable] = it->second;
  }
  env["FSDP_FORWARD_PREFETCH"] = lower("fsdp_forward_prefetch", "false");
  env["FSDP_USE_ORIG_PARAMS"] = lower("fsdp_use_orig_params", "true");
  env["FSDP_CPU_RAM_EFFICIENT_LOADING"] = lower("fsdp_cpu_ram_efficient_loading", "true");
  env["FSDP_SYNC_MODULE_STATES"] = lower("fsdp_sync_module_states", "true");
  env["FSDP_ACTIVATION_CHECKPOINTING"] = lower("fsdp_activation_checkpointing", "false");
  // A setting no variable above carries would reach no rank: the ranks
  // cannot list the environment for what they do not know, so it is refused
  // here, by name, rather than passed on and ignored.
  for (const auto& [setting, value] : settings) {
    if (setting == "fsdp_transformer_layer_cls_to_wrap") continue;
    const std::string variable =
        absl::AsciiStrToUpper(absl::StrCat("FSDP_", absl::StripPrefix(setting, "fsdp_")));
    if (!env.count(variable)) {
      std::vector<std::string> known(std::begin(kFsdpFlags), std::end(kFsdpFlags));
      return absl::InvalidArgumentError(
          absl::StrCat("fsdp_config key ", setting, " (", value,
                       "): not one accel's FSDP reads (known: ", absl::StrJoin(known, ", "), ")"));
    }
  }
  return env;
}

ClusterConfig BasicClusterConfig(const std::string& mixed_precision, int cuda_devices) {
  ClusterConfig config;
  config.compute_environment = "LOCAL_MACHINE";
  config.mixed_precision = mixed_precision;
  config.num_processes = std::max(1, cuda_devices);
  config.distributed_type = cuda_devices > 1 ? "MULTI_GPU" : "NO";
  config.use_cpu = false;
  config.debug = false;
  config.enable_cpu_affinity = false;
  return config;
}

std::vector<int> CpuShare(const std::vector<int>& allowed, int local_rank, int local_processes) {
  if (allowed.empty() || local_processes < 1 || local_rank < 0 || local_rank >= local_processes) {
    return {};
  }
  const int n = static_cast<int>(allowed.size());
  if (n < local_processes) return {allowed[static_cast<size_t>(local_rank % n)]};
  // Contiguous shares, the first n % local_processes ranks one CPU more.
  const int base = n / local_processes, extra = n % local_processes;
  const int begin = local_rank * base + std::min(local_rank, extra);
  const int size = base + (local_rank < extra ? 1 : 0);
  return std::vector<int>(allowed.begin() + begin, allowed.begin() + begin + size);
}

absl::StatusOr<ClusterConfig> ParseClusterConfig(absl::string_view text, absl::string_view source) {
  // JSON (what accel-config and `accelerate config` write) is YAML too.
  absl::StatusOr<Json> fields = ReadYaml(text, source);
  if (!fields.ok()) return fields.status();
  std::vector<std::string> unknown;
  for (auto it = fields->begin(); it != fields->end(); ++it) {
    if (KnownKeys().count(it.key()) == 0) unknown.push_back(it.key());
  }
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    return absl::InvalidArgumentError(absl::StrCat(
        "The config file at ", source, " had unknown keys (['", absl::StrJoin(unknown, "', '"),
        "']), please try upgrading your `accel` version or fix (and potentially "
        "remove) these keys from your config file."));
  }
  // Accelerate's loader (process_config): the legacy forms first.
  Json& f = *fields;
  if (!f.contains("mixed_precision") || f["mixed_precision"].is_null()) {
    bool fp16 = false;
    if (f.contains("fp16") && !f["fp16"].is_null()) {
      absl::StatusOr<bool> b = BoolField(source, "fp16", f["fp16"]);
      if (!b.ok()) return b.status();
      fp16 = *b;
    }
    f["mixed_precision"] = fp16 ? "fp16" : "no";
  } else if (f["mixed_precision"].is_boolean()) {  // `mixed_precision: no` read as YAML 1.1
    f["mixed_precision"] = f["mixed_precision"].get<bool>() ? "fp16" : "no";
  }
  f.erase("fp16");
  const bool legacy_dynamo = f.contains("dynamo_backend");
  if (f.contains("dynamo_backend")) {
    Json backend = f["dynamo_backend"];
    f.erase("dynamo_backend");
    f["dynamo_config"] =
        backend.is_string() && absl::AsciiStrToUpper(backend.get<std::string>()) != "NO"
            ? Json{{"dynamo_backend", backend}}
            : Json::object();
  }

  ClusterConfig c;
  for (auto it = f.begin(); it != f.end(); ++it) {
    const std::string& key = it.key();
    const Json& v = it.value();
    if (v.is_null() && key != "main_process_port" && key != "main_process_ip") {
      if (key == "num_processes" || key == "compute_environment" || key == "distributed_type" ||
          key == "mixed_precision" || key == "use_cpu" || key == "debug" || key == "num_machines" ||
          key == "machine_rank" || key == "gpu_ids" || key == "rdzv_backend" ||
          key == "same_network" || key == "main_training_function" ||
          key == "enable_cpu_affinity") {
        continue;  // the default
      }
    }
    absl::Status status;
    auto set_bool = [&](bool* out) {
      absl::StatusOr<bool> b = BoolField(source, key, v);
      if (b.ok()) *out = *b;
      status = b.status();
    };
    auto set_int = [&](int* out, int min, int max) {
      absl::StatusOr<int> n = IntField(source, key, v, min, max);
      if (n.ok()) *out = *n;
      status = n.status();
    };
    auto set_string = [&](std::string* out) {
      absl::StatusOr<std::string> s = StringField(source, key, v);
      if (s.ok()) *out = *s;
      status = s.status();
    };
    if (key == "compute_environment") {
      set_string(&c.compute_environment);
      if (status.ok() && c.compute_environment == "AMAZON_SAGEMAKER") {
        status = Refuse(source, "compute_environment",
                        "AMAZON_SAGEMAKER: accel-launch starts processes on this machine; "
                        "SageMaker jobs are submitted by Python's accelerate (use LOCAL_MACHINE)");
      } else if (status.ok() && c.compute_environment != "LOCAL_MACHINE") {
        status = Refuse(source, "compute_environment",
                        absl::StrCat("\"", c.compute_environment,
                                     "\": expected LOCAL_MACHINE (or Accelerate's "
                                     "AMAZON_SAGEMAKER, which accel cannot run)"));
      }
    } else if (key == "distributed_type") {
      set_string(&c.distributed_type);
      c.distributed_type = absl::AsciiStrToUpper(c.distributed_type);
      if (status.ok() && c.distributed_type != "NO" && c.distributed_type != "MULTI_CPU" &&
          c.distributed_type != "MULTI_GPU" && c.distributed_type != "FSDP") {
        status = absl::InvalidArgumentError(absl::StrCat(
            source, ": distributed_type \"", c.distributed_type,
            "\" is not one accel runs (NO, MULTI_CPU, MULTI_GPU, FSDP; DeepSpeed, Megatron-LM, "
            "TPU are Python-only)"));
      }
    } else if (key == "mixed_precision") {
      set_string(&c.mixed_precision);
      c.mixed_precision = absl::AsciiStrToLower(c.mixed_precision);
      if (status.ok())
        status = CheckPrecision(absl::StrCat(source, ": mixed_precision"), c.mixed_precision);
    } else if (key == "use_cpu") {
      set_bool(&c.use_cpu);
    } else if (key == "debug") {
      set_bool(&c.debug);
    } else if (key == "same_network") {
      set_bool(&c.same_network);
    } else if (key == "enable_cpu_affinity") {
      set_bool(&c.enable_cpu_affinity);
    } else if (key == "num_processes") {
      // -1: "pass --num_processes at launch" (Accelerate's SLURM pattern).
      set_int(&c.num_processes, -1, 1 << 20);
      if (status.ok() && c.num_processes == 0) {
        status = absl::InvalidArgumentError(
            absl::StrCat(source, ": num_processes is 0, expected at least 1 (or -1)"));
      }
    } else if (key == "num_machines") {
      set_int(&c.num_machines, 1, 1 << 16);
    } else if (key == "machine_rank") {
      set_int(&c.machine_rank, 0, 1 << 16);
    } else if (key == "main_process_port") {
      if (!v.is_null()) {
        int port = 0;
        set_int(&port, 0, 65535);
        c.main_process_port = port;
      }
    } else if (key == "main_process_ip") {
      if (!v.is_null()) set_string(&c.main_process_ip);
    } else if (key == "gpu_ids") {
      set_string(&c.gpu_ids);
    } else if (key == "rdzv_backend") {
      set_string(&c.rdzv_backend);
      if (status.ok())
        status = CheckRendezvous(absl::StrCat(source, ": rdzv_backend"), c.rdzv_backend);
    } else if (key == "main_training_function") {
      set_string(&c.main_training_function);
    } else {
      c.other[key] = JsonText(v);
    }
    if (!status.ok()) return status;
  }
  // After the fields, so that a distributed_type we do not run is named first.
  if (absl::Status s = RefuseWhatLaunchCannotDo(f, source, legacy_dynamo); !s.ok()) return s;
  if (c.distributed_type == "NO") c.num_processes = 1;
  if (c.machine_rank >= c.num_machines) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": machine_rank ", c.machine_rank,
                                                   " is outside [0, num_machines ", c.num_machines,
                                                   ")"));
  }
  return c;
}

absl::StatusOr<ClusterConfig> ReadClusterConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("config file ", path, ": not found"));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("config file ", path, ": read error"));
  return ParseClusterConfig(text, path);
}

std::string ClusterConfigToJson(const ClusterConfig& c) {
  Json j = Json::object();  // std::map underneath: sorted keys, as Accelerate's sort_keys=True
  for (const auto& [key, text] : c.other) {
    absl::StatusOr<Json> value = ParseJson(text, key);
    j[key] = value.ok() ? *std::move(value) : Json(text);  // set by hand as plain text
  }
  j["compute_environment"] = c.compute_environment;
  j["debug"] = c.debug;
  j["distributed_type"] = c.distributed_type;
  j["enable_cpu_affinity"] = c.enable_cpu_affinity;
  j["gpu_ids"] = c.gpu_ids;
  if (!c.main_process_ip.empty()) j["main_process_ip"] = c.main_process_ip;
  if (c.main_process_port) j["main_process_port"] = *c.main_process_port;
  j["machine_rank"] = c.machine_rank;
  j["main_training_function"] = c.main_training_function;
  j["mixed_precision"] = c.mixed_precision;
  j["num_machines"] = c.num_machines;
  j["num_processes"] = c.num_processes;
  j["rdzv_backend"] = c.rdzv_backend;
  j["same_network"] = c.same_network;
  j["use_cpu"] = c.use_cpu;
  return j.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

absl::Status WriteClusterConfig(const ClusterConfig& config, const std::string& path,
                                bool overwrite) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    const std::string dir = path.substr(0, slash);
    size_t pos = 0;
    while ((pos = dir.find('/', pos + 1)) != std::string::npos) {
      (void)::mkdir(dir.substr(0, pos).c_str(), 0755);
    }
    (void)::mkdir(dir.c_str(), 0755);
  }
  // A temporary file beside it, synced, then moved into place: a reader sees
  // the old file or the new one, never half of one.
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  const std::string text = ClusterConfigToJson(config);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                       ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (written) {
    // Without overwrite, link() fails when the file exists, so two writers
    // cannot both believe they created it.
    const int moved =
        overwrite ? ::rename(tmp.c_str(), path.c_str()) : ::link(tmp.c_str(), path.c_str());
    err = errno;
    ::unlink(tmp.c_str());
    if (moved == 0) return absl::OkStatus();
    if (!overwrite && err == EEXIST) {
      return absl::AlreadyExistsError(
          absl::StrCat("config file ", path, " already exists; not overwriting it"));
    }
  } else {
    ::unlink(tmp.c_str());
  }
  return absl::ResourceExhaustedError(
      absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
}

std::string DefaultConfigPath() {
  if (const char* f = std::getenv("ACCEL_CONFIG_FILE"); f != nullptr && *f != '\0') return f;
  std::string cache;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    cache = x;
  } else {
    const char* home = std::getenv("HOME");
    cache = absl::StrCat(home != nullptr ? home : "", "/.cache");
  }
  return cache + "/accel/default_config.yaml";
}

absl::StatusOr<std::string> FindProgram(const std::string& name, const std::string& path_env) {
  auto runnable = [](const std::string& p) {
    struct stat st {};
    return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(p.c_str(), X_OK) == 0;
  };
  if (name.empty()) return absl::InvalidArgumentError("PROGRAM is empty");
  if (name.find('/') != std::string::npos) {
    if (runnable(name)) return name;
    return absl::NotFoundError(absl::StrCat("PROGRAM ", name, " is not an executable file"));
  }
  for (absl::string_view dir : absl::StrSplit(path_env, ':')) {
    const std::string candidate = absl::StrCat(dir.empty() ? "." : dir, "/", name);
    if (runnable(candidate)) return candidate;
  }
  return absl::NotFoundError(absl::StrCat("PROGRAM ", name, " not found in PATH (", path_env, ")"));
}

int PhysicalCoreCount() {
  std::set<std::pair<std::string, std::string>> cores;
  if (DIR* dir = ::opendir("/sys/devices/system/cpu")) {
    while (const dirent* e = ::readdir(dir)) {
      const absl::string_view name = e->d_name;
      int index = 0;
      if (!absl::StartsWith(name, "cpu") || !absl::SimpleAtoi(name.substr(3), &index)) continue;
      const std::string topology = absl::StrCat("/sys/devices/system/cpu/", name, "/topology/");
      std::string package, core;
      std::ifstream(topology + "physical_package_id") >> package;
      std::ifstream(topology + "core_id") >> core;
      if (!core.empty()) cores.emplace(package, core);
    }
    ::closedir(dir);
  }
  if (!cores.empty()) return static_cast<int>(cores.size());
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

absl::StatusOr<LaunchPlan> ParseLaunchArgs(const std::vector<std::string>& args,
                                           const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> flags;
  std::set<std::string> switches;
  size_t i = 0;
  static const std::set<std::string> kValued = [] {
    std::set<std::string> valued = {
        "config_file",      "num_processes",   "num_machines",
        "machine_rank",     "main_process_ip", "main_process_port",
        "mixed_precision",  "gpu_ids",         "num_cpu_threads_per_process",
        "monitor_interval", "rdzv_backend"};
    for (const char* name : kFsdpFlags) valued.insert(name);
    return valued;
  }();
  // --no_python: PROGRAM runs as it is, which is how accel-launch always runs
  // it (there is no interpreter to skip).
  static const std::set<std::string> kSwitches = {
      "cpu",   "multi_gpu",           "use_fsdp",    "no_python", "quiet",
      "debug", "enable_cpu_affinity", "same_network"};
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      ++i;
      break;
    }
    if (a.rfind("--", 0) != 0) break;  // PROGRAM
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    name = absl::StrReplaceAll(name, {{"-", "_"}});
    if (kSwitches.count(name)) {
      if (has_value) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      }
      switches.insert(name);
      continue;
    }
    if (!kValued.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag ", a, " (see --help)"));
    }
    if (!has_value) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
      }
      value = args[++i];
    }
    flags[name] = value;
  }
  LaunchPlan plan;
  plan.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
  if (plan.command.empty()) {
    return absl::InvalidArgumentError(
        "no PROGRAM to launch (accel-launch [flags] PROGRAM ARGS...)");
  }

  // The config file underneath the flags.
  ClusterConfig config;
  std::string config_path;
  bool from_file = false;
  if (auto it = flags.find("config_file"); it != flags.end()) {
    config_path = it->second;
    from_file = true;
  } else if (auto e = env.find("ACCEL_CONFIG_FILE"); e != env.end() && !e->second.empty()) {
    config_path = e->second;
    from_file = true;
  } else {
    std::string cache;
    if (auto x = env.find("XDG_CACHE_HOME"); x != env.end() && !x->second.empty()) {
      cache = x->second;
    } else if (auto h = env.find("HOME"); h != env.end()) {
      cache = h->second + "/.cache";
    }
    config_path = cache + "/accel/default_config.yaml";
    from_file = !cache.empty() && ::access(config_path.c_str(), F_OK) == 0;
  }
  if (from_file) {
    absl::StatusOr<ClusterConfig> c = ReadClusterConfig(config_path);
    if (!c.ok()) return c.status();
    config = *std::move(c);
  }
  plan.num_processes = config.num_processes;
  plan.num_machines = config.num_machines;
  plan.machine_rank = config.machine_rank;
  if (!config.main_process_ip.empty()) plan.main_process_ip = config.main_process_ip;
  if (config.main_process_port) plan.main_process_port = *config.main_process_port;
  plan.mixed_precision = config.mixed_precision;
  plan.use_cpu = config.use_cpu;
  plan.debug = config.debug;
  plan.enable_cpu_affinity = config.enable_cpu_affinity;
  plan.gpu_ids = config.gpu_ids;
  // Under SLURM, one accel-launch per node: the node count and this node's
  // index unless the flags say otherwise.
  auto slurm = [&](const char* var, int min, int* out) -> absl::Status {
    auto it = env.find(var);
    if (it == env.end() || it->second.empty()) return absl::OkStatus();
    int v = 0;
    if (!absl::SimpleAtoi(it->second, &v) || v < min) {
      return absl::InvalidArgumentError(
          absl::StrCat("$", var, " \"", it->second, "\" is not an integer >= ", min));
    }
    *out = v;
    return absl::OkStatus();
  };
  if (!flags.count("num_machines")) {
    if (absl::Status s = slurm("SLURM_NNODES", 1, &plan.num_machines); !s.ok()) return s;
  }
  if (!flags.count("machine_rank")) {
    if (absl::Status s = slurm("SLURM_NODEID", 0, &plan.machine_rank); !s.ok()) return s;
  }

  auto int_flag = [&](const std::string& name, int* out, int min, int max) -> absl::Status {
    auto it = flags.find(name);
    if (it == flags.end()) return absl::OkStatus();
    int v = 0;
    if (!absl::SimpleAtoi(it->second, &v) || v < min || v > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, " \"", it->second, "\": expected an integer in [", min, ", ", max, "]"));
    }
    *out = v;
    return absl::OkStatus();
  };
  if (absl::Status s = int_flag("num_processes", &plan.num_processes, 1, 1 << 20); !s.ok()) {
    return s;
  }
  if (absl::Status s = int_flag("num_machines", &plan.num_machines, 1, 1 << 16); !s.ok()) return s;
  if (absl::Status s = int_flag("machine_rank", &plan.machine_rank, 0, 1 << 16); !s.ok()) return s;
  if (absl::Status s = int_flag("main_process_port", &plan.main_process_port, 0, 65535); !s.ok()) {
    return s;
  }
  if (flags.count("num_cpu_threads_per_process")) {
    int t = 0;
    if (absl::Status s = int_flag("num_cpu_threads_per_process", &t, 1, 1 << 16); !s.ok()) {
      return s;
    }
    plan.threads_per_process = t;
  }
  if (auto it = flags.find("monitor_interval"); it != flags.end()) {
    double s = 0;
    if (!absl::SimpleAtod(it->second, &s) || !(s > 0) || s > 3600) {
      return absl::InvalidArgumentError(
          absl::StrCat("--monitor_interval \"", it->second, "\": expected seconds in (0, 3600]"));
    }
    plan.monitor_interval_s = s;
  }
  if (auto it = flags.find("main_process_ip"); it != flags.end()) {
    if (it->second.empty()) return absl::InvalidArgumentError("--main_process_ip is empty");
    plan.main_process_ip = it->second;
  }
  if (auto it = flags.find("gpu_ids"); it != flags.end()) plan.gpu_ids = it->second;
  if (auto it = flags.find("mixed_precision"); it != flags.end()) {
    plan.mixed_precision = absl::AsciiStrToLower(it->second);
    if (absl::Status s = CheckPrecision("--mixed_precision", plan.mixed_precision); !s.ok()) {
      return s;
    }
  }
  if (switches.count("debug")) plan.debug = true;
  if (auto it = flags.find("rdzv_backend"); it != flags.end()) {
    if (absl::Status s = CheckRendezvous("--rdzv_backend", it->second); !s.ok()) return s;
  }
  // The launch mode: a flag, else the config's distributed_type (Accelerate's
  // _validate_launch_command). --multi_gpu and FSDP start every rank with
  // ACCELERATE_USE_CPU=false (Accelerate's torchrun path sets no use_cpu):
  // each rank takes its GPU where libtorch has CUDA, else runs on the CPU
  // over gloo, as Accelerate does under torchrun without GPUs.
  const int modes = static_cast<int>(switches.count("cpu") + switches.count("multi_gpu") +
                                     switches.count("use_fsdp"));
  if (modes > 1) {
    return absl::InvalidArgumentError(
        "You can only use one of --cpu, --multi_gpu, --use_fsdp at a time");
  }
  bool multi_gpu = switches.count("multi_gpu") > 0;
  plan.use_fsdp = switches.count("use_fsdp") > 0;
  if (modes == 0) {
    multi_gpu = config.distributed_type == "MULTI_GPU";
    plan.use_fsdp = config.distributed_type == "FSDP";
  }
  if (switches.count("cpu")) plan.use_cpu = true;
  if (multi_gpu || plan.use_fsdp) plan.use_cpu = false;
  if (switches.count("enable_cpu_affinity")) plan.enable_cpu_affinity = true;
  plan.quiet = switches.count("quiet") > 0;
  if (multi_gpu && plan.num_processes < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("--multi_gpu needs at least 2 processes (num_processes is ",
                     plan.num_processes, "); for one GPU launch without it"));
  }
  if (multi_gpu && plan.gpu_ids != "all" && plan.num_machines <= 1 &&
      std::count(plan.gpu_ids.begin(), plan.gpu_ids.end(), ',') < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpu_ids \"", plan.gpu_ids,
        "\": less than two GPU ids for a multi-GPU launch (give at least two, or all)"));
  }
  if (plan.use_fsdp) {
    // The config file's fsdp_config under the --fsdp_* flags; keys without
    // the fsdp_ prefix get it, as Accelerate's launcher does.
    std::map<std::string, std::string> settings;
    if (auto it = config.other.find("fsdp_config"); it != config.other.end()) {
      const absl::StatusOr<Json> parsed = ParseJson(it->second, "fsdp_config");
      const Json section = parsed.ok() ? *parsed : Json();
      if (section.is_object()) {
        for (auto kv = section.begin(); kv != section.end(); ++kv) {
          if (kv.value().is_null()) continue;
          std::string name = kv.key();
          if (!absl::StrContains(name, "fsdp")) name.insert(0, "fsdp_");
          settings[name] = FsdpValueText(kv.value());
        }
      }
    }
    for (const char* name : kFsdpFlags) {
      if (auto it = flags.find(name); it != flags.end()) settings[name] = it->second;
    }
    absl::StatusOr<std::map<std::string, std::string>> fsdp = FsdpEnvironment(settings);
    if (!fsdp.ok()) return fsdp.status();
    plan.fsdp_environment = *std::move(fsdp);
  } else {
    for (const char* name : kFsdpFlags) {
      if (flags.count(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", name, " without --use_fsdp (or distributed_type: FSDP) would be ignored"));
      }
    }
  }
  if (plan.num_processes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_processes is ", plan.num_processes, " in ", config_path,
                     "; pass --num_processes N (the processes of the whole job)"));
  }
  if (plan.num_processes % plan.num_machines != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--num_processes ", plan.num_processes, " is not divisible by --num_machines ",
                     plan.num_machines, " (each machine runs the same number of processes)"));
  }
  if (plan.machine_rank >= plan.num_machines) {
    return absl::InvalidArgumentError(absl::StrCat("--machine_rank ", plan.machine_rank,
                                                   " is outside [0, ", plan.num_machines, ")"));
  }
  if (plan.num_machines > 1 && !flags.count("main_process_ip") && config.main_process_ip.empty()) {
    return absl::InvalidArgumentError(
        "--num_machines > 1 needs --main_process_ip, the address of machine 0");
  }
  if (plan.num_machines > 1 && plan.main_process_port == 0) {
    return absl::InvalidArgumentError(
        "--main_process_port 0 (a free port) works on one machine only: the others could not "
        "know it");
  }
  auto path = env.find("PATH");
  absl::StatusOr<std::string> program = FindProgram(
      plan.command[0], path != env.end() ? path->second : "/usr/local/bin:/usr/bin:/bin");
  if (!program.ok()) return program.status();
  plan.program_path = *std::move(program);
  return plan;
}

std::map<std::string, std::string> RankEnvironment(const LaunchPlan& plan, int local_rank,
                                                   int physical_cores,
                                                   const std::map<std::string, std::string>& env) {
  const int local = plan.local_processes();
  std::map<std::string, std::string> out;
  const int rank = plan.machine_rank * local + local_rank;
  out["RANK"] = absl::StrCat(rank);
  out["LOCAL_RANK"] = absl::StrCat(local_rank);
  out["WORLD_SIZE"] = absl::StrCat(plan.num_processes);
  out["LOCAL_WORLD_SIZE"] = absl::StrCat(local);
  out["GROUP_RANK"] = absl::StrCat(plan.machine_rank);
  out["GROUP_WORLD_SIZE"] = absl::StrCat(plan.num_machines);
  out["ROLE_RANK"] = absl::StrCat(rank);
  out["ROLE_WORLD_SIZE"] = absl::StrCat(plan.num_processes);
  out["ROLE_NAME"] = "default";
  out["MASTER_ADDR"] = plan.main_process_ip;
  out["MASTER_PORT"] = absl::StrCat(plan.main_process_port);
  out["TORCHELASTIC_RESTART_COUNT"] = "0";
  out["TORCHELASTIC_MAX_RESTARTS"] = "0";
  out["ACCELERATE_MIXED_PRECISION"] = plan.mixed_precision;
  out["ACCELERATE_USE_CPU"] = plan.use_cpu ? "true" : "false";
  if (plan.debug) out["ACCELERATE_DEBUG_MODE"] = "true";
  if (plan.enable_cpu_affinity) out["ACCELERATE_CPU_AFFINITY"] = "1";
  if (!plan.gpu_ids.empty() && plan.gpu_ids != "all") {
    out["CUDA_VISIBLE_DEVICES"] = plan.gpu_ids;
  }
  for (const auto& [name, value] : plan.fsdp_environment) out[name] = value;
  out["ACCEL_LAUNCHER"] = "accel-launch";
  int threads = 1;
  if (plan.threads_per_process) {
    threads = *plan.threads_per_process;
  } else if (auto it = env.find("OMP_NUM_THREADS"); it != env.end() && !it->second.empty()) {
    out["OMP_NUM_THREADS"] = it->second;  // what the user set stands
    return out;
  } else if (plan.use_cpu) {
    threads = std::max(1, physical_cores / std::max(1, local));
  }
  out["OMP_NUM_THREADS"] = absl::StrCat(threads);
  return out;
}

}  // namespace accel::train
