#include "train/trackers.h"

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

#include "core/status.h"
#include "loader/loader.h"

namespace accel::train {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> MakeRunDir(const std::string& logging_dir,
                                       const std::string& run_name) {
  if (logging_dir.empty()) return absl::InvalidArgumentError("tracker: empty logging_dir");
  const fs::path dir = fs::path(logging_dir) / run_name;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("creating tracker folder ", dir.string()));
  return dir.string();
}

// An append-only file flushed after every write.
class AppendFile {
 public:
  static absl::StatusOr<AppendFile> Open(const std::string& path) {
    AppendFile f;
    f.path_ = path;
    f.out_.open(path, std::ios::binary | std::ios::app);
    if (!f.out_) return ErrnoStatus(errno, absl::StrCat("opening ", path));
    return f;
  }
  absl::Status Write(absl::string_view bytes) {
    if (!out_.is_open()) {
      return absl::FailedPreconditionError(absl::StrCat(path_, ": the tracker was finished"));
    }
    out_.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out_.flush();
    if (!out_) return ErrnoStatus(errno, absl::StrCat("writing ", path_));
    return absl::OkStatus();
  }
  void Close() { out_.close(); }

 private:
  std::string path_;
  std::ofstream out_;
};

double Now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class JsonlTracker : public Tracker {
 public:
  explicit JsonlTracker(AppendFile file) : file_(std::move(file)) {}
  const std::string& name() const override { return name_; }
  absl::Status StoreConfig(const std::map<std::string, std::string>& config) override {
    nlohmann::json line = {{"config", config}};
    return file_.Write(line.dump() + "\n");
  }
  absl::Status Log(const std::map<std::string, double>& values, int64_t step) override {
    nlohmann::json line = {{"step", step}, {"time", Now()}};
    for (const auto& [k, v] : values) line[k] = v;
    return file_.Write(line.dump() + "\n");
  }
  absl::Status Finish() override {
    file_.Close();
    return absl::OkStatus();
  }

 private:
  std::string name_ = "jsonl";
  AppendFile file_;
};

// ---- TensorBoard's event file: TFRecord framing around Event protos ----

uint32_t Crc32c(const char* data, size_t n) {
  static const auto kTable = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    crc = kTable[(crc ^ static_cast<uint8_t>(data[i])) & 0xFF] ^ (crc >> 8);
  }
  return crc ^ 0xFFFFFFFFu;
}

