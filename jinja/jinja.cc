#include "jinja/jinja.h"

#include <exception>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#include "core/status.h"
#include "jinja/internal/ast.h"
#include "jinja/internal/evaluator.h"
#include "jinja/internal/lexer.h"
#include "jinja/internal/parser.h"
#include "nlohmann/json.hpp"

namespace accel::jinja {

absl::StatusOr<Template> Template::Parse(absl::string_view source, TemplateOptions options) {
  try {
    ACCEL_ASSIGN_OR_RETURN(std::vector<internal::Token> tokens,
                           internal::Tokenize(source, options));
    ACCEL_ASSIGN_OR_RETURN(internal::Program program, internal::Parse(tokens));
    return Template(std::make_shared<const internal::Program>(std::move(program)));
  } catch (const std::exception& e) {  // std::bad_alloc
    return absl::ResourceExhaustedError(absl::StrCat("chat template: ", e.what()));
  }
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context) const {
  try {
    return internal::RenderProgram(*program_, context, internal::Limits());
  } catch (const std::exception& e) {  // nlohmann's accessors, std::bad_alloc
    return absl::InternalError(absl::StrCat("chat template: ", e.what()));
  }
}

}  // namespace accel::jinja
