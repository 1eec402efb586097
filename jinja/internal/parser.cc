#include "jinja/internal/parser.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "core/status.h"

namespace accel::jinja::internal {
namespace {

// Recursion of the parser itself (parentheses, `not not`, nested blocks).
constexpr int kMaxParseNesting = 100;

enum class ArgsMode { kCall, kParameters };

int DepthBelow(const Node& n) {
  int depth = 0;
  for (const Node* child : {n.a.get(), n.b.get(), n.c.get()}) {
    if (child != nullptr) depth = std::max(depth, child->depth);
  }
  for (const auto* list : {&n.list, &n.body, &n.alt}) {
    for (const NodePtr& child : *list) depth = std::max(depth, child->depth);
  }
  return depth;
}

bool ReadsName(const Node& n, absl::string_view name) {
  if (n.kind == NodeKind::kIdentifier && n.str == name) return true;
  for (const Node* child : {n.a.get(), n.b.get(), n.c.get()}) {
    if (child != nullptr && ReadsName(*child, name)) return true;
  }
  for (const auto* list : {&n.list, &n.body, &n.alt}) {
    for (const NodePtr& child : *list) {
      if (ReadsName(*child, name)) return true;
    }
  }
  return false;
}

class Parser {
 public:
  explicit Parser(const std::vector<Token>& tokens) : tokens_(tokens) {}

  absl::StatusOr<Program> Run() {
    Program program;
    while (pos_ < tokens_.size()) {
      ACCEL_ASSIGN_OR_RETURN(NodePtr node, ParseAny());
      program.body.push_back(std::move(node));
    }
    return program;
  }

 private:
  // RAII count of the parser's own recursion.
  class Nesting {
   public:
    explicit Nesting(Parser* p) : p_(p) { ++p_->nesting_; }
    ~Nesting() { --p_->nesting_; }
    Nesting(const Nesting&) = delete;
    Nesting& operator=(const Nesting&) = delete;
    bool TooDeep() const { return p_->nesting_ > kMaxParseNesting; }

   private:
    Parser* p_;
  };

  int Line() const {
    if (tokens_.empty()) return 1;
    return tokens_[std::min(pos_, tokens_.size() - 1)].line;
  }
  absl::Status Error(absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat("chat template line ", Line(), ": ", message));
  }
  absl::Status EndError() const { return Error("unexpected end of template"); }
  NodePtr New(NodeKind kind) const { return std::make_unique<Node>(kind, Line()); }
  absl::Status Seal(Node& n) const {
    n.depth = DepthBelow(n) + 1;
    if (n.depth > kMaxTreeDepth) {
      return absl::InvalidArgumentError(absl::StrCat("chat template line ", n.line,
                                                     ": expression nested too deeply (more than ",
                                                     kMaxTreeDepth, " levels)"));
    }
    return absl::OkStatus();
  }

