// Trackers: JSON lines parse back; TensorBoard event files are read back by
// an independent reader (TFRecord framing, CRC32C computed bit by bit here,
// protobuf varints) and hold what was logged.
#include "train/trackers.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::train {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::testing::HasSubstr;

uint32_t BitwiseCrc32c(const std::string& data) {
  uint32_t crc = 0xFFFFFFFF;
  for (unsigned char byte : data) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78 & (0u - (crc & 1)));
  }
  return ~crc;
}

uint32_t Masked(const std::string& data) {
  const uint32_t crc = BitwiseCrc32c(data);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TEST(Crc32c, StandardCheckValue) { EXPECT_EQ(BitwiseCrc32c("123456789"), 0xE3069283u); }

struct Scalar {
  std::string tag;
  float value = 0;
};
struct Text {
  std::string tag;
  std::string plugin;
  uint64_t dtype = 0;
  std::vector<uint64_t> shape;
  std::string text;
};
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<Scalar> scalars;
  std::vector<Text> texts;
};

uint64_t Varint(const std::string& s, size_t* pos) {
  uint64_t v = 0;
  for (int shift = 0; *pos < s.size(); shift += 7) {
    const auto b = static_cast<uint8_t>(s[(*pos)++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if ((b & 0x80) == 0) break;
  }
  return v;
}

// Field number -> raw payloads of one protobuf message.
std::vector<std::pair<int, std::string>> Fields(const std::string& msg) {
  std::vector<std::pair<int, std::string>> out;
  size_t pos = 0;
  while (pos < msg.size()) {
    const uint64_t key = Varint(msg, &pos);
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    if (wire == 0) {
      size_t start = pos;
      Varint(msg, &pos);
      out.emplace_back(field, msg.substr(start, pos - start));
    } else if (wire == 1) {
      out.emplace_back(field, msg.substr(pos, 8));
      pos += 8;
    } else if (wire == 5) {
      out.emplace_back(field, msg.substr(pos, 4));
      pos += 4;
    } else if (wire == 2) {
      const uint64_t n = Varint(msg, &pos);
      out.emplace_back(field, msg.substr(pos, n));
      pos += n;
    } else {
      ADD_FAILURE() << "wire type " << wire;
      break;
    }
  }
  return out;
}

std::vector<Event> ReadEvents(const std::string& path) {
  const std::string bytes = test::ReadAll(path);
  std::vector<Event> events;
  size_t pos = 0;
  while (pos + 12 <= bytes.size()) {
    const std::string len_bytes = bytes.substr(pos, 8);
    uint64_t len = 0;
    std::memcpy(&len, len_bytes.data(), 8);
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len_crc, bytes.data() + pos + 8, 4);
    EXPECT_EQ(len_crc, Masked(len_bytes));
    const std::string data = bytes.substr(pos + 12, len);
    std::memcpy(&data_crc, bytes.data() + pos + 12 + len, 4);
    EXPECT_EQ(data_crc, Masked(data));
    pos += 12 + len + 4;
    Event e;
    for (const auto& [field, payload] : Fields(data)) {
      if (field == 1) std::memcpy(&e.wall_time, payload.data(), 8);
      if (field == 2) {
        size_t p = 0;
        e.step = static_cast<int64_t>(Varint(payload, &p));
      }
      if (field == 3) e.file_version = payload;
      if (field == 5) {
        for (const auto& [vf, value] : Fields(payload)) {
          if (vf != 1) continue;
          Scalar s;
          Text t;
          bool is_text = false;
          for (const auto& [f, p] : Fields(value)) {
            if (f == 1) s.tag = t.tag = p;
            if (f == 2) std::memcpy(&s.value, p.data(), 4);
            if (f == 9) {  // SummaryMetadata.plugin_data.plugin_name
              for (const auto& [mf, plugin_data] : Fields(p)) {
                for (const auto& [pf, name] : Fields(plugin_data)) {
                  if (mf == 1 && pf == 1) t.plugin = name;
                }
              }
            }
            if (f == 8) {  // TensorProto
              is_text = true;
              for (const auto& [tf, tp] : Fields(p)) {
                size_t q = 0;
                if (tf == 1) t.dtype = Varint(tp, &q);
                if (tf == 8) t.text = tp;
                if (tf != 2) continue;
                for (const auto& [sf, dim] : Fields(tp)) {
                  for (const auto& [df, size] : Fields(dim)) {
                    size_t r = 0;
                    if (sf == 2 && df == 1) t.shape.push_back(Varint(size, &r));
                  }
                }
              }
            }
          }
          if (is_text) {
            e.texts.push_back(t);
          } else {
            e.scalars.push_back(s);
          }
        }
      }
    }
    events.push_back(e);
  }
  EXPECT_EQ(pos, bytes.size()) << "trailing bytes";
  return events;
}

TEST(TensorBoardTracker, EventFileReadsBack) {
  test::TempDir dir;
  auto tracker = MakeTracker("tensorboard", dir.path(), "run1");
  ASSERT_THAT(tracker, IsOk());
  ASSERT_THAT((*tracker)->StoreConfig({{"lr", "0.1"}, {"a|b", "x"}}), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 2.5}, {"lr", 0.125}}, 10), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 1.25}}, 20), IsOk());
  ASSERT_THAT((*tracker)->Finish(), IsOk());
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator(dir.File("run1"))) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) file = e.path();
  }
  ASSERT_FALSE(file.empty());
  std::vector<Event> events = ReadEvents(file);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);
  EXPECT_TRUE(events[0].scalars.empty());
  // The config: a text summary as add_text writes it (plugin "text",
  // DT_STRING = 7, shape [1]).
  ASSERT_EQ(events[1].texts.size(), 1u);
  const Text& text = events[1].texts[0];
  EXPECT_EQ(text.tag, "hparams");
  EXPECT_EQ(text.plugin, "text");
  EXPECT_EQ(text.dtype, 7u);
  EXPECT_THAT(text.shape, ::testing::ElementsAre(1u));
  EXPECT_EQ(text.text, "| name | value |\n|---|---|\n| a\\|b | x |\n| lr | 0.1 |\n");
  EXPECT_EQ(events[2].step, 10);
  ASSERT_EQ(events[2].scalars.size(), 2u);
  EXPECT_EQ(events[2].scalars[0].tag, "loss");
  EXPECT_EQ(events[2].scalars[0].value, 2.5f);
  EXPECT_EQ(events[2].scalars[1].tag, "lr");
  EXPECT_EQ(events[2].scalars[1].value, 0.125f);
  EXPECT_EQ(events[3].step, 20);
  ASSERT_EQ(events[3].scalars.size(), 1u);
  EXPECT_EQ(events[3].scalars[0].value, 1.25f);
  EXPECT_EQ(nlohmann::json::parse(test::ReadAll(dir.File("run1/hparams.json"))),
            nlohmann::json({{"lr", "0.1"}, {"a|b", "x"}}));
  // Finished: further logging is refused, naming the file.
  EXPECT_THAT((*tracker)->Log({{"loss", 1}}, 30),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(file)));
}

