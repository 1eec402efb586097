#include "core/json.h"

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"

namespace accel {
namespace {

// Below this many keys an ordered object is searched linearly for a
// duplicate; from it on it gets a hash index.
constexpr size_t kIndexFrom = 16;

// nlohmann's parse_error text without its "[json.exception.parse_error.101] "
// tag and without the "; last read: '...'" part, which quotes the input.
std::string ParseErrorReason(const std::string& what) {
  std::string reason = what;
  if (const size_t tag = reason.find("] ");
      reason.rfind("[json.exception", 0) == 0 && tag != std::string::npos) {
    reason.erase(0, tag + 2);
  }
  if (const size_t read = reason.find("; last read: "); read != std::string::npos) {
    reason.erase(read);
  }
  return reason;
}

// A DOM builder for nlohmann's SAX parser (the interface of its
// json_sax_dom_parser), with the bounds of JsonLimits.
template <typename BasicJson>
class BoundedBuilder {
 public:
  using number_integer_t = typename BasicJson::number_integer_t;
  using number_unsigned_t = typename BasicJson::number_unsigned_t;
  using number_float_t = typename BasicJson::number_float_t;
  using string_t = typename BasicJson::string_t;
  using binary_t = typename BasicJson::binary_t;
  using object_t = typename BasicJson::object_t;
  using array_t = typename BasicJson::array_t;
  static constexpr bool kOrdered = !std::is_same_v<object_t, nlohmann::json::object_t>;

  BoundedBuilder(BasicJson& root, absl::string_view what, const JsonLimits& limits)
      : root_(root),
        what_(what),
        limits_(limits),
        keys_(limits.key_total != nullptr ? *limits.key_total : 0) {}
  ~BoundedBuilder() {
    if (limits_.key_total != nullptr) *limits_.key_total = keys_;
  }

  const absl::Status& status() const { return status_; }