  bool AtEnd() const { return pos_ >= tokens_.size(); }
  bool Is(TokenType type) const { return !AtEnd() && tokens_[pos_].type == type; }
  bool IsIdent(absl::string_view name, size_t ahead = 0) const {
    return pos_ + ahead < tokens_.size() && tokens_[pos_ + ahead].type == TokenType::kIdentifier &&
           tokens_[pos_ + ahead].value == name;
  }
  bool IsStatement(std::initializer_list<absl::string_view> names) const {
    if (!Is(TokenType::kOpenStatement) || pos_ + 1 >= tokens_.size() ||
        tokens_[pos_ + 1].type != TokenType::kIdentifier) {
      return false;
    }
    return std::find(names.begin(), names.end(), tokens_[pos_ + 1].value) != names.end();
  }
  absl::Status Expect(TokenType type, absl::string_view what) {
    if (AtEnd()) return Error(absl::StrCat("expected ", what, " but the template ended"));
    if (tokens_[pos_].type != type) {
      return Error(absl::StrCat("expected ", what, ", got '", tokens_[pos_].value, "'"));
    }
    ++pos_;
    return absl::OkStatus();
  }
  absl::Status ExpectIdent(absl::string_view name) {
    if (!IsIdent(name)) return Error(absl::StrCat("expected '", name, "'"));
    ++pos_;
    return absl::OkStatus();
  }
  // Statements up to one of `enders` ({% name ...), which is not consumed.
  absl::Status ParseBody(std::initializer_list<absl::string_view> enders, absl::string_view block,
                         int opened, std::vector<NodePtr>* body) {
    while (!IsStatement(enders)) {
      if (AtEnd()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "chat template line ", opened, ": unclosed '", block, "' block (expected '{% ",
            *enders.begin() == "elif" ? "endif" : *(enders.end() - 1), " %}')"));
      }
      ACCEL_ASSIGN_OR_RETURN(NodePtr node, ParseAny());
      body->push_back(std::move(node));
    }
    return absl::OkStatus();
  }
  // {% name %} closing a block.
  absl::Status ParseEnd(absl::string_view name) {
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kOpenStatement, "'{%'"));
    ACCEL_RETURN_IF_ERROR(ExpectIdent(name));
    return Expect(TokenType::kCloseStatement, "'%}'");
  }

  absl::StatusOr<NodePtr> ParseAny();
  absl::StatusOr<NodePtr> ParseStatement();
  absl::StatusOr<NodePtr> ParseSet();
  absl::StatusOr<NodePtr> ParseIf(int opened);
  absl::StatusOr<NodePtr> ParseMacro(int opened);
  absl::StatusOr<NodePtr> ParseFor(int opened);
  absl::StatusOr<NodePtr> ParseSequence(bool primary);
  absl::StatusOr<NodePtr> ParseExpression();
  absl::StatusOr<NodePtr> ParseOr();
  absl::StatusOr<NodePtr> ParseAnd();
  absl::StatusOr<NodePtr> ParseNot();
  absl::StatusOr<NodePtr> ParseComparison();
  absl::StatusOr<NodePtr> ParseAdditive();
  absl::StatusOr<NodePtr> ParseMultiplicative();
  absl::StatusOr<NodePtr> ParsePower();
  absl::StatusOr<NodePtr> ParseTest();
  absl::StatusOr<NodePtr> ParseFilter();
  absl::StatusOr<NodePtr> ParseUnarySign();
  absl::StatusOr<NodePtr> ParseCallMember();
  absl::StatusOr<NodePtr> ParseCall(NodePtr callee);
  absl::Status ParseArgs(ArgsMode mode, std::vector<NodePtr>* args);
  absl::StatusOr<NodePtr> ParseSubscript();
  absl::StatusOr<NodePtr> ParseMember(NodePtr object);
  absl::StatusOr<NodePtr> ParsePrimary();
  absl::Status CheckFilter(const Node& filter) const;
  absl::StatusOr<NodePtr> Binary(NodePtr left, const std::string& op, NodePtr right) const {
    auto node = std::make_unique<Node>(NodeKind::kBinary, left->line);
    node->str = op;
    node->a = std::move(left);
    node->b = std::move(right);
    ACCEL_RETURN_IF_ERROR(Seal(*node));
    return node;
  }

  const std::vector<Token>& tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;
};

absl::StatusOr<NodePtr> Parser::ParseAny() {
  const Token& token = tokens_[pos_];
  switch (token.type) {
    case TokenType::kComment: {
      NodePtr node = New(NodeKind::kComment);
      ++pos_;
      return node;
    }
    case TokenType::kText: {
      NodePtr node = New(NodeKind::kText);
      node->str = token.value;
      ++pos_;
      return node;
    }
    case TokenType::kOpenStatement: {
      Nesting nesting(this);
      if (nesting.TooDeep()) return Error("blocks nested too deeply");
      return ParseStatement();
    }
    case TokenType::kOpenExpression: {
      ++pos_;
      ACCEL_ASSIGN_OR_RETURN(NodePtr node, ParseExpression());
      ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseExpression, "'}}'"));
      return node;
    }
    default:
      return Error(absl::StrCat("unexpected '", token.value, "'"));
  }
}

