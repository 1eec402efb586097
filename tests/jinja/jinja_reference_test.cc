// Every chat template rendering in <build>/jinja-refs/refs.json, written by
// scripts/jinja_references.sh with @huggingface/jinja (what transformers.js
// uses), must come out byte for byte the same; where the reference raised,
// Parse or Render must fail. The references are found through
// $ACCEL_JINJA_REFS, by default <build>/jinja-refs next to $ACCEL_BIN_DIR
// (<build>/bin, which CMake passes); without them the test fails.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/escaping.h"

#include "gtest/gtest.h"
#include "jinja/jinja.h"
#include "nlohmann/json.hpp"

namespace accel::jinja {
namespace {

std::string RefsDir() {
  if (const char* dir = std::getenv("ACCEL_JINJA_REFS"); dir != nullptr) return dir;
  const char* bin = std::getenv("ACCEL_BIN_DIR");
  return bin == nullptr ? std::string("build/jinja-refs") : std::string(bin) + "/../jinja-refs";
}

TEST(JinjaReferenceTest, EveryRenderingMatchesHuggingFaceJinja) {
  const std::string refs_path = RefsDir() + "/refs.json";
  if (!std::filesystem::exists(refs_path)) {
    GTEST_FAIL() << "no reference file " << refs_path
                 << ": run scripts/jinja_references.sh build (it writes build/jinja-refs/ with "
                    "@huggingface/jinja)";
  }
  std::ifstream in(refs_path);
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::ordered_json refs = nlohmann::ordered_json::parse(text.str());
  ASSERT_GT(refs.size(), 300U);
  int passed = 0;
  int failed = 0;
  for (const nlohmann::ordered_json& ref : refs) {
    const std::string name = ref["template_name"].get<std::string>();
    const std::string source = ref["template"].get<std::string>();
    const bool want_error = ref.value("error", false);
    absl::StatusOr<Template> parsed = Template::Parse(source);
    absl::StatusOr<std::string> out =
        parsed.ok() ? parsed->Render(ref["context"]) : absl::StatusOr<std::string>(parsed.status());
    bool ok = false;
    if (want_error) {
      ok = !out.ok();
      if (!ok) {
        ADD_FAILURE() << name << ": the reference raised (" << ref.value("message", "")
                      << ") but we rendered \"" << absl::CEscape(*out)
                      << "\"\n  context: " << ref["context"].dump();
      }
    } else if (!out.ok()) {
      ADD_FAILURE() << name << ": " << out.status() << "\n  context: " << ref["context"].dump();
    } else {
      const std::string want = ref["output"].get<std::string>();
      ok = *out == want;
      if (!ok) {
        ADD_FAILURE() << name << ":\n  want: \"" << absl::CEscape(want) << "\"\n  got:  \""
                      << absl::CEscape(*out) << "\"\n  context: " << ref["context"].dump();
      }
    }
    (ok ? passed : failed) += 1;
  }
  std::cout << "jinja references: " << passed << " passed, " << failed << " failed of "
            << refs.size() << "\n";
}

}  // namespace
}  // namespace accel::jinja
