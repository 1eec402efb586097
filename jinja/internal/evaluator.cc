#include "jinja/internal/evaluator.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "nlohmann/json.hpp"

namespace accel::jinja::internal {
namespace {

absl::Status Invalid(absl::string_view message) { return absl::InvalidArgumentError(message); }

}  // namespace

const Value* Env::Find(const std::string& name) const {
  for (const Env* env = this; env != nullptr; env = env->parent.get()) {
    if (auto it = env->vars.find(name); it != env->vars.end()) return &it->second;
  }
  return nullptr;
}

Evaluator::~Evaluator() {
  // Oldest first: each clear then frees only containers already emptied.
  for (const std::weak_ptr<Object>& weak : namespaces_) {
    if (std::shared_ptr<Object> ns = weak.lock()) ns->entries.clear();
  }
  for (const std::weak_ptr<Env>& weak : closure_envs_) {
    if (std::shared_ptr<Env> env = weak.lock()) env->vars.clear();
  }
  if (globals_ != nullptr) globals_->vars.clear();
}

absl::Status Evaluator::Enter() {
  if (++steps_ > limits_.max_steps) {
    return Invalid(absl::StrCat("the template took more than ", limits_.max_steps, " steps"));
  }
  if (depth_ > limits_.max_depth) return Invalid("recursion too deep (a macro calling itself?)");
  return absl::OkStatus();
}

absl::Status Evaluator::Annotate(absl::Status status, const Node& node) {
  if (status.ok() || annotated_) return status;
  annotated_ = true;
  return absl::Status(status.code(),
                      absl::StrCat("chat template line ", node.line, ": ", status.message()));
}

absl::Status Evaluator::Charge(size_t bytes) {
  bytes_ += static_cast<int64_t>(bytes);
  if (bytes_ > limits_.max_bytes) return Invalid("the template built too much text");
  return absl::OkStatus();
}

absl::Status Evaluator::Append(std::string* out, absl::string_view text) {
  if (out->size() + text.size() > limits_.max_output) {
    return Invalid(absl::StrCat("output longer than ", limits_.max_output, " bytes"));
  }
  out->append(text.data(), text.size());
  return absl::OkStatus();
}

absl::StatusOr<Value> Evaluator::NewString(std::string s) {
  if (s.size() > limits_.max_output) {
    return Invalid(absl::StrCat("string longer than ", limits_.max_output, " bytes"));
  }
  ACCEL_RETURN_IF_ERROR(Charge(s.size()));
  return Value::String(std::move(s));
}

absl::StatusOr<Value> Evaluator::NewArray(std::vector<Value> items, bool tuple) {
  if (items.size() > limits_.max_items) {
    return Invalid(absl::StrCat("list longer than ", limits_.max_items, " items"));
  }
  ACCEL_RETURN_IF_ERROR(Charge(items.size() * sizeof(Value)));
  Value array = MakeArray(std::move(items), tuple);
  if (DepthOf(array) > kMaxValueDepth) return Invalid("lists nested too deeply");
  return array;
}

absl::StatusOr<Value> Evaluator::FromJson(const nlohmann::ordered_json& j, int depth) {
  if (depth > kMaxValueDepth) return Invalid("context nested too deeply");
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return Value::Float(static_cast<double>(u));
      }
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float: {
      // JavaScript has one number type: an integral 1.0 is IntegerValue(1).
      const double d = j.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9.2e18) {
        return Value::Int(static_cast<int64_t>(d));
      }
      return Value::Float(d);
    }
    case nlohmann::ordered_json::value_t::string:
      return Value::String(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const nlohmann::ordered_json& item : j) {
        ACCEL_ASSIGN_OR_RETURN(Value v, FromJson(item, depth + 1));
        items.push_back(std::move(v));
      }
      return MakeArray(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      std::vector<std::pair<std::string, Value>> entries;
      for (const auto& [key, item] : j.items()) {
        ACCEL_ASSIGN_OR_RETURN(Value v, FromJson(item, depth + 1));
        entries.emplace_back(key, std::move(v));
      }
      return MakeObject(std::move(entries));
    }
    default:
      return Invalid("the context holds a value that is not JSON (binary)");
  }
}