absl::StatusOr<NodePtr> Parser::ParseStatement() {
  const int opened = Line();
  ++pos_;  // {%
  if (AtEnd()) return EndError();
  if (!Is(TokenType::kIdentifier)) {
    return Error(absl::StrCat("expected a statement name, got '", tokens_[pos_].value, "'"));
  }
  const std::string name = tokens_[pos_].value;
  ++pos_;
  NodePtr result;
  if (name == "set") {
    ACCEL_ASSIGN_OR_RETURN(result, ParseSet());
  } else if (name == "if") {
    ACCEL_ASSIGN_OR_RETURN(result, ParseIf(opened));
    ACCEL_RETURN_IF_ERROR(ParseEnd("endif"));
  } else if (name == "macro") {
    ACCEL_ASSIGN_OR_RETURN(result, ParseMacro(opened));
    ACCEL_RETURN_IF_ERROR(ParseEnd("endmacro"));
  } else if (name == "for") {
    ACCEL_ASSIGN_OR_RETURN(result, ParseFor(opened));
    ACCEL_RETURN_IF_ERROR(ParseEnd("endfor"));
  } else if (name == "call") {
    result = New(NodeKind::kCallBlock);
    result->line = opened;
    if (Is(TokenType::kOpenParen))
      ACCEL_RETURN_IF_ERROR(ParseArgs(ArgsMode::kParameters, &result->list));
    ACCEL_ASSIGN_OR_RETURN(NodePtr callee, ParsePrimary());
    if (callee->kind != NodeKind::kIdentifier) return Error("expected a macro name after 'call'");
    NodePtr call = New(NodeKind::kCall);
    call->a = std::move(callee);
    ACCEL_RETURN_IF_ERROR(ParseArgs(ArgsMode::kCall, &call->list));
    result->a = std::move(call);
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
    ACCEL_RETURN_IF_ERROR(ParseBody({"endcall"}, "call", opened, &result->body));
    ACCEL_RETURN_IF_ERROR(ParseEnd("endcall"));
    result->uses_varargs = std::any_of(result->body.begin(), result->body.end(),
                                       [](const NodePtr& n) { return ReadsName(*n, "varargs"); });
    result->uses_kwargs = std::any_of(result->body.begin(), result->body.end(),
                                      [](const NodePtr& n) { return ReadsName(*n, "kwargs"); });
  } else if (name == "break" || name == "continue") {
    result = New(name == "break" ? NodeKind::kBreak : NodeKind::kContinue);
    result->line = opened;
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
  } else if (name == "filter") {
    result = New(NodeKind::kFilterBlock);
    result->line = opened;
    ACCEL_ASSIGN_OR_RETURN(NodePtr filter, ParsePrimary());
    if (filter->kind == NodeKind::kIdentifier && Is(TokenType::kOpenParen)) {
      ACCEL_ASSIGN_OR_RETURN(filter, ParseCall(std::move(filter)));
    }
    ACCEL_RETURN_IF_ERROR(CheckFilter(*filter));
    result->a = std::move(filter);
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
    ACCEL_RETURN_IF_ERROR(ParseBody({"endfilter"}, "filter", opened, &result->body));
    ACCEL_RETURN_IF_ERROR(ParseEnd("endfilter"));
  } else {
    pos_ -= 1;
    return Error(absl::StrCat("unknown tag '", name, "'"));
  }
  ACCEL_RETURN_IF_ERROR(Seal(*result));
  return result;
}

