#include "jinja/jinja.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace accel::jinja {
namespace {

using ::testing::HasSubstr;

std::string Render(const std::string& source,
                   const nlohmann::json& context = nlohmann::json::object()) {
  absl::StatusOr<Template> t = Template::Parse(source);
  if (!t.ok()) return "PARSE ERROR: " + std::string(t.status().message());
  absl::StatusOr<std::string> out = t->Render(context);
  if (!out.ok()) return "RENDER ERROR: " + std::string(out.status().message());
  return *out;
}

TEST(JinjaTest, Text) { EXPECT_EQ(Render("hello\n"), "hello"); }

}  // namespace
}  // namespace accel::jinja