absl::Status Evaluator::DeclareGlobals(const nlohmann::ordered_json& context) {
  globals_ = std::make_shared<Env>(nullptr);
  auto global_fn = [](const char* name) {
    auto fn = std::make_shared<Function>();
    fn->type = Function::kGlobal;
    fn->name = name;
    return MakeFunction(std::move(fn));
  };
  auto& vars = globals_->vars;
  vars["namespace"] = global_fn("namespace");
  vars["false"] = Value::Bool(false);
  vars["true"] = Value::Bool(true);
  vars["none"] = Value::None();
  vars["raise_exception"] = global_fn("raise_exception");
  vars["range"] = global_fn("range");
  vars["strftime_now"] = global_fn("strftime_now");
  vars["True"] = Value::Bool(true);
  vars["False"] = Value::Bool(false);
  vars["None"] = Value::None();
  if (!context.is_object()) return Invalid("the chat template context must be a JSON object");
  for (const auto& [key, item] : context.items()) {
    if (vars.contains(key)) {
      return Invalid(
          absl::StrCat("the context variable '", key, "' shadows a built-in of the same name"));
    }
    ACCEL_ASSIGN_OR_RETURN(vars[key], FromJson(item, 1));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> Evaluator::Render(const Program& program,
                                              const nlohmann::ordered_json& context) {
  ACCEL_RETURN_IF_ERROR(DeclareGlobals(context));
  std::string out;
  ACCEL_RETURN_IF_ERROR(RenderBody(program.body, globals_, &out));
  return out;
}

absl::Status Evaluator::RenderBody(const std::vector<NodePtr>& body, const EnvPtr& env,
                                   std::string* out) {
  ACCEL_ASSIGN_OR_RETURN(Flow flow, ExecBlock(body, env, out));
  if (flow != Flow::kNormal) return Invalid("'break' or 'continue' outside a loop");
  return absl::OkStatus();
}

absl::StatusOr<Evaluator::Flow> Evaluator::ExecBlock(const std::vector<NodePtr>& body,
                                                     const EnvPtr& env, std::string* out) {
  for (const NodePtr& node : body) {
    ACCEL_ASSIGN_OR_RETURN(Flow flow, Exec(*node, env, out));
    if (flow != Flow::kNormal) return flow;
  }
  return Flow::kNormal;
}

absl::StatusOr<Evaluator::Flow> Evaluator::Exec(const Node& node, const EnvPtr& env,
                                                std::string* out) {
  Guard guard(this);
  if (absl::Status s = Enter(); !s.ok()) return Annotate(std::move(s), node);
  absl::StatusOr<Flow> flow = ExecUnannotated(node, env, out);
  if (!flow.ok()) return Annotate(flow.status(), node);
  return flow;
}

absl::StatusOr<Evaluator::Flow> Evaluator::ExecUnannotated(const Node& node, const EnvPtr& env,
                                                           std::string* out) {
  switch (node.kind) {
    case NodeKind::kText:
      ACCEL_RETURN_IF_ERROR(Append(out, node.str));
      return Flow::kNormal;
    case NodeKind::kComment:
      return Flow::kNormal;
    case NodeKind::kIf: {
      ACCEL_ASSIGN_OR_RETURN(Value test, Eval(*node.a, env));
      return ExecBlock(Truthy(test) ? node.body : node.alt, env, out);
    }
    case NodeKind::kFor:
      return ExecFor(node, env, out);
    case NodeKind::kBreak:
      return Flow::kBreak;
    case NodeKind::kContinue:
      return Flow::kContinue;
    case NodeKind::kSet:
      ACCEL_RETURN_IF_ERROR(ExecSet(node, env));
      return Flow::kNormal;
    case NodeKind::kMacro: {
      auto fn = std::make_shared<Function>();
      fn->type = Function::kMacro;
      fn->name = node.str;
      fn->node = &node;
      env->vars[node.str] = MakeFunction(std::move(fn));
      return Flow::kNormal;
    }
    case NodeKind::kCallBlock:
      ACCEL_RETURN_IF_ERROR(ExecCallBlock(node, env, out));
      return Flow::kNormal;
    case NodeKind::kFilterBlock: {
      std::string body;
      ACCEL_RETURN_IF_ERROR(RenderBody(node.body, env, &body));
      ACCEL_ASSIGN_OR_RETURN(Value text, NewString(std::move(body)));
      ACCEL_ASSIGN_OR_RETURN(Value result, ApplyFilter(text, *node.a, env));
      if (!result.is_none() && !result.is_undefined()) {
        ACCEL_ASSIGN_OR_RETURN(std::string printed, PrintString(result));
        ACCEL_RETURN_IF_ERROR(Append(out, printed));
      }
      return Flow::kNormal;
    }
    default: {
      ACCEL_ASSIGN_OR_RETURN(Value value, Eval(node, env));
      if (!value.is_none() && !value.is_undefined()) {
        if (value.is_string()) {
          ACCEL_RETURN_IF_ERROR(Append(out, value.s()));
        } else {
          ACCEL_ASSIGN_OR_RETURN(std::string printed, PrintString(value));
          ACCEL_RETURN_IF_ERROR(Append(out, printed));
        }
      }
      return Flow::kNormal;
    }
  }
}

absl::Status Evaluator::ExecSet(const Node& node, const EnvPtr& env) {
  Value value;
  if (node.b != nullptr) {
    ACCEL_ASSIGN_OR_RETURN(value, Eval(*node.b, env));
  } else {
    std::string body;
    ACCEL_RETURN_IF_ERROR(RenderBody(node.body, env, &body));
    ACCEL_ASSIGN_OR_RETURN(value, NewString(std::move(body)));
  }
  const Node& target = *node.a;
  if (target.kind == NodeKind::kIdentifier) {
    env->vars[target.str] = std::move(value);
  } else if (target.kind == NodeKind::kTuple) {
    if (!value.is_array())
      return Invalid(absl::StrCat("cannot unpack a ", TypeName(value), " in set"));
    const std::vector<Value> items = value.array().items;
    if (items.size() != target.list.size()) {
      return Invalid(absl::StrCat("too ", target.list.size() > items.size() ? "few" : "many",
                                  " items to unpack in set"));
    }
    for (size_t k = 0; k < items.size(); ++k) {
      if (target.list[k]->kind != NodeKind::kIdentifier)
        return Invalid("cannot unpack to a non-name in set");
      env->vars[target.list[k]->str] = items[k];
    }
  } else if (target.kind == NodeKind::kMember) {
    ACCEL_ASSIGN_OR_RETURN(Value object, Eval(*target.a, env));
    if (!object.is_namespace())
      return Invalid("cannot assign an attribute of anything but a namespace");
    if (target.flag || target.b->kind != NodeKind::kIdentifier) {
      return Invalid("cannot assign to a member that is not a name");
    }
    if (DepthOf(value) + 1 > kMaxValueDepth) return Invalid("namespaces nested too deeply");
    object.object().Set(target.b->str, std::move(value));
  } else {
    return Invalid("invalid target of set");
  }
  return absl::OkStatus();
}

absl::StatusOr<Evaluator::Flow> Evaluator::ExecFor(const Node& node, const EnvPtr& env,
                                                   std::string* out) {
  auto scope = std::make_shared<Env>(env);
  ACCEL_ASSIGN_OR_RETURN(Value iterable, Eval(*node.b, scope));
  std::vector<Value> candidates;
  if (iterable.is_array()) {
    candidates = iterable.array().items;
  } else if (iterable.is_object()) {
    for (const auto& entry : iterable.object().entries)
      candidates.push_back(Value::String(entry.first));
  } else {
    return Invalid(absl::StrCat("cannot loop over a ", TypeName(iterable)));
  }
  const Node& target = *node.a;
  auto bind = [&](const Value& item, Env& into) -> absl::Status {
    if (target.kind == NodeKind::kIdentifier) {
      into.vars[target.str] = item;
      return absl::OkStatus();
    }
    if (!item.is_array() || item.is_tuple()) {
      return Invalid(absl::StrCat("cannot unpack a ", TypeName(item), " in a for loop"));
    }
    const std::vector<Value>& parts = item.array().items;
    if (parts.size() != target.list.size()) {
      return Invalid(absl::StrCat("too ", target.list.size() > parts.size() ? "few" : "many",
                                  " items to unpack"));
    }
    for (size_t k = 0; k < parts.size(); ++k) {
      if (target.list[k]->kind != NodeKind::kIdentifier)
        return Invalid("cannot unpack to a non-name");
      into.vars[target.list[k]->str] = parts[k];
    }
    return absl::OkStatus();
  };
  std::vector<Value> items;
  if (node.c != nullptr) {
    for (const Value& item : candidates) {
      ACCEL_RETURN_IF_ERROR(Enter());
      auto loop_scope = std::make_shared<Env>(scope);
      ACCEL_RETURN_IF_ERROR(bind(item, *loop_scope));
      ACCEL_ASSIGN_OR_RETURN(Value keep, Eval(*node.c, loop_scope));
      if (Truthy(keep)) items.push_back(item);
    }
  } else {
    items = std::move(candidates);
  }
  bool no_iteration = true;
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t k = 0; k < n; ++k) {
    ACCEL_RETURN_IF_ERROR(Enter());  // an empty body still costs a step per item
    const auto idx = static_cast<size_t>(k);
    scope->vars["loop"] = MakeObject({
        {"index", Value::Int(k + 1)},
        {"index0", Value::Int(k)},
        {"revindex", Value::Int(n - k)},
        {"revindex0", Value::Int(n - k - 1)},
        {"first", Value::Bool(k == 0)},
        {"last", Value::Bool(k == n - 1)},
        {"length", Value::Int(n)},
        {"previtem", k > 0 ? items[idx - 1] : Value()},
        {"nextitem", k < n - 1 ? items[idx + 1] : Value()},
    });
    ACCEL_RETURN_IF_ERROR(bind(items[idx], *scope));
    ACCEL_ASSIGN_OR_RETURN(Flow flow, ExecBlock(node.body, scope, out));
    if (flow == Flow::kContinue) continue;
    if (flow == Flow::kBreak) break;
    no_iteration = false;
  }
  if (no_iteration) ACCEL_RETURN_IF_ERROR(RenderBody(node.alt, scope, out));
  return Flow::kNormal;
}

absl::Status Evaluator::ExecCallBlock(const Node& node, const EnvPtr& env, std::string* out) {
  auto caller = std::make_shared<Function>();
  caller->type = Function::kCaller;
  caller->node = &node;
  caller->env = env;
  closure_envs_.push_back(env);
  const Node& call = *node.a;
  ACCEL_ASSIGN_OR_RETURN(Args args, EvalArgs(call.list, env));
  ACCEL_ASSIGN_OR_RETURN(Value fn, Eval(*call.a, env));
  if (!fn.is_function()) return Invalid(absl::StrCat("cannot call a ", TypeName(fn)));
  auto call_env = std::make_shared<Env>(env);
  call_env->vars["caller"] = MakeFunction(std::move(caller));
  ACCEL_ASSIGN_OR_RETURN(Value result, Call(fn, std::move(args), call_env));
  if (result.is_none() || result.is_undefined()) return absl::OkStatus();
  ACCEL_ASSIGN_OR_RETURN(std::string printed, PrintString(result));
  return Append(out, printed);
}

absl::StatusOr<Value> Evaluator::Eval(const Node& node, const EnvPtr& env) {
  Guard guard(this);
  if (absl::Status s = Enter(); !s.ok()) return Annotate(std::move(s), node);
  absl::StatusOr<Value> value = EvalUnannotated(node, env);
  if (!value.ok()) return Annotate(value.status(), node);
  return value;
}

absl::StatusOr<Value> Evaluator::EvalUnannotated(const Node& node, const EnvPtr& env) {
  switch (node.kind) {
    case NodeKind::kIdentifier: {
      const Value* v = env->Find(node.str);
      return v == nullptr ? Value() : *v;
    }
    case NodeKind::kInteger:
      return Value::Int(node.i);
    case NodeKind::kFloat:
      return Value::Float(node.f);
    case NodeKind::kString:
    case NodeKind::kText:
      return Value::String(node.str);
    case NodeKind::kArray:
    case NodeKind::kTuple: {
      std::vector<Value> items;
      items.reserve(node.list.size());
      for (const NodePtr& item : node.list) {
        ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*item, env));
        items.push_back(std::move(v));
      }
      return NewArray(std::move(items), node.kind == NodeKind::kTuple);
    }
    case NodeKind::kObject: {
      Value object = MakeObject({});
      for (size_t k = 0; k + 1 < node.list.size(); k += 2) {
        ACCEL_ASSIGN_OR_RETURN(Value key, Eval(*node.list[k], env));
        if (!key.is_string())
          return Invalid(absl::StrCat("dict keys must be strings, got a ", TypeName(key)));
        ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*node.list[k + 1], env));
        object.object().Set(key.s(), std::move(v));
      }
      if (DepthOf(object) > kMaxValueDepth) return Invalid("dicts nested too deeply");
      return object;
    }
    case NodeKind::kMember:
      return EvalMember(node, env);
    case NodeKind::kCall: {
      ACCEL_ASSIGN_OR_RETURN(Args args, EvalArgs(node.list, env));
      ACCEL_ASSIGN_OR_RETURN(Value fn, Eval(*node.a, env));
      if (!fn.is_function()) return Invalid(absl::StrCat("cannot call a ", TypeName(fn)));
      return Call(fn, std::move(args), env);
    }
    case NodeKind::kBinary:
      return EvalBinary(node, env);
    case NodeKind::kUnary:
      return EvalUnary(node, env);
    case NodeKind::kFilter: {
      ACCEL_ASSIGN_OR_RETURN(Value operand, Eval(*node.a, env));
      return ApplyFilter(operand, *node.b, env);
    }
    case NodeKind::kTest: {
      ACCEL_ASSIGN_OR_RETURN(Value operand, Eval(*node.a, env));
      ACCEL_ASSIGN_OR_RETURN(bool result, ApplyTest(node.str, operand, nullptr));
      return Value::Bool(node.flag ? !result : result);
    }
    case NodeKind::kSelect: {
      ACCEL_ASSIGN_OR_RETURN(Value test, Eval(*node.b, env));
      if (!Truthy(test)) return Value();
      return Eval(*node.a, env);
    }
    case NodeKind::kTernary: {
      ACCEL_ASSIGN_OR_RETURN(Value test, Eval(*node.a, env));
      return Eval(Truthy(test) ? *node.b : *node.c, env);
    }
    default:
      return Invalid("this expression cannot be evaluated here");
  }
}