absl::StatusOr<NodePtr> Parser::ParseSet() {
  const int opened = Line();
  NodePtr node = New(NodeKind::kSet);
  ACCEL_ASSIGN_OR_RETURN(node->a, ParseSequence(false));
  if (Is(TokenType::kEquals)) {
    ++pos_;
    ACCEL_ASSIGN_OR_RETURN(node->b, ParseSequence(false));
  } else {
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
    ACCEL_RETURN_IF_ERROR(ParseBody({"endset"}, "set", opened, &node->body));
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kOpenStatement, "'{%'"));
    ACCEL_RETURN_IF_ERROR(ExpectIdent("endset"));
  }
  ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseIf(int opened) {
  Nesting nesting(this);
  if (nesting.TooDeep()) return Error("blocks nested too deeply");
  NodePtr node = New(NodeKind::kIf);
  ACCEL_ASSIGN_OR_RETURN(node->a, ParseExpression());
  ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
  ACCEL_RETURN_IF_ERROR(ParseBody({"elif", "else", "endif"}, "if", opened, &node->body));
  if (IsStatement({"elif"})) {
    pos_ += 2;
    ACCEL_ASSIGN_OR_RETURN(NodePtr elif, ParseIf(opened));
    node->alt.push_back(std::move(elif));
  } else if (IsStatement({"else"})) {
    pos_ += 2;
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
    ACCEL_RETURN_IF_ERROR(ParseBody({"endif"}, "if", opened, &node->alt));
  }
  ACCEL_RETURN_IF_ERROR(Seal(*node));
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseMacro(int opened) {
  NodePtr node = New(NodeKind::kMacro);
  ACCEL_ASSIGN_OR_RETURN(NodePtr name, ParsePrimary());
  if (name->kind != NodeKind::kIdentifier) return Error("expected a name after 'macro'");
  node->str = name->str;
  ACCEL_RETURN_IF_ERROR(ParseArgs(ArgsMode::kParameters, &node->list));
  ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
  ACCEL_RETURN_IF_ERROR(ParseBody({"endmacro"}, "macro", opened, &node->body));
  auto reads = [&](absl::string_view special) {
    for (const NodePtr& param : node->list) {
      if (param->str == special) return false;
    }
    return std::any_of(node->body.begin(), node->body.end(),
                       [&](const NodePtr& n) { return ReadsName(*n, special); });
  };
  node->uses_varargs = reads("varargs");
  node->uses_kwargs = reads("kwargs");
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseFor(int opened) {
  NodePtr node = New(NodeKind::kFor);
  ACCEL_ASSIGN_OR_RETURN(node->a, ParseSequence(true));
  if (node->a->kind != NodeKind::kIdentifier && node->a->kind != NodeKind::kTuple) {
    return Error("expected a name or a tuple of names for the loop variable");
  }
  if (!IsIdent("in")) return Error("expected 'in' after the loop variable");
  ++pos_;
  ACCEL_ASSIGN_OR_RETURN(NodePtr iterable, ParseExpression());
  if (iterable->kind == NodeKind::kSelect) {
    node->b = std::move(iterable->a);
    node->c = std::move(iterable->b);
  } else {
    node->b = std::move(iterable);
  }
  ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
  ACCEL_RETURN_IF_ERROR(ParseBody({"endfor", "else"}, "for", opened, &node->body));
  if (IsStatement({"else"})) {
    pos_ += 2;
    ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseStatement, "'%}'"));
    ACCEL_RETURN_IF_ERROR(ParseBody({"endfor"}, "for", opened, &node->alt));
  }
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseSequence(bool primary) {
  const int line = Line();
  ACCEL_ASSIGN_OR_RETURN(NodePtr first, primary ? ParsePrimary() : ParseExpression());
  if (!Is(TokenType::kComma)) return first;
  auto tuple = std::make_unique<Node>(NodeKind::kTuple, line);
  tuple->list.push_back(std::move(first));
  while (Is(TokenType::kComma)) {
    ++pos_;
    ACCEL_ASSIGN_OR_RETURN(NodePtr next, primary ? ParsePrimary() : ParseExpression());
    tuple->list.push_back(std::move(next));
  }
  ACCEL_RETURN_IF_ERROR(Seal(*tuple));
  return tuple;
}

absl::StatusOr<NodePtr> Parser::ParseExpression() {
  Nesting nesting(this);
  if (nesting.TooDeep()) return Error("expression nested too deeply");
  ACCEL_ASSIGN_OR_RETURN(NodePtr a, ParseOr());
  if (!IsIdent("if")) return a;
  ++pos_;
  ACCEL_ASSIGN_OR_RETURN(NodePtr test, ParseOr());
  NodePtr node;
  if (IsIdent("else")) {
    ++pos_;
    node = std::make_unique<Node>(NodeKind::kTernary, a->line);
    ACCEL_ASSIGN_OR_RETURN(node->c, ParseExpression());
    node->a = std::move(test);
    node->b = std::move(a);
  } else {
    node = std::make_unique<Node>(NodeKind::kSelect, a->line);
    node->a = std::move(a);
    node->b = std::move(test);
  }
  ACCEL_RETURN_IF_ERROR(Seal(*node));
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseOr() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParseAnd());
  while (IsIdent("or")) {
    ++pos_;
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParseAnd());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), "or", std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParseAnd() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParseNot());
  while (IsIdent("and")) {
    ++pos_;
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParseNot());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), "and", std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParseNot() {
  if (!IsIdent("not")) return ParseComparison();
  Nesting nesting(this);
  if (nesting.TooDeep()) return Error("expression nested too deeply");
  NodePtr node = New(NodeKind::kUnary);
  node->str = "not";
  ++pos_;
  ACCEL_ASSIGN_OR_RETURN(node->a, ParseNot());
  ACCEL_RETURN_IF_ERROR(Seal(*node));
  return node;
}