// A hand-built record checked byte for byte: Event{wall_time=1.5, step=3,
// summary{value{tag "a", simple_value 2}}}.
TEST(TensorBoardTracker, RecordBytes) {
  test::TempDir dir;
  auto tracker = MakeTensorBoardTracker(dir.path(), "r");
  ASSERT_THAT(tracker, IsOk());
  ASSERT_THAT((*tracker)->Log({{"a", 2.0}}, 300), IsOk());
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator(dir.File("r"))) file = e.path();
  const std::string bytes = test::ReadAll(file);
  const std::vector<Event> events = ReadEvents(file);
  ASSERT_EQ(events.size(), 2u);
  // The second record's data, re-encoded here by hand with its wall time.
  std::string expected;
  expected.push_back(0x09);  // field 1, wire type 1 (64-bit)
  expected.append(reinterpret_cast<const char*>(&events[1].wall_time), 8);
  expected += std::string("\x10\xac\x02", 3);  // field 2, varint 300
  // field 5: Summary{1: Value{1: "a", 2: float 2.0 = 00 00 00 40}}
  expected += std::string(
      "\x2a\x0a\x0a\x08\x0a\x01"
      "a"
      "\x15\x00\x00\x00\x40",
      12);
  EXPECT_EQ(bytes.substr(bytes.size() - 4 - expected.size(), expected.size()), expected);
}