absl::StatusOr<Value> Evaluator::EvalMember(const Node& node, const EnvPtr& env) {
  ACCEL_ASSIGN_OR_RETURN(Value object, Eval(*node.a, env));
  Value property;
  if (node.flag) {
    if (node.b->kind == NodeKind::kSlice) return EvalSlice(object, *node.b, env);
    ACCEL_ASSIGN_OR_RETURN(property, Eval(*node.b, env));
  } else if (node.b->kind == NodeKind::kInteger) {
    property = Value::Int(node.b->i);
  } else {
    property = Value::String(node.b->str);
  }
  auto method = [&](const std::string& name) {
    auto fn = std::make_shared<Function>();
    fn->type = Function::kMethod;
    fn->name = name;
    fn->receiver = object;
    return MakeFunction(std::move(fn));
  };
  if (object.is_object() || object.is_namespace()) {
    if (!property.is_string()) {
      return Invalid(
          absl::StrCat("cannot look up a ", TypeName(property), " in a ", TypeName(object)));
    }
    if (const Value* v = object.object().Find(property.s())) return *v;
    if (object.is_object() && IsDictMethod(property.s())) return method(property.s());
    return Value();
  }
  if (object.is_array() || object.is_string()) {
    if (property.is_int()) {
      if (object.is_array()) {
        const std::vector<Value>& items = object.array().items;
        int64_t k = property.i();
        const auto size = static_cast<int64_t>(items.size());
        if (k < 0) k += size;
        if (k < 0 || k >= size) return Value();
        return items[static_cast<size_t>(k)];
      }
      // String.prototype.at counts UTF-16 units; half a surrogate pair is U+FFFD.
      const std::vector<std::string> chars = CodePoints(object.s());
      int64_t k = property.i();
      const auto size = static_cast<int64_t>(Utf16Length(object.s()));
      if (k < 0) k += size;
      if (k < 0 || k >= size) return Value();
      int64_t unit = 0;
      for (const std::string& c : chars) {
        const int64_t width = static_cast<unsigned char>(c[0]) >= 0xF0 ? 2 : 1;
        if (k < unit + width) return Value::String(width == 2 ? "\xEF\xBF\xBD" : c);
        unit += width;
      }
      return Value();
    }
    if (property.is_string()) {
      if (property.s() == "length") {
        return Value::Int(static_cast<int64_t>(object.is_array() ? object.array().items.size()
                                                                 : Utf16Length(object.s())));
      }
      if (object.is_string() && IsStringMethod(property.s())) return method(property.s());
      return Value();
    }
    return Invalid(
        absl::StrCat("cannot index a ", TypeName(object), " with a ", TypeName(property)));
  }
  if (!property.is_string()) {
    return Invalid(
        absl::StrCat("cannot look up a ", TypeName(property), " in a ", TypeName(object)));
  }
  return Value();
}