absl::StatusOr<NodePtr> Parser::ParseComparison() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParseAdditive());
  while (true) {
    std::string op;
    if (IsIdent("not") && IsIdent("in", 1)) {
      op = "not in";
      pos_ += 2;
    } else if (IsIdent("in") || Is(TokenType::kComparison)) {
      op = tokens_[pos_++].value;
    } else {
      break;
    }
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParseAdditive());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParseAdditive() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParseMultiplicative());
  while (Is(TokenType::kAdditive)) {
    const std::string op = tokens_[pos_++].value;
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParseMultiplicative());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParseMultiplicative() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParsePower());
  while (Is(TokenType::kMultiplicative)) {
    const std::string op = tokens_[pos_++].value;
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParsePower());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), op, std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParsePower() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr left, ParseTest());
  while (Is(TokenType::kPower)) {
    ++pos_;
    ACCEL_ASSIGN_OR_RETURN(NodePtr right, ParseTest());
    ACCEL_ASSIGN_OR_RETURN(left, Binary(std::move(left), "**", std::move(right)));
  }
  return left;
}

absl::StatusOr<NodePtr> Parser::ParseTest() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr operand, ParseFilter());
  while (IsIdent("is")) {
    ++pos_;
    auto node = std::make_unique<Node>(NodeKind::kTest, Line());
    node->flag = IsIdent("not");
    if (node->flag) ++pos_;
    if (AtEnd()) return EndError();
    ACCEL_ASSIGN_OR_RETURN(NodePtr test, ParsePrimary());
    if (test->kind != NodeKind::kIdentifier) return Error("expected a test name after 'is'");
    if (!IsKnownTest(test->str) && !IsJinja2Test(test->str)) {
      return absl::InvalidArgumentError(
          absl::StrCat("chat template line ", test->line, ": unknown test '", test->str, "'"));
    }
    node->str = test->str;
    node->a = std::move(operand);
    ACCEL_RETURN_IF_ERROR(Seal(*node));
    operand = std::move(node);
  }
  return operand;
}

absl::Status Parser::CheckFilter(const Node& filter) const {
  const Node* name = &filter;
  if (filter.kind == NodeKind::kCall) name = filter.a.get();
  if (name->kind != NodeKind::kIdentifier) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", filter.line, ": expected a filter name"));
  }
  if (!IsKnownFilter(name->str) && !IsJinja2Filter(name->str)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat template line ", name->line, ": unknown filter '", name->str, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<NodePtr> Parser::ParseFilter() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr operand, ParseUnarySign());
  while (Is(TokenType::kPipe)) {
    ++pos_;
    auto node = std::make_unique<Node>(NodeKind::kFilter, Line());
    if (AtEnd()) return EndError();
    ACCEL_ASSIGN_OR_RETURN(NodePtr filter, ParsePrimary());
    if (filter->kind != NodeKind::kIdentifier) return Error("expected a filter name after '|'");
    if (Is(TokenType::kOpenParen)) {
      ACCEL_ASSIGN_OR_RETURN(filter, ParseCall(std::move(filter)));
    }
    ACCEL_RETURN_IF_ERROR(CheckFilter(*filter));
    node->a = std::move(operand);
    node->b = std::move(filter);
    ACCEL_RETURN_IF_ERROR(Seal(*node));
    operand = std::move(node);
  }
  return operand;
}