TEST(JsonlTracker, LinesParseBack) {
  test::TempDir dir;
  auto tracker = MakeTracker("jsonl", dir.path(), "run");
  ASSERT_THAT(tracker, IsOk());
  ASSERT_THAT((*tracker)->StoreConfig({{"batch_size", "8"}}), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 0.5}}, 3), IsOk());
  // Flushed per call: the line is on disk before Finish.
  EXPECT_THAT(test::ReadAll(dir.File("run/metrics.jsonl")), HasSubstr("\"loss\":0.5"));
  ASSERT_THAT((*tracker)->Log({{"loss", std::nan("")}, {"acc", 0.75}}, 4), IsOk());
  ASSERT_THAT((*tracker)->Finish(), IsOk());
  const std::string text = test::ReadAll(dir.File("run/metrics.jsonl"));
  EXPECT_EQ(text.back(), '\n');
  std::istringstream lines(text);
  std::string line;
  std::vector<nlohmann::json> parsed;
  while (std::getline(lines, line)) parsed.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(parsed.size(), 3u);
  EXPECT_EQ(parsed[0], nlohmann::json({{"config", {{"batch_size", "8"}}}}));
  EXPECT_EQ(parsed[1]["step"], 3);
  EXPECT_EQ(parsed[1]["loss"], 0.5);
  EXPECT_GT(parsed[1]["time"].get<double>(), 1.6e9);
  EXPECT_EQ(parsed[2]["step"], 4);
  EXPECT_TRUE(parsed[2]["loss"].is_null());
  EXPECT_EQ(parsed[2]["acc"], 0.75);
  // A second tracker on the same run appends.
  auto again = MakeJsonlTracker(dir.path(), "run");
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT((*again)->Log({{"loss", 0.25}}, 5), IsOk());
  EXPECT_THAT(test::ReadAll(dir.File("run/metrics.jsonl")), ::testing::StartsWith(text));
}

TEST(TensorBoardTracker, TwoTrackersTwoFiles) {
  test::TempDir dir;
  auto a = MakeTensorBoardTracker(dir.path(), "run");
  auto b = MakeTensorBoardTracker(dir.path(), "run");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir.File("run"))) {
    files.push_back(e.path());
    EXPECT_EQ(ReadEvents(e.path()).size(), 1u);
  }
  EXPECT_EQ(files.size(), 2u);
}

TEST(Trackers, Errors) {
  test::TempDir dir;
  EXPECT_THAT(MakeTracker("wandb", dir.path(), "r"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jsonl, tensorboard")));
  EXPECT_THAT(MakeTracker("wandb", dir.path(), "r"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"wandb\"")));
  // A file where the run folder's parent should be: the error names the folder.
  const std::string blocker = dir.Write("file", "x");
  for (const char* name : {"jsonl", "tensorboard"}) {
    auto t = MakeTracker(name, blocker, "r");
    ASSERT_FALSE(t.ok()) << name;
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(blocker + "/r")) << name;
  }
  EXPECT_THAT(MakeTracker("jsonl", "", "r"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logging_dir")));
}

}  // namespace
}  // namespace accel::train