absl::StatusOr<Value> Evaluator::EvalSlice(const Value& object, const Node& slice,
                                           const EnvPtr& env) {
  if (!object.is_array() && !object.is_string())
    return Invalid("only lists and strings can be sliced");
  std::optional<int64_t> parts[3];
  const Node* nodes[3] = {slice.a.get(), slice.b.get(), slice.c.get()};
  for (int k = 0; k < 3; ++k) {
    if (nodes[k] == nullptr) continue;
    ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*nodes[k], env));
    if (v.is_undefined()) continue;
    if (!v.is_int()) return Invalid("slice indices must be integers");
    parts[k] = v.i();
  }
  std::vector<Value> items;
  std::vector<std::string> chars;
  int64_t length = 0;
  if (object.is_array()) {
    length = static_cast<int64_t>(object.array().items.size());
  } else {
    chars = CodePoints(object.s());
    length = static_cast<int64_t>(chars.size());
  }
  const int64_t step = parts[2].value_or(1);
  int64_t start = 0;
  int64_t stop = 0;
  if (step >= 0) {
    start = parts[0].value_or(0);
    start = start < 0 ? std::max<int64_t>(length + start, 0) : std::min(start, length);
    stop = parts[1].value_or(length);
    stop = stop < 0 ? std::max<int64_t>(length + stop, 0) : std::min(stop, length);
  } else {
    start = parts[0].value_or(length - 1);
    start = start < 0 ? std::max<int64_t>(length + start, -1) : std::min(start, length - 1);
    stop = parts[1].value_or(-1);
    stop = stop < -1 ? std::max<int64_t>(length + stop, -1) : std::min(stop, length - 1);
  }
  const int64_t direction = step > 0 ? 1 : step < 0 ? -1 : 0;
  std::string text;
  for (int64_t k = start; direction * k < direction * stop; k += step) {
    if (object.is_array()) {
      items.push_back(object.array().items[static_cast<size_t>(k)]);
    } else {
      text += chars[static_cast<size_t>(k)];
    }
  }
  if (object.is_array()) return NewArray(std::move(items));
  return NewString(std::move(text));
}