absl::StatusOr<NodePtr> Parser::ParseUnarySign() {
  if ((Is(TokenType::kUnary) || Is(TokenType::kAdditive)) &&
      (tokens_[pos_].value == "-" || tokens_[pos_].value == "+")) {
    Nesting nesting(this);
    if (nesting.TooDeep()) return Error("expression nested too deeply");
    NodePtr node = New(NodeKind::kUnary);
    node->str = tokens_[pos_++].value;
    ACCEL_ASSIGN_OR_RETURN(node->a, ParseUnarySign());
    ACCEL_RETURN_IF_ERROR(Seal(*node));
    return node;
  }
  return ParseCallMember();
}

absl::StatusOr<NodePtr> Parser::ParseCallMember() {
  ACCEL_ASSIGN_OR_RETURN(NodePtr primary, ParsePrimary());
  ACCEL_ASSIGN_OR_RETURN(NodePtr member, ParseMember(std::move(primary)));
  if (Is(TokenType::kOpenParen)) return ParseCall(std::move(member));
  return member;
}

absl::StatusOr<NodePtr> Parser::ParseCall(NodePtr callee) {
  NodePtr expression = std::move(callee);
  while (Is(TokenType::kOpenParen)) {
    auto call = std::make_unique<Node>(NodeKind::kCall, expression->line);
    ACCEL_RETURN_IF_ERROR(ParseArgs(ArgsMode::kCall, &call->list));
    call->a = std::move(expression);
    ACCEL_RETURN_IF_ERROR(Seal(*call));
    ACCEL_ASSIGN_OR_RETURN(expression, ParseMember(std::move(call)));
  }
  return expression;
}

absl::Status Parser::ParseArgs(ArgsMode mode, std::vector<NodePtr>* args) {
  ACCEL_RETURN_IF_ERROR(Expect(TokenType::kOpenParen, "'('"));
  absl::flat_hash_set<std::string> names;
  bool saw_keyword = false;
  bool saw_spread = false;
  while (!Is(TokenType::kCloseParen)) {
    if (AtEnd()) return EndError();
    const bool keyword_spread = Is(TokenType::kPower);
    const bool spread = Is(TokenType::kMultiplicative) && tokens_[pos_].value == "*";
    if (mode == ArgsMode::kParameters && (keyword_spread || spread)) {
      return Error("argument unpacking is not allowed in parameter declarations");
    }
    if (keyword_spread) {
      NodePtr node = New(NodeKind::kKeywordSpread);
      ++pos_;
      ACCEL_ASSIGN_OR_RETURN(node->a, ParseExpression());
      ACCEL_RETURN_IF_ERROR(Seal(*node));
      args->push_back(std::move(node));
      if (Is(TokenType::kComma)) ++pos_;
      if (!Is(TokenType::kCloseParen)) return Error("'**' must be applied to the final argument");
      break;
    }
    NodePtr argument;
    if (spread) {
      if (saw_spread) return Error("only one '*' argument unpacking is allowed");
      saw_spread = true;
      argument = New(NodeKind::kSpread);
      ++pos_;
      ACCEL_ASSIGN_OR_RETURN(argument->a, ParseExpression());
      ACCEL_RETURN_IF_ERROR(Seal(*argument));
    } else {
      ACCEL_ASSIGN_OR_RETURN(argument, ParseExpression());
      if (Is(TokenType::kEquals)) {
        ++pos_;
        if (argument->kind != NodeKind::kIdentifier) {
          return Error(mode == ArgsMode::kParameters ? "expected a name for the parameter"
                                                     : "expected a name for the keyword argument");
        }
        auto keyword = std::make_unique<Node>(NodeKind::kKeywordArgument, argument->line);
        keyword->str = argument->str;
        ACCEL_ASSIGN_OR_RETURN(keyword->a, ParseExpression());
        ACCEL_RETURN_IF_ERROR(Seal(*keyword));
        argument = std::move(keyword);
      }
      if (mode == ArgsMode::kParameters) {
        if (argument->kind != NodeKind::kIdentifier &&
            argument->kind != NodeKind::kKeywordArgument) {
          return Error("expected a name for the parameter");
        }
        if (!names.insert(argument->str).second) {
          return Error(absl::StrCat("duplicate parameter name '", argument->str, "'"));
        }
      }
      if (argument->kind == NodeKind::kKeywordArgument) {
        saw_keyword = true;
      } else if (saw_keyword) {
        return Error(mode == ArgsMode::kCall
                         ? "positional arguments must come before keyword arguments"
                         : "a parameter without a default follows one with a default");
      } else if (saw_spread) {
        return Error("positional arguments must not follow '*' argument unpacking");
      }
    }
    args->push_back(std::move(argument));
    if (Is(TokenType::kComma)) ++pos_;
  }
  return Expect(TokenType::kCloseParen, "')'");
}