uint32_t MaskedCrc(const char* data, size_t n) {
  const uint32_t crc = Crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

void PutVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

template <typename T>
void PutFixed(std::string* out, T v) {
  char bytes[sizeof(T)];
  std::memcpy(bytes, &v, sizeof(T));  // little-endian host
  out->append(bytes, sizeof(T));
}

void PutBytesField(std::string* out, int field, absl::string_view bytes) {
  PutVarint(out, (static_cast<uint64_t>(field) << 3) | 2);
  PutVarint(out, bytes.size());
  out->append(bytes.data(), bytes.size());
}

// Event{wall_time=1 (double), step=2 (int64), file_version=3 | summary=5}.
std::string EventProto(double wall_time, int64_t step, absl::string_view file_version,
                       absl::string_view summary) {
  std::string e;
  PutVarint(&e, (1 << 3) | 1);
  PutFixed<double>(&e, wall_time);
  PutVarint(&e, (2 << 3) | 0);
  PutVarint(&e, static_cast<uint64_t>(step));
  if (!file_version.empty()) PutBytesField(&e, 3, file_version);
  if (!summary.empty()) PutBytesField(&e, 5, summary);
  return e;
}

std::string Record(absl::string_view data) {
  std::string r;
  PutFixed<uint64_t>(&r, data.size());
  PutFixed<uint32_t>(&r, MaskedCrc(r.data(), 8));
  r.append(data.data(), data.size());
  PutFixed<uint32_t>(&r, MaskedCrc(data.data(), data.size()));
  return r;
}

// Summary{value: Value{tag=1, metadata=9: SummaryMetadata{plugin_data=1:
// PluginData{plugin_name=1: "text"}}, tensor=8: TensorProto{dtype=1:
// DT_STRING (7), tensor_shape=2: {dim=2: {size=1: 1}}, string_val=8: text}}},
// what torch.utils.tensorboard's add_text writes.
std::string TextSummary(absl::string_view tag, absl::string_view text) {
  std::string plugin_data, metadata, dim, shape, tensor, value, summary;
  PutBytesField(&plugin_data, 1, "text");
  PutBytesField(&metadata, 1, plugin_data);
  PutVarint(&dim, (1 << 3) | 0);
  PutVarint(&dim, 1);
  PutBytesField(&shape, 2, dim);
  PutVarint(&tensor, (1 << 3) | 0);
  PutVarint(&tensor, 7);
  PutBytesField(&tensor, 2, shape);
  PutBytesField(&tensor, 8, text);
  PutBytesField(&value, 1, tag);
  PutBytesField(&value, 9, metadata);
  PutBytesField(&value, 8, tensor);
  PutBytesField(&summary, 1, value);
  return summary;
}

// | name | value | rows; a '|' inside a cell is escaped so it stays one cell.
std::string ConfigTable(const std::map<std::string, std::string>& config) {
  auto cell = [](const std::string& text) { return absl::StrReplaceAll(text, {{"|", "\\|"}}); };
  std::string table = "| name | value |\n|---|---|\n";
  for (const auto& [k, v] : config) absl::StrAppend(&table, "| ", cell(k), " | ", cell(v), " |\n");
  return table;
}

class TensorBoardTracker : public Tracker {
 public:
  TensorBoardTracker(AppendFile file, std::string dir)
      : file_(std::move(file)), dir_(std::move(dir)) {}
  const std::string& name() const override { return name_; }

  absl::Status Start() { return file_.Write(Record(EventProto(Now(), 0, "brain.Event:2", ""))); }

  // The hparams plugin needs protos of its own (experiment, session start);
  // the config goes in as a text summary instead (tag "hparams", a Markdown
  // table the Text tab shows), and beside the events as hparams.json for
  // tools (Accelerate writes hparams.yml there).
  absl::Status StoreConfig(const std::map<std::string, std::string>& config) override {
    ACCEL_RETURN_IF_ERROR(
        file_.Write(Record(EventProto(Now(), 0, "", TextSummary("hparams", ConfigTable(config))))));
    return loader::WriteFileAtomically(dir_ + "/hparams.json",
                                       nlohmann::json(config).dump(2) + "\n");
  }

  absl::Status Log(const std::map<std::string, double>& values, int64_t step) override {
    std::string summary;
    for (const auto& [tag, value] : values) {
      std::string v;
      PutBytesField(&v, 1, tag);
      PutVarint(&v, (2 << 3) | 5);
      PutFixed<float>(&v, static_cast<float>(value));
      PutBytesField(&summary, 1, v);
    }
    return file_.Write(Record(EventProto(Now(), step, "", summary)));
  }

  absl::Status Finish() override {
    file_.Close();
    return absl::OkStatus();
  }

 private:
  std::string name_ = "tensorboard";
  AppendFile file_;
  std::string dir_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tracker>> MakeJsonlTracker(const std::string& logging_dir,
                                                          const std::string& run_name) {
  ACCEL_ASSIGN_OR_RETURN(std::string dir, MakeRunDir(logging_dir, run_name));
  ACCEL_ASSIGN_OR_RETURN(AppendFile file, AppendFile::Open(dir + "/metrics.jsonl"));
  return std::unique_ptr<Tracker>(std::make_unique<JsonlTracker>(std::move(file)));
}

absl::StatusOr<std::unique_ptr<Tracker>> MakeTensorBoardTracker(const std::string& logging_dir,
                                                                const std::string& run_name) {
  ACCEL_ASSIGN_OR_RETURN(std::string dir, MakeRunDir(logging_dir, run_name));
  char host[256] = "localhost";
  (void)::gethostname(host, sizeof(host) - 1);
  // A process-wide counter ends the name, as torch.utils.tensorboard's, so
  // two trackers opened within one second never share a file.
  static std::atomic<int> counter{0};
  const std::string path = absl::StrCat(dir, "/events.out.tfevents.", static_cast<int64_t>(Now()),
                                        ".", host, ".", ::getpid(), ".", counter++);
  ACCEL_ASSIGN_OR_RETURN(AppendFile file, AppendFile::Open(path));
  auto tracker = std::make_unique<TensorBoardTracker>(std::move(file), dir);
  ACCEL_RETURN_IF_ERROR(tracker->Start());
  return std::unique_ptr<Tracker>(std::move(tracker));
}

absl::StatusOr<std::unique_ptr<Tracker>> MakeTracker(const std::string& name,
                                                     const std::string& logging_dir,
                                                     const std::string& run_name) {
  if (name == "jsonl") return MakeJsonlTracker(logging_dir, run_name);
  if (name == "tensorboard") return MakeTensorBoardTracker(logging_dir, run_name);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown tracker \"", name, "\" (known: jsonl, tensorboard)"));
}

}  // namespace accel::train