absl::StatusOr<Value> Evaluator::EvalUnary(const Node& node, const EnvPtr& env) {
  ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*node.a, env));
  if (node.str == "not") return Value::Bool(!Truthy(v));
  const bool negate = node.str == "-";
  if (v.is_float()) return Value::Float(negate ? -v.f() : v.f());
  if (v.is_bool()) return Value::Int(negate ? -int64_t{v.b()} : int64_t{v.b()});
  if (v.is_int()) {
    if (negate && v.i() == std::numeric_limits<int64_t>::min()) return Invalid("integer overflow");
    return Value::Int(negate ? -v.i() : v.i());
  }
  return Invalid(absl::StrCat("bad operand for unary ", node.str, ": ", TypeName(v)));
}

absl::StatusOr<Value> Evaluator::EvalBinary(const Node& node, const EnvPtr& env) {
  const std::string& op = node.str;
  ACCEL_ASSIGN_OR_RETURN(Value left, Eval(*node.a, env));
  if (op == "and") return Truthy(left) ? Eval(*node.b, env) : left;
  if (op == "or") return Truthy(left) ? left : Eval(*node.b, env);
  ACCEL_ASSIGN_OR_RETURN(Value right, Eval(*node.b, env));
  if (op == "==") return Value::Bool(LooseEquals(left, right));
  if (op == "!=") return Value::Bool(!LooseEquals(left, right));
  const bool is_in = op == "in" || op == "not in";
  if (left.is_undefined() || right.is_undefined()) {
    if (right.is_undefined() && is_in) return Value::Bool(op == "not in");
    return Invalid(absl::StrCat("cannot apply '", op, "' to an undefined value"));
  }
  if (left.is_none() || right.is_none())
    return Invalid(absl::StrCat("cannot apply '", op, "' to none"));
  if (op == "~") {
    ACCEL_ASSIGN_OR_RETURN(std::string a, RawString(left));
    ACCEL_ASSIGN_OR_RETURN(std::string b, RawString(right));
    return NewString(a + b);
  }
  const auto numeric_like = [](const Value& v) { return v.is_number() || v.is_bool(); };
  if (op == "**" && numeric_like(left) && numeric_like(right)) {
    const double a = left.number();
    const double b = right.number();
    if (a == 0 && b < 0) return Invalid("0.0 cannot be raised to a negative power");
    const double r = std::pow(a, b);
    if (!std::isfinite(r)) return Invalid("exponentiation result is not a finite number");
    if (left.is_float() || right.is_float() || b < 0) return Value::Float(r);
    if (std::fabs(r) >= 9.2e18) return Invalid("integer overflow");
    return Value::Int(static_cast<int64_t>(r));
  }
  if (left.is_number() && right.is_number()) {
    const bool is_float = left.is_float() || right.is_float();
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      const double a = left.number();
      const double b = right.number();
      return Value::Bool(op == "<" ? a < b : op == ">" ? a > b : op == "<=" ? a <= b : a >= b);
    }
    if (op == "/") {
      if (right.number() == 0) return Invalid("division by zero");
      return Value::Float(left.number() / right.number());
    }
    if (is_float) {
      const double a = left.number();
      const double b = right.number();
      if ((op == "//" || op == "%") && b == 0) return Invalid("division by zero");
      if (op == "+") return Value::Float(a + b);
      if (op == "-") return Value::Float(a - b);
      if (op == "*") return Value::Float(a * b);
      if (op == "//") return Value::Float(std::floor(a / b));
      if (op == "%") return Value::Float(std::fmod(a, b));
    } else {
      const int64_t a = left.i();
      const int64_t b = right.i();
      int64_t r = 0;
      if (op == "+" || op == "-" || op == "*") {
        const bool overflow = op == "+"   ? __builtin_add_overflow(a, b, &r)
                              : op == "-" ? __builtin_sub_overflow(a, b, &r)
                                          : __builtin_mul_overflow(a, b, &r);
        if (overflow) return Invalid("integer overflow");
        return Value::Int(r);
      }
      if ((op == "//" || op == "%") && b == 0) return Invalid("division by zero");
      if (op == "%") return Value::Int(b == -1 ? 0 : a % b);  // JavaScript: the sign of a
      if (op == "//") {
        if (a == std::numeric_limits<int64_t>::min() && b == -1) return Invalid("integer overflow");
        int64_t q = a / b;
        if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
        return Value::Int(q);
      }
    }
  } else if (left.is_array() && right.is_array()) {
    if (op == "+") {
      std::vector<Value> items = left.array().items;
      if (items.size() + right.array().items.size() > limits_.max_items) {
        return Invalid(absl::StrCat("list longer than ", limits_.max_items, " items"));
      }
      items.insert(items.end(), right.array().items.begin(), right.array().items.end());
      return NewArray(std::move(items));
    }
  } else if (right.is_array() && is_in) {
    bool member = false;
    for (const Value& item : right.array().items) {
      if (StrictEquals(item, left)) {
        member = true;
        break;
      }
    }
    return Value::Bool(op == "in" ? member : !member);
  }
  if ((left.is_string() || right.is_string()) && op == "+") {
    ACCEL_ASSIGN_OR_RETURN(std::string a, RawString(left));
    ACCEL_ASSIGN_OR_RETURN(std::string b, RawString(right));
    return NewString(a + b);
  }
  if (left.is_string() && right.is_string() && is_in) {
    const bool found = absl::StrContains(right.s(), left.s());
    return Value::Bool(op == "in" ? found : !found);
  }
  if (left.is_string() && right.is_object() && is_in) {
    const bool found = right.object().Find(left.s()) != nullptr;
    return Value::Bool(op == "in" ? found : !found);
  }
  return Invalid(absl::StrCat("unsupported operator '", op, "' between ", TypeName(left), " and ",
                              TypeName(right)));
}