absl::StatusOr<NodePtr> Parser::ParseSubscript() {
  const int line = Line();
  std::vector<NodePtr> parts;
  bool is_slice = false;
  while (!Is(TokenType::kCloseSquare)) {
    if (AtEnd()) return EndError();
    if (Is(TokenType::kColon)) {
      parts.push_back(nullptr);
      ++pos_;
      is_slice = true;
    } else {
      ACCEL_ASSIGN_OR_RETURN(NodePtr part, ParseExpression());
      parts.push_back(std::move(part));
      if (Is(TokenType::kColon)) {
        ++pos_;
        is_slice = true;
      }
    }
  }
  if (parts.empty()) return Error("expected an index or a slice in '[]'");
  if (!is_slice) return std::move(parts[0]);
  if (parts.size() > 3) return Error("a slice has at most three parts");
  auto slice = std::make_unique<Node>(NodeKind::kSlice, line);
  parts.resize(3);
  slice->a = std::move(parts[0]);
  slice->b = std::move(parts[1]);
  slice->c = std::move(parts[2]);
  ACCEL_RETURN_IF_ERROR(Seal(*slice));
  return slice;
}

absl::StatusOr<NodePtr> Parser::ParseMember(NodePtr object) {
  while (Is(TokenType::kDot) || Is(TokenType::kOpenSquare)) {
    const bool computed = Is(TokenType::kOpenSquare);
    auto member = std::make_unique<Node>(NodeKind::kMember, Line());
    ++pos_;
    member->flag = computed;
    if (computed) {
      ACCEL_ASSIGN_OR_RETURN(member->b, ParseSubscript());
      ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseSquare, "']'"));
    } else {
      if (AtEnd()) return EndError();
      ACCEL_ASSIGN_OR_RETURN(member->b, ParsePrimary());
      if (member->b->kind != NodeKind::kIdentifier && member->b->kind != NodeKind::kInteger) {
        return Error("expected a name or an integer after '.'");
      }
    }
    member->a = std::move(object);
    ACCEL_RETURN_IF_ERROR(Seal(*member));
    object = std::move(member);
  }
  return object;
}

