// jinja/internal/ast.h: the parsed template, one node type for statements and
// expressions (the shapes of @huggingface/jinja's AST).
#ifndef ACCEL_JINJA_INTERNAL_AST_H_
#define ACCEL_JINJA_INTERNAL_AST_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accel::jinja::internal {

enum class NodeKind {
  // Statements.
  kText,  // str
  kComment,
  kIf,   // a: test; body; alt
  kFor,  // a: target (identifier or tuple); b: iterable; c: filter or null; body; alt: else
  kBreak,
  kContinue,
  kSet,          // a: target; b: value or null (then body)
  kMacro,        // str: name; list: parameters; body
  kCallBlock,    // a: call; list: caller parameters; body
  kFilterBlock,  // a: filter (identifier or call); body
  // Expressions.
  kIdentifier,       // str
  kInteger,          // i
  kFloat,            // f
  kString,           // str
  kArray,            // list
  kTuple,            // list
  kObject,           // list: key, value, key, value, ...
  kMember,           // a: object; b: property; flag: computed (a[b] rather than a.b)
  kCall,             // a: callee; list: arguments
  kBinary,           // str: operator; a, b
  kUnary,            // str: operator; a
  kFilter,           // a: operand; b: filter (identifier or call)
  kTest,             // a: operand; str: test; flag: negated
  kSelect,           // a: value; b: condition ("a if b" without else)
  kTernary,          // a: condition; b: if true; c: if false
  kSlice,            // a, b, c: start, stop, step, each may be null
  kKeywordArgument,  // str: name; a: value
  kSpread,           // a
  kKeywordSpread,    // a
};

struct Node {
  NodeKind kind;
  int line = 0;
  std::string str;
  int64_t i = 0;
  double f = 0;
  bool flag = false;
  // Macros and call blocks: whether the body reads `varargs` / `kwargs`
  // (then extra arguments land there instead of being errors).
  bool uses_varargs = false;
  bool uses_kwargs = false;
  int depth = 1;  // of the tree below, bounded at parse time (evaluation recurses on it)
  std::unique_ptr<Node> a, b, c;
  std::vector<std::unique_ptr<Node>> list, body, alt;

  Node(NodeKind k, int l) : kind(k), line(l) {}
};

using NodePtr = std::unique_ptr<Node>;

struct Program {
  std::vector<NodePtr> body;
};

}  // namespace accel::jinja::internal

#endif  // ACCEL_JINJA_INTERNAL_AST_H_