absl::StatusOr<Evaluator::Args> Evaluator::EvalArgs(const std::vector<NodePtr>& args,
                                                    const EnvPtr& env) {
  Args out;
  for (const NodePtr& arg : args) {
    if (arg->kind == NodeKind::kSpread) {
      ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*arg->a, env));
      if (!v.is_array()) return Invalid(absl::StrCat("cannot unpack a ", TypeName(v), " with '*'"));
      for (const Value& item : v.array().items) out.positional.push_back(item);
    } else if (arg->kind != NodeKind::kKeywordArgument && arg->kind != NodeKind::kKeywordSpread) {
      ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*arg, env));
      out.positional.push_back(std::move(v));
    }
  }
  auto add = [&](const std::string& key, Value v) -> absl::Status {
    for (const auto& entry : out.keyword) {
      if (entry.first == key)
        return Invalid(absl::StrCat("got multiple values for keyword argument '", key, "'"));
    }
    out.keyword.emplace_back(key, std::move(v));
    return absl::OkStatus();
  };
  for (const NodePtr& arg : args) {
    if (arg->kind == NodeKind::kKeywordArgument) {
      ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*arg->a, env));
      ACCEL_RETURN_IF_ERROR(add(arg->str, std::move(v)));
    } else if (arg->kind == NodeKind::kKeywordSpread) {
      ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*arg->a, env));
      if (!v.is_object())
        return Invalid(absl::StrCat("argument after ** must be a dict, not a ", TypeName(v)));
      for (const auto& [key, item] : v.object().entries) ACCEL_RETURN_IF_ERROR(add(key, item));
    }
  }
  return out;
}

