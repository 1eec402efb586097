// jinja/internal/evaluator.h: renders a parsed Program the way
// @huggingface/jinja's Interpreter does, within Limits.
#ifndef ACCEL_JINJA_INTERNAL_EVALUATOR_H_
#define ACCEL_JINJA_INTERNAL_EVALUATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "jinja/internal/ast.h"
#include "jinja/internal/value.h"
#include "nlohmann/json_fwd.hpp"

namespace accel::jinja::internal {

// Hostile templates end in an error at these bounds, never in a crash or a hang.
struct Limits {
  int64_t max_steps = 5'000'000;         // nodes evaluated (loops, recursion)
  int max_depth = 400;                   // nested evaluation (macro recursion)
  size_t max_output = size_t{64} << 20;  // the result, and any one string
  size_t max_items = size_t{1} << 20;    // one list (range(), +)
  int64_t max_bytes = int64_t{1} << 30;  // strings and lists built, in all
};

// A scope: a for loop, a macro call, a call block. Lookups walk the parents.
struct Env {
  std::shared_ptr<Env> parent;
  absl::flat_hash_map<std::string, Value> vars;

  explicit Env(std::shared_ptr<Env> p) : parent(std::move(p)) {}
  const Value* Find(const std::string& name) const;
};

absl::StatusOr<std::string> RenderProgram(const Program& program,
                                          const nlohmann::ordered_json& context,
                                          const Limits& limits);

class Evaluator {
 public:
  explicit Evaluator(const Limits& limits) : limits_(limits) {}
  ~Evaluator();
  Evaluator(const Evaluator&) = delete;
  Evaluator& operator=(const Evaluator&) = delete;

  absl::StatusOr<std::string> Render(const Program& program, const nlohmann::ordered_json& context);

 private:
  using EnvPtr = std::shared_ptr<Env>;
  enum class Flow { kNormal, kBreak, kContinue };
  struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;
  };

  // Counts a step and a level of nesting for as long as it lives.
  class Guard {
   public:
    explicit Guard(Evaluator* e) : e_(e) { ++e_->depth_; }
    ~Guard() { --e_->depth_; }
    Guard(const Guard&) = delete;
    Guard& operator=(const Guard&) = delete;

   private:
    Evaluator* e_;
  };
  absl::Status Enter();

  // evaluator.cc: statements and expressions.
  absl::StatusOr<Flow> ExecBlock(const std::vector<NodePtr>& body, const EnvPtr& env,
                                 std::string* out);
  absl::StatusOr<Flow> Exec(const Node& node, const EnvPtr& env, std::string* out);
  absl::StatusOr<Flow> ExecUnannotated(const Node& node, const EnvPtr& env, std::string* out);
  absl::Status RenderBody(const std::vector<NodePtr>& body, const EnvPtr& env, std::string* out);
  absl::Status ExecSet(const Node& node, const EnvPtr& env);
  absl::StatusOr<Flow> ExecFor(const Node& node, const EnvPtr& env, std::string* out);
  absl::Status ExecCallBlock(const Node& node, const EnvPtr& env, std::string* out);
  absl::StatusOr<Value> Eval(const Node& node, const EnvPtr& env);
  absl::StatusOr<Value> EvalUnannotated(const Node& node, const EnvPtr& env);
  absl::StatusOr<Value> EvalMember(const Node& node, const EnvPtr& env);
  absl::StatusOr<Value> EvalSlice(const Value& object, const Node& slice, const EnvPtr& env);
  absl::StatusOr<Value> EvalBinary(const Node& node, const EnvPtr& env);
  absl::StatusOr<Value> EvalUnary(const Node& node, const EnvPtr& env);
  absl::StatusOr<Args> EvalArgs(const std::vector<NodePtr>& args, const EnvPtr& env);
  absl::StatusOr<Value> Call(const Value& fn, Args args, const EnvPtr& env);
  absl::Status BindParameters(const Node& node, const std::vector<NodePtr>& params, Args args,
                              absl::string_view display_name, const EnvPtr& scope);
  absl::Status Append(std::string* out, absl::string_view text);
  absl::Status Charge(size_t bytes);
  absl::StatusOr<Value> NewArray(std::vector<Value> items, bool tuple = false);
  absl::StatusOr<Value> NewString(std::string s);
  absl::Status Annotate(absl::Status status, const Node& node);
  absl::Status DeclareGlobals(const nlohmann::ordered_json& context);
  absl::StatusOr<Value> FromJson(const nlohmann::ordered_json& j, int depth);

  // builtins.cc: filters, tests, global functions and methods.
  absl::StatusOr<Value> ApplyFilter(const Value& operand, const Node& filter, const EnvPtr& env);
  absl::StatusOr<Value> ApplyFilterCall(const Value& operand, const Node& filter,
                                        const EnvPtr& env);
  absl::StatusOr<bool> ApplyTest(const std::string& test, const Value& operand, const Value* arg);
  absl::StatusOr<Value> CallGlobal(const std::string& name, Args args);
  absl::StatusOr<Value> CallStringMethod(const std::string& s, const std::string& name, Args args);
  absl::StatusOr<Value> CallDictMethod(const Value& dict, const std::string& name, Args args);
  absl::StatusOr<Value> SelectAttr(const Value& operand, const Node& filter, bool select,
                                   const EnvPtr& env);
  absl::StatusOr<Value> Sort(const Value& operand, const Args& args);
  absl::StatusOr<Value> ToJsonFilter(const Value& operand, const Args& args);
  static bool IsStringMethod(absl::string_view name);
  static bool IsDictMethod(absl::string_view name);

  const Limits limits_;
  int64_t steps_ = 0;
  int depth_ = 0;
  int64_t bytes_ = 0;
  bool annotated_ = false;
  EnvPtr globals_;
  // Cleared when the render ends: namespaces and closures' scopes can form cycles.
  std::vector<std::weak_ptr<Object>> namespaces_;
  std::vector<std::weak_ptr<Env>> closure_envs_;
};

}  // namespace accel::jinja::internal

#endif  // ACCEL_JINJA_INTERNAL_EVALUATOR_H_
