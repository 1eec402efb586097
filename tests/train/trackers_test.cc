// Trackers: JSON lines parse back; TensorBoard event files are read back by
// an independent reader (TFRecord framing, CRC32C computed bit by bit here,
// protobuf varints) and hold what was logged.
#include "train/trackers.h"

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
  float value;
};
struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<Scalar> scalars;
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
          for (const auto& [f, p] : Fields(value)) {
            if (f == 1) s.tag = p;
            if (f == 2) std::memcpy(&s.value, p.data(), 4);
          }
          e.scalars.push_back(s);
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
  ASSERT_THAT((*tracker)->StoreConfig({{"lr", "0.1"}}), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 2.5}, {"lr", 0.125}}, 10), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 1.25}}, 20), IsOk());
  ASSERT_THAT((*tracker)->Finish(), IsOk());
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator(dir.File("run1"))) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) file = e.path();
  }
  ASSERT_FALSE(file.empty());
  std::vector<Event> events = ReadEvents(file);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);
  EXPECT_EQ(events[1].step, 10);
  ASSERT_EQ(events[1].scalars.size(), 2u);
  EXPECT_EQ(events[1].scalars[0].tag, "loss");
  EXPECT_EQ(events[1].scalars[0].value, 2.5f);
  EXPECT_EQ(events[1].scalars[1].tag, "lr");
  EXPECT_EQ(events[1].scalars[1].value, 0.125f);
  EXPECT_EQ(events[2].step, 20);
  EXPECT_EQ(events[2].scalars[0].value, 1.25f);
  EXPECT_THAT(test::ReadAll(dir.File("run1/config.json")), HasSubstr("\"lr\": \"0.1\""));
}

TEST(JsonlTracker, LinesParseBack) {
  test::TempDir dir;
  auto tracker = MakeTracker("jsonl", dir.path(), "run");
  ASSERT_THAT(tracker, IsOk());
  ASSERT_THAT((*tracker)->StoreConfig({{"batch_size", "8"}}), IsOk());
  ASSERT_THAT((*tracker)->Log({{"loss", 0.5}}, 3), IsOk());
  ASSERT_THAT((*tracker)->Finish(), IsOk());
  std::istringstream lines(test::ReadAll(dir.File("run/metrics.jsonl")));
  std::string line;
  std::vector<nlohmann::json> parsed;
  while (std::getline(lines, line)) parsed.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[0]["config"]["batch_size"], "8");
  EXPECT_EQ(parsed[1]["step"], 3);
  EXPECT_EQ(parsed[1]["loss"], 0.5);
}

TEST(Trackers, Errors) {
  test::TempDir dir;
  EXPECT_THAT(MakeTracker("wandb", dir.path(), "r"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("jsonl, tensorboard")));
  const std::string blocker = dir.Write("file", "x");
  EXPECT_FALSE(MakeTracker("jsonl", blocker, "r").ok());
  EXPECT_FALSE(MakeTracker("tensorboard", blocker, "r").ok());
}

}  // namespace
}  // namespace accel::train