absl::Status Evaluator::BindParameters(const Node& node, const std::vector<NodePtr>& params,
                                       Args args, absl::string_view display_name,
                                       const EnvPtr& scope) {
  std::vector<const Node*> pending;
  for (size_t k = 0; k < params.size(); ++k) {
    const Node& param = *params[k];
    const std::string& name = param.str;
    std::optional<Value> value;
    if (k < args.positional.size()) value = args.positional[k];
    if (!value) {
      for (auto it = args.keyword.begin(); it != args.keyword.end(); ++it) {
        if (it->first == name) {
          value = std::move(it->second);
          args.keyword.erase(it);
          break;
        }
      }
    }
    if (!value && param.kind == NodeKind::kKeywordArgument) pending.push_back(&param);
    scope->vars[name] = value.value_or(Value());
  }
  if (node.uses_kwargs) {
    scope->vars["kwargs"] = MakeObject(std::move(args.keyword));
  } else if (!args.keyword.empty()) {
    return Invalid(absl::StrCat("macro ", display_name, " takes no keyword argument '",
                                args.keyword[0].first, "'"));
  }
  if (node.uses_varargs) {
    std::vector<Value> rest;
    for (size_t k = params.size(); k < args.positional.size(); ++k)
      rest.push_back(args.positional[k]);
    ACCEL_ASSIGN_OR_RETURN(scope->vars["varargs"], NewArray(std::move(rest)));
  } else if (args.positional.size() > params.size()) {
    return Invalid(absl::StrCat("macro ", display_name, " takes not more than ", params.size(),
                                " argument(s)"));
  }
  for (const Node* param : pending) {
    ACCEL_ASSIGN_OR_RETURN(Value v, Eval(*param->a, scope));
    scope->vars[param->str] = std::move(v);
  }
  return absl::OkStatus();
}