  bool null() { return Put(nullptr); }
  bool boolean(bool value) { return Put(value); }
  bool number_integer(number_integer_t value) { return Put(value); }
  bool number_unsigned(number_unsigned_t value) { return Put(value); }
  bool number_float(number_float_t value, const string_t& /*text*/) { return Put(value); }
  bool string(string_t& value) { return Put(std::move(value)); }
  // Only the binary formats (CBOR, MessagePack...) have these; JSON text never does.
  bool binary(binary_t& /*value*/) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(what_, ": binary value in JSON")));
  }

  bool start_object(std::size_t /*elements*/) { return Open(nlohmann::detail::value_t::object); }
  bool end_object() { return Close(); }
  bool start_array(std::size_t /*elements*/) { return Open(nlohmann::detail::value_t::array); }
  bool end_array() { return Close(); }

  bool key(string_t& key) {
    if (!Tick()) return false;
    if (++keys_ > limits_.max_keys) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(what_, ": has more than ", limits_.max_keys, " object keys",
                       limits_.key_total != nullptr ? " (with the fields before it)" : "",
                       ", this reader's limit")));
    }
    Frame& frame = stack_.back();
    object_t& object = *frame.value->template get_ptr<object_t*>();
    if constexpr (kOrdered) {
      BasicJson* existing = FindOrdered(frame, object, key);
      if (existing != nullptr) return Duplicate(key, existing);
      if (frame.index != nullptr) frame.index->emplace(key, object.size());
      // ordered_map is a std::vector underneath: appending skips its linear
      // lookup, which FindOrdered did in constant time.
      object.emplace_back(std::move(key), nullptr);
      if (frame.index == nullptr && object.size() >= kIndexFrom) {
        frame.index = std::make_unique<std::unordered_map<std::string, size_t>>();
        frame.index->reserve(2 * kIndexFrom);
        size_t position = 0;
        for (const auto& entry : object) frame.index->emplace(entry.first, position++);
      }
      slot_ = &object.back().second;
    } else {
      auto it = object.find(key);
      if (it != object.end()) return Duplicate(key, &it->second);
      slot_ = &object.emplace(std::move(key), nullptr).first->second;
    }
    return true;
  }

  template <class Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const Exception& error) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(
          absl::StrCat(what_, ": invalid JSON (", ParseErrorReason(error.what()), ")"));
    }
    return false;
  }

 private:
  struct Frame {
    BasicJson* value;
    // Ordered objects of kIndexFrom keys or more: key -> position.
    std::unique_ptr<std::unordered_map<std::string, size_t>> index;
  };

  bool Fail(absl::Status status) {
    if (status_.ok()) status_ = std::move(status);
    return false;
  }

  // Every kJsonCheckInterval tokens, asks limits_.check.
  bool Tick() {
    if (++tokens_ % kJsonCheckInterval != 0 || !limits_.check) return true;
    absl::Status checked = limits_.check();
    if (!checked.ok()) return Fail(std::move(checked));
    return true;
  }

  BasicJson* FindOrdered(const Frame& frame, object_t& object, const string_t& key) {
    if (frame.index != nullptr) {
      auto it = frame.index->find(key);
      if (it == frame.index->end()) return nullptr;
      // object[i] would be ordered_map's operator[](key): the position, by iterator.
      return &(object.begin() + static_cast<std::ptrdiff_t>(it->second))->second;
    }
    for (auto& [name, value] : object) {
      if (name == key) return &value;
    }
    return nullptr;
  }

  bool Duplicate(const string_t& key, BasicJson* existing) {
    if (limits_.refuse_duplicate_keys) {
      std::string shown = key.substr(0, 64);
      return Fail(absl::InvalidArgumentError(absl::StrCat(what_, ": the key \"", shown,
                                                          key.size() > 64 ? "...\"" : "\"",
                                                          " appears twice in one object")));
    }
    slot_ = existing;  // the last value wins
    return true;
  }

  // Where the next value goes: the root, the end of the open array, or the
  // slot of the last key.
  template <typename Value>
  BasicJson* Place(Value&& value) {
    if (stack_.empty()) {
      root_ = BasicJson(std::forward<Value>(value));
      return &root_;
    }
    BasicJson& top = *stack_.back().value;
    if (top.is_array()) {
      array_t& array = *top.template get_ptr<array_t*>();
      array.emplace_back(std::forward<Value>(value));
      return &array.back();
    }
    *slot_ = BasicJson(std::forward<Value>(value));
    return slot_;
  }

  template <typename Value>
  bool Put(Value&& value) {
    if (!Tick()) return false;
    Place(std::forward<Value>(value));
    return true;
  }

  bool Open(nlohmann::detail::value_t type) {
    if (!Tick()) return false;
    if (static_cast<int>(stack_.size()) >= limits_.max_depth) {
      return Fail(absl::InvalidArgumentError(
          absl::StrCat(what_, ": nests deeper than ", limits_.max_depth, " levels")));
    }
    BasicJson* opened = Place(BasicJson(type));
    stack_.push_back(Frame{opened, nullptr});
    return true;
  }

  bool Close() {
    stack_.pop_back();
    return true;
  }

  BasicJson& root_;
  const absl::string_view what_;
  const JsonLimits& limits_;
  std::vector<Frame> stack_;
  BasicJson* slot_ = nullptr;
  int64_t keys_;
  int64_t tokens_ = 0;
  absl::Status status_;
};

template <typename BasicJson>
absl::StatusOr<BasicJson> Parse(absl::string_view text, absl::string_view what,
                                const JsonLimits& limits) {
  BasicJson root;
  BoundedBuilder<BasicJson> builder(root, what, limits);
  bool parsed = false;
  try {
    parsed = BasicJson::sax_parse(text.begin(), text.end(), &builder,
                                  nlohmann::detail::input_format_t::json, /*strict=*/true);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": out of memory reading JSON"));
  }
  if (!builder.status().ok()) return builder.status();
  if (!parsed) return absl::InvalidArgumentError(absl::StrCat(what, ": invalid JSON"));
  return root;
}

}  // namespace

absl::StatusOr<nlohmann::json> ParseJson(absl::string_view text, absl::string_view what,
                                         const JsonLimits& limits) {
  return Parse<nlohmann::json>(text, what, limits);
}

absl::StatusOr<nlohmann::ordered_json> ParseOrderedJson(absl::string_view text,
                                                        absl::string_view what,
                                                        const JsonLimits& limits) {
  return Parse<nlohmann::ordered_json>(text, what, limits);
}

}  // namespace accel