absl::StatusOr<NodePtr> Parser::ParsePrimary() {
  if (AtEnd()) return EndError();
  const Token& token = tokens_[pos_++];
  NodePtr node;
  switch (token.type) {
    case TokenType::kNumber: {
      if (token.value.find('.') != std::string::npos) {
        node = std::make_unique<Node>(NodeKind::kFloat, token.line);
        node->f = std::strtod(token.value.c_str(), nullptr);
      } else {
        node = std::make_unique<Node>(NodeKind::kInteger, token.line);
        const char* begin = token.value.data();
        if (*begin == '+') ++begin;
        const auto [end, ec] =
            std::from_chars(begin, token.value.data() + token.value.size(), node->i);
        if (ec != std::errc() || end != token.value.data() + token.value.size()) {
          --pos_;
          return Error(absl::StrCat("integer literal out of range: ", token.value));
        }
      }
      return node;
    }
    case TokenType::kString: {
      node = std::make_unique<Node>(NodeKind::kString, token.line);
      node->str = token.value;
      while (Is(TokenType::kString)) node->str += tokens_[pos_++].value;
      return node;
    }
    case TokenType::kIdentifier:
      node = std::make_unique<Node>(NodeKind::kIdentifier, token.line);
      node->str = token.value;
      return node;
    case TokenType::kOpenParen: {
      ACCEL_ASSIGN_OR_RETURN(node, ParseSequence(false));
      ACCEL_RETURN_IF_ERROR(Expect(TokenType::kCloseParen, "')'"));
      return node;
    }
    case TokenType::kOpenSquare: {
      node = std::make_unique<Node>(NodeKind::kArray, token.line);
      while (!Is(TokenType::kCloseSquare)) {
        if (AtEnd()) return EndError();
        ACCEL_ASSIGN_OR_RETURN(NodePtr value, ParseExpression());
        node->list.push_back(std::move(value));
        if (Is(TokenType::kComma)) ++pos_;
      }
      ++pos_;
      ACCEL_RETURN_IF_ERROR(Seal(*node));
      return node;
    }
    case TokenType::kOpenCurly: {
      node = std::make_unique<Node>(NodeKind::kObject, token.line);
      while (!Is(TokenType::kCloseCurly)) {
        if (AtEnd()) return EndError();
        ACCEL_ASSIGN_OR_RETURN(NodePtr key, ParseExpression());
        ACCEL_RETURN_IF_ERROR(Expect(TokenType::kColon, "':' between key and value"));
        ACCEL_ASSIGN_OR_RETURN(NodePtr value, ParseExpression());
        node->list.push_back(std::move(key));
        node->list.push_back(std::move(value));
        if (Is(TokenType::kComma)) ++pos_;
      }
      ++pos_;
      ACCEL_RETURN_IF_ERROR(Seal(*node));
      return node;
    }
    default:
      --pos_;
      return Error(absl::StrCat("unexpected '", token.value, "'"));
  }
}

}  // namespace

bool IsKnownFilter(const std::string& name) {
  static const auto* const kFilters = new absl::flat_hash_set<std::string>{
      "safe",   "tojson",  "list",       "first",      "last",  "length", "reverse",    "sort",
      "join",   "string",  "unique",     "upper",      "lower", "title",  "capitalize", "trim",
      "indent", "int",     "float",      "abs",        "items", "keys",   "values",     "dictsort",
      "bool",   "default", "selectattr", "rejectattr", "map",   "replace"};
  return kFilters->contains(name);
}

bool IsKnownTest(const std::string& name) {
  static const auto* const kTests = new absl::flat_hash_set<std::string>{
      "boolean", "callable", "odd",       "even",     "false",   "true",     "none",
      "string",  "number",   "integer",   "iterable", "mapping", "sequence", "lower",
      "upper",   "defined",  "undefined", "equalto",  "eq"};
  return kTests->contains(name);
}

bool IsJinja2Filter(const std::string& name) {
  static const auto* const kFilters = new absl::flat_hash_set<std::string>{
      "attr",           "batch",       "center", "count",     "d",        "e",         "escape",
      "filesizeformat", "forceescape", "format", "groupby",   "max",      "min",       "pprint",
      "random",         "reject",      "round",  "select",    "slice",    "striptags", "sum",
      "truncate",       "urlencode",   "urlize", "wordcount", "wordwrap", "xmlattr"};
  return kFilters->contains(name);
}

bool IsJinja2Test(const std::string& name) {
  static const auto* const kTests = new absl::flat_hash_set<std::string>{
      "divisibleby", "escaped", "filter", "float", "ge",     "gt",
      "in",          "le",      "lt",     "ne",    "sameas", "test"};
  return kTests->contains(name);
}

absl::StatusOr<Program> Parse(const std::vector<Token>& tokens) { return Parser(tokens).Run(); }

}  // namespace accel::jinja::internal