absl::StatusOr<Value> Evaluator::Call(const Value& fn_value, Args args, const EnvPtr& env) {
  const Function& fn = fn_value.function();
  switch (fn.type) {
    case Function::kGlobal:
      return CallGlobal(fn.name, std::move(args));
    case Function::kMethod:
      if (fn.receiver.is_string())
        return CallStringMethod(fn.receiver.s(), fn.name, std::move(args));
      return CallDictMethod(fn.receiver, fn.name, std::move(args));
    case Function::kMacro:
    case Function::kCaller: {
      const Node& node = *fn.node;
      auto scope = std::make_shared<Env>(fn.type == Function::kMacro ? env : fn.env);
      const std::string display =
          fn.type == Function::kMacro ? absl::StrCat("'", fn.name, "'") : "None";
      ACCEL_RETURN_IF_ERROR(BindParameters(node, node.list, std::move(args), display, scope));
      std::string out;
      ACCEL_RETURN_IF_ERROR(RenderBody(node.body, scope, &out));
      return NewString(std::move(out));
    }
  }
  return Invalid("unknown function");
}

absl::StatusOr<std::string> RenderProgram(const Program& program,
                                          const nlohmann::ordered_json& context,
                                          const Limits& limits) {
  Evaluator evaluator(limits);
  return evaluator.Render(program, context);
}

}  // namespace accel::jinja::internal
