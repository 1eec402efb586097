// Load-and-dispatch: a model split over cpu and disk gives the same outputs
// as the model wholly in RAM; the offload folder; prefetch; every error.
#include "dispatch/dispatch.h"

#include <cctype>
#include <chrono>
#include <cstdint>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <signal.h>
#include <sstream>
#include <string>
#include <sys/resource.h>
#include <thread>
#include <unistd.h>
#include <vector>

#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/grad_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

#include "dispatch/empty_weights.h"
#include "loader/loader.h"
#include "tests/testing/file_size_limit.h"
#include "tests/testing/process_memory.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::dispatch {
namespace {

using ::accel::test::IsOk;
using ::accel::test::MappingHolding;
using ::accel::test::PageCachedBytes;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kLayers = 6;

// Layer i maps width(i) -> width(i + 1); each forward enters its layer's scope.
struct Mlp : torch::nn::Module {
  Mlp() : torch::nn::Module("Mlp") {
    const int widths[kLayers + 1] = {8, 32, 32, 16, 32, 16, 4};
    for (int i = 0; i < kLayers; ++i) {
      layers.emplace_back(
          register_module("l" + std::to_string(i), torch::nn::Linear(widths[i], widths[i + 1])));
    }
  }
  at::Tensor forward(at::Tensor x, DispatchedModel* dispatched = nullptr) {
    for (int i = 0; i < kLayers; ++i) {
      std::optional<DispatchedModel::Scope> scope;
      if (dispatched != nullptr) {
        auto entered = dispatched->Enter("l" + std::to_string(i));
        EXPECT_TRUE(entered.ok()) << entered.status();
        scope.emplace(*std::move(entered));
        x = x.to(scope->device());
      }
      x = layers[i]->forward(x);
      if (i + 1 < kLayers) x = at::relu(x);
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};

// A reference model with seeded weights, saved as a checkpoint in `dtype`;
// the reference keeps exactly the saved values.
std::shared_ptr<Mlp> SaveReference(const std::string& dir, at::ScalarType dtype) {
  at::manual_seed(11);
  auto model = std::make_shared<Mlp>();
  std::vector<loader::NamedTensor> tensors;
  for (const auto& p : model->named_parameters()) {
    at::Tensor stored = p.value().detach().to(dtype);
    p.value().detach().copy_(stored.to(at::kFloat));
    tensors.emplace_back(p.key(), stored);
  }
  loader::CheckpointWriteOptions options;
  options.max_shard_size = 3000;  // several shards
  EXPECT_THAT(loader::WriteCheckpoint(dir, tensors, options), IsOk());
  return model;
}

// The model as the server builds it: no memory for its weights.
std::shared_ptr<Mlp> EmptyMlp() {
  auto model = std::make_shared<Mlp>();
  EXPECT_THAT(EmptyModule(*model), IsOk());
  return model;
}

DeviceMap Split() {
  DeviceMap map;
  const char* where[kLayers] = {"cpu", "disk", "cpu", "disk", "disk", "cpu"};
  for (int i = 0; i < kLayers; ++i) map.Set("l" + std::to_string(i), *Placement::Parse(where[i]));
  return map;
}

LoadOptions Quiet() {
  LoadOptions options;
  options.progress = Progress::Style::kSilent;
  return options;
}

TEST(DispatchTest, SplitOverCpuAndDiskGivesTheSameOutputs) {
  TempDir dir;
  auto reference = SaveReference(dir.path(), at::kFloat);
  at::Tensor x = at::randn({5, 8});
  at::Tensor expected = reference->forward(x);

  auto model = EmptyMlp();
  LoadOptions options = Quiet();
  options.map_disk = false;  // read into buffers each time (the mapping: below)
  options.prefetch_depth = 1;
  auto dispatched = DispatchedModel::Load(model, dir.path(), Split(), options);
  ASSERT_THAT(dispatched, IsOk());
  // Disk layers hold nothing between forwards; cpu layers hold their weights.
  EXPECT_TRUE(model->layers[1]->weight.is_meta());
  EXPECT_FALSE(model->layers[0]->weight.is_meta());
  for (int pass = 0; pass < 3; ++pass) {
    at::Tensor got = model->forward(x, dispatched->get());
    EXPECT_TRUE(at::equal(got, expected)) << "pass " << pass;
    EXPECT_TRUE(model->layers[3]->weight.is_meta());
  }
  DispatchedModel::Stats stats = (*dispatched)->stats();
  EXPECT_EQ(stats.fetches, 9);  // 3 disk layers x 3 passes
  // No dtype conversion: the disk layers are read from the checkpoint itself,
  // once per pass, plus perhaps l1 again: after the last disk layer the
  // reader starts on the first one for the next pass.
  const int64_t per_pass = int64_t{4} * ((32 * 32 + 32) + (16 * 32 + 32) + (32 * 16 + 16));
  EXPECT_GE(stats.bytes_read, 3 * per_pass);
  EXPECT_LE(stats.bytes_read, 3 * per_pass + int64_t{4} * (32 * 32 + 32));
  EXPECT_GT(stats.prefetch_hits, 0);
  EXPECT_EQ(stats.bytes_mapped, 0);
  EXPECT_EQ((*dispatched)->main_device(), at::Device(at::kCPU));
}

TEST(DispatchTest, AWeightKeptPastItsScopeIsNeverOverwritten) {
  TempDir dir;
  auto reference = SaveReference(dir.path(), at::kFloat);
  auto model = EmptyMlp();
  LoadOptions options = Quiet();
  options.prefetch = false;  // a fixed order of buffer reuse
  options.map_disk = false;  // buffers, not the mapping
  auto dispatched = DispatchedModel::Load(model, dir.path(), Split(), options);
  ASSERT_THAT(dispatched, IsOk());
  at::Tensor kept;
  {
    ACCEL_ASSERT_OK_AND_ASSIGN(auto scope, (*dispatched)->Enter("l3"));
    kept = model->layers[3]->weight.detach();  // shares l3's staging buffer
  }
  // l4's weight has the same size as l3's: its reads would take l3's buffer
  // from the pool, were it returned while `kept` still uses it.
  for (int pass = 0; pass < 2; ++pass) model->forward(at::randn({2, 8}), dispatched->get());
  EXPECT_TRUE(at::equal(kept, reference->layers[3]->weight));
}

TEST(DispatchTest, CpuLayersAliasTheCheckpointWithoutACopy) {
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  auto model = EmptyMlp();
  auto dispatched = DispatchedModel::Load(model, dir.path(), Split(), Quiet());
  ASSERT_THAT(dispatched, IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(loader::Checkpoint ckpt, loader::Checkpoint::Open(dir.path()));
  const loader::Checkpoint::Entry* entry = ckpt.Find("l0.weight");
  absl::string_view bytes = ckpt.safetensors_shard(entry->shard)->Bytes(entry->info);
  // Same file bytes: the tensor's data is the page cache, not a copy.
  EXPECT_EQ(0, std::memcmp(model->layers[0]->weight.data_ptr(), bytes.data(), bytes.size()));
}

// --- Disk entries on a cpu execution device: in place from the mapping ----

constexpr int kWideLayers = 8;
constexpr int64_t kWidth = 256;
constexpr int64_t kWideLayerBytes = kWidth * kWidth * 4;  // 256 KiB

// Layers big enough that resident memory is counted in whole pages.
struct Wide : torch::nn::Module {
  explicit Wide(int64_t width = kWidth) : torch::nn::Module("Wide") {
    for (int i = 0; i < kWideLayers; ++i) {
      layers.emplace_back(
          register_module("l" + std::to_string(i),
                          torch::nn::Linear(torch::nn::LinearOptions(width, width).bias(false))));
    }
  }
  at::Tensor forward(at::Tensor x, DispatchedModel* dispatched = nullptr,
                     const std::function<void(int)>& inside = nullptr) {
    for (int i = 0; i < kWideLayers; ++i) {
      std::optional<DispatchedModel::Scope> scope;
      if (dispatched != nullptr) {
        auto entered = dispatched->Enter("l" + std::to_string(i));
        EXPECT_TRUE(entered.ok()) << entered.status();
        scope.emplace(*std::move(entered));
      }
      if (inside) inside(i);
      x = at::tanh(layers[i]->forward(x));
    }
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};

std::shared_ptr<Wide> SaveWide(const std::string& dir, int64_t width = kWidth) {
  at::manual_seed(5);
  auto model = std::make_shared<Wide>(width);
  std::vector<loader::NamedTensor> tensors;
  for (const auto& p : model->named_parameters()) tensors.emplace_back(p.key(), p.value().detach());
  EXPECT_THAT(loader::WriteCheckpoint(dir, tensors, {}), IsOk());
  return model;
}

std::shared_ptr<Wide> EmptyWide(int64_t width = kWidth) {
  auto model = std::make_shared<Wide>(width);
  EXPECT_THAT(EmptyModule(*model), IsOk());
  return model;
}

// l0 in RAM, the other seven on disk.
DeviceMap WideMap() {
  DeviceMap map;
  map.Set("", *Placement::Parse("disk"));
  map.Set("l0", *Placement::Parse("cpu"));
  return map;
}

// One line of /proc/self/maps or a header line of /proc/self/smaps.
struct MapsLine {
  uintptr_t begin = 0, end = 0;
  std::string perms, path;
};
std::optional<MapsLine> ParseMapsLine(const std::string& line) {
  std::istringstream in(line);
  std::string range, offset, dev, inode;
  MapsLine out;
  if (!(in >> range >> out.perms >> offset >> dev >> inode)) return std::nullopt;
  const size_t dash = range.find('-');
  if (dash == std::string::npos || !std::isxdigit(static_cast<unsigned char>(range[0]))) {
    return std::nullopt;
  }
  out.begin = std::stoull(range.substr(0, dash), nullptr, 16);
  out.end = std::stoull(range.substr(dash + 1), nullptr, 16);
  std::getline(in >> std::ws, out.path);
  return out;
}

// The mapping of the process that holds `address`.
std::optional<MapsLine> MappingOf(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  for (std::string line; std::getline(maps, line);) {
    std::optional<MapsLine> m = ParseMapsLine(line);
    if (m && m->begin <= at && at < m->end) return m;
  }
  return std::nullopt;
}

// Bytes of the files under `dir` that the process holds through read-only
// shared mappings (the dispatch core's; the loader's own mapping is private),
// from /proc/self/smaps.
int64_t MappedResidentBytes(const std::string& dir) {
  const std::string root = std::filesystem::canonical(dir).string() + "/";
  std::ifstream smaps("/proc/self/smaps");
  bool counting = false;
  int64_t total = 0;
  for (std::string line; std::getline(smaps, line);) {
    if (std::optional<MapsLine> m = ParseMapsLine(line)) {
      counting = m->perms == "r--s" && absl::StartsWith(m->path, root);
    } else if (counting && absl::StartsWith(line, "Rss:")) {
      total += std::stoll(line.substr(4)) * 1024;
    }
  }
  return total;
}

TEST(DispatchMappedTest, DiskLayersRunInPlaceFromTheirFileWithoutACopy) {
  TempDir dir;
  auto reference = SaveWide(dir.path());
  at::Tensor x = at::randn({3, kWidth});
  at::Tensor expected = reference->forward(x);
  auto model = EmptyWide();
  auto dispatched = DispatchedModel::Load(model, dir.path(), WideMap(), Quiet());
  ASSERT_THAT(dispatched, IsOk());
  std::vector<std::string> where(kWideLayers);
  const auto look = [&](int i) {
    std::optional<MapsLine> m = MappingOf(model->layers[i]->weight.data_ptr());
    where[i] = m ? m->perms + " " + m->path : "unmapped";
  };
  for (int pass = 0; pass < 3; ++pass) {
    EXPECT_TRUE(at::equal(model->forward(x, dispatched->get(), look), expected)) << pass;
    EXPECT_TRUE(model->layers[1]->weight.is_meta());
  }
  // Inside its scope a disk layer's weight is the file's own bytes, mapped
  // read-only: no buffer, no copy. l0 aliases the loader's private mapping.
  const std::string file = std::filesystem::canonical(dir.path() + "/model.safetensors").string();
  for (int i = 1; i < kWideLayers; ++i) EXPECT_EQ(where[i], "r--s " + file) << "l" << i;
  EXPECT_EQ(where[0], "rw-p " + file);
  const DispatchedModel::Stats stats = (*dispatched)->stats();
  EXPECT_EQ(stats.fetches, 3 * (kWideLayers - 1));
  EXPECT_EQ(stats.bytes_read, 0);
  EXPECT_EQ(stats.bytes_mapped, int64_t{3} * (kWideLayers - 1) * kWideLayerBytes);
  EXPECT_GT(stats.prefetch_hits, 0);
}

TEST(DispatchMappedTest, DirectReadsOrMapDiskOffReadIntoBuffersWithTheSameOutputs) {
  TempDir dir;
  auto reference = SaveWide(dir.path());
  at::Tensor x = at::randn({2, kWidth});
  at::Tensor expected = reference->forward(x);
  for (bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "direct_reads" : "map_disk off");
    auto model = EmptyWide();
    LoadOptions options = Quiet();
    options.direct_reads = direct;
    options.map_disk = direct;  // direct reads win over the mapping
    auto dispatched = DispatchedModel::Load(model, dir.path(), WideMap(), options);
    ASSERT_THAT(dispatched, IsOk());
    EXPECT_TRUE(at::equal(model->forward(x, dispatched->get()), expected));
    const DispatchedModel::Stats stats = (*dispatched)->stats();
    EXPECT_EQ(stats.bytes_mapped, 0);
    EXPECT_GE(stats.bytes_read, (kWideLayers - 1) * kWideLayerBytes);
    EXPECT_EQ(MappedResidentBytes(dir.path()), 0);
  }
}

TEST(DispatchMappedTest, PopulatedResidentWeightsAreLockedInPlaceNotCopied) {
  TempDir dir;
  auto reference = SaveWide(dir.path());
  at::Tensor x = at::randn({2, kWidth});
  at::Tensor expected = reference->forward(x);
  auto model = EmptyWide();
  LoadOptions options = Quiet();
  options.populate_resident = true;
  auto dispatched = DispatchedModel::Load(model, dir.path(), WideMap(), options);
  ASSERT_THAT(dispatched, IsOk());
  const void* l0 = model->layers[0]->weight.data_ptr();
  // The populator runs on a thread of its own: wait for it to map l0 and,
  // where the process may lock this much memory, lock it.
  struct rlimit memlock {};
  const bool may_lock = ::getrlimit(RLIMIT_MEMLOCK, &memlock) == 0 &&
                        (memlock.rlim_cur == RLIM_INFINITY || memlock.rlim_cur >= (4u << 20));
  const auto done = [&] {
    const test::Mapping m = MappingHolding(l0);
    return m.rss >= kWideLayerBytes && (!may_lock || m.locked >= kWideLayerBytes);
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GE(MappingHolding(l0).rss, kWideLayerBytes);
  if (may_lock) {
    EXPECT_GE(MappingHolding(l0).locked, kWideLayerBytes);
  }
  // The loader's mapping is private and writable: locking it with a plain
  // mlock() faults it in for writing, one anonymous copy of every page.
  EXPECT_EQ(MappingHolding(l0).anonymous, 0);
  EXPECT_TRUE(at::equal(model->forward(x, dispatched->get()), expected));
  EXPECT_EQ(MappingHolding(l0).anonymous, 0);
}

TEST(DispatchMappedTest, ResidentMappedWeightsStayWithinTheAllowancePlusTheWindow) {
  TempDir dir;
  auto reference = SaveWide(dir.path());
  at::Tensor x = at::randn({1, kWidth});
  at::Tensor expected = reference->forward(x);
  constexpr int64_t kDiskBytes = (kWideLayers - 1) * kWideLayerBytes;
  // Fault-around can map up to 64 KiB past a touched page at each end.
  constexpr int64_t kSlack = 128 << 10;
  struct Case {
    int64_t allowance;  // mapped_resident_bytes
    int depth;          // prefetch_depth: the window ahead
  };
  for (const Case c : {Case{0, 1}, Case{0, 3}, Case{3 * kWideLayerBytes, 1}, Case{-1, 2}}) {
    SCOPED_TRACE(::testing::Message() << "allowance " << c.allowance << ", depth " << c.depth);
    auto model = EmptyWide();
    LoadOptions options = Quiet();
    options.mapped_resident_bytes = c.allowance;
    options.prefetch_depth = c.depth;
    auto dispatched = DispatchedModel::Load(model, dir.path(), WideMap(), options);
    ASSERT_THAT(dispatched, IsOk());
    const int64_t window = c.depth * kWideLayerBytes;
    const int64_t kept = c.allowance < 0 ? kDiskBytes : c.allowance;
    int64_t most = 0;
    const auto measure = [&](int) { most = std::max(most, MappedResidentBytes(dir.path())); };
    for (int pass = 0; pass < 4; ++pass) {
      EXPECT_TRUE(at::equal(model->forward(x, dispatched->get(), measure), expected)) << pass;
    }
    // The running layer, the window ahead, and what the allowance keeps.
    EXPECT_LE(most, std::min(kDiskBytes, kept + window + kWideLayerBytes) + kSlack);
    const DispatchedModel::Stats stats = (*dispatched)->stats();
    if (c.allowance < 0) {
      EXPECT_EQ(stats.bytes_dropped, 0);
      EXPECT_GE(MappedResidentBytes(dir.path()), kDiskBytes);  // all of it, kept
    } else {
      EXPECT_GT(stats.bytes_dropped, 0);
      EXPECT_GE(most, kWideLayerBytes);  // the running layer at least
    }
  }
}

TEST(DispatchMappedTest, PageCacheKeepsTheLastDiskLayersThatFitAndEvictsTheRest) {
  // Layers of 9 MiB: the page cache holds a file in folios of up to 2 MiB,
  // and a folio that a neighbour's mapping holds (l0's, aliasing the loader's
  // mapping, or the next layer read ahead) cannot be evicted, so up to 2 MiB
  // at each end of an evicted layer may stay.
  constexpr int64_t kBigWidth = 1536;
  constexpr int64_t kLayerBytes = kBigWidth * kBigWidth * 4;
  TempDir dir;
  auto reference = SaveWide(dir.path(), kBigWidth);
  // Each case starts as a model larger than memory does: not in the page
  // cache (written pages are first made clean: dirty ones cannot be evicted).
  const auto drop_page_cache = [&] {
    const int fd = ::open((dir.path() + "/model.safetensors").c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fsync(fd);
    (void)::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  at::Tensor x = at::randn({1, kBigWidth});
  at::Tensor expected = reference->forward(x);
  for (const int64_t keep : {int64_t{-1}, 4 * kLayerBytes, int64_t{0}}) {
    SCOPED_TRACE(::testing::Message() << "page_cache_keep_bytes " << keep);
    drop_page_cache();
    auto model = EmptyWide(kBigWidth);
    LoadOptions options = Quiet();
    options.mapped_resident_bytes = 0;  // each disk layer leaves the process after use
    options.page_cache_keep_bytes = keep;
    auto dispatched = DispatchedModel::Load(model, dir.path(), WideMap(), options);
    ASSERT_THAT(dispatched, IsOk());
    std::vector<const void*> weights(kWideLayers);
    const auto look = [&](int i) { weights[i] = model->layers[i]->weight.data_ptr(); };
    for (int pass = 0; pass < 2; ++pass) {
      EXPECT_TRUE(at::equal(model->forward(x, dispatched->get(), look), expected)) << pass;
      if (pass == 0) {
        // Before the order is known nothing is evicted: the layers the choice
        // will keep, read last, need no second read.
        for (int i = 1; i < kWideLayers; ++i) {
          EXPECT_GE(PageCachedBytes(weights[i], kLayerBytes), kLayerBytes) << "pass 0, l" << i;
        }
      }
    }
    // l1, l2, ... run in that order (l0 is in RAM); the first pass tells the
    // order, and from the second on the last layers that fit stay: l4..l7.
    for (int i = 1; i < kWideLayers; ++i) {
      const int64_t cached = PageCachedBytes(weights[i], kLayerBytes);
      if (keep < 0 || i >= kWideLayers - keep / kLayerBytes) {
        EXPECT_GE(cached, kLayerBytes) << "l" << i;
      } else if (i > options.prefetch_depth) {
        // Evicted, but for the folios shared with a neighbour at its ends.
        // (The first layers may be in again: the reader reads the next
        // forward's first layers during the last ones of this one.)
        EXPECT_LT(cached, kLayerBytes / 2) << "l" << i;
      }
    }
  }
}

TEST(DispatchTest, ConvertedDiskTensorsGoToAnOffloadFolderInAccelerateFormat) {
  TempDir dir;
  auto reference = SaveReference(dir.path() + "/ckpt", at::kBFloat16);
  at::Tensor x = at::randn({3, 8});
  at::Tensor expected = reference->forward(x);

  auto model = EmptyMlp();
  LoadOptions options = Quiet();
  options.dtype = at::kFloat;  // bf16 on disk, float32 to compute: a conversion
  options.offload_folder = dir.path() + "/offload";
  auto dispatched = DispatchedModel::Load(model, dir.path() + "/ckpt", Split(), options);
  ASSERT_THAT(dispatched, IsOk());
  EXPECT_TRUE(at::equal(model->forward(x, dispatched->get()), expected));

  nlohmann::json index = nlohmann::json::parse(test::ReadAll(dir.path() + "/offload/index.json"));
  EXPECT_EQ(index["l1.weight"]["dtype"], "float32");
  EXPECT_EQ(index["l1.weight"]["shape"], nlohmann::json::parse("[32, 32]"));
  EXPECT_EQ(index.size(), 6u);  // weight and bias of l1, l3, l4
  std::string dat = test::ReadAll(dir.path() + "/offload/l1.weight.dat");
  ASSERT_EQ(dat.size(), 32u * 32u * 4u);
  EXPECT_EQ(0, std::memcmp(dat.data(), reference->layers[1]->weight.data_ptr(), dat.size()));
  EXPECT_EQ(model->layers[0]->weight.scalar_type(), at::kFloat);
}

TEST(DispatchTest, ConversionToDiskWithoutAFolderNamesTheTensor) {
  TempDir dir;
  SaveReference(dir.path(), at::kBFloat16);
  LoadOptions options = Quiet();
  options.dtype = at::kFloat;
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path(), Split(), options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("tensor 'l1."), HasSubstr("offload folder"))));
}

TEST(DispatchTest, UnwritableOffloadFolderNamesThePathAndLeavesNoTemporary) {
  TempDir dir;
  SaveReference(dir.path() + "/ckpt", at::kBFloat16);
  dir.Write("blocker", "a file, not a folder");
  LoadOptions options = Quiet();
  options.dtype = at::kFloat;
  options.offload_folder = dir.File("blocker");
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path() + "/ckpt", Split(), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("blocker")));
  std::filesystem::create_directories(dir.path() + "/ro");
  std::filesystem::permissions(
      dir.path() + "/ro", std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  options.offload_folder = dir.path() + "/ro";
  auto result = DispatchedModel::Load(EmptyMlp(), dir.path() + "/ckpt", Split(), options);
  if (::geteuid() != 0) {  // root writes anywhere
    EXPECT_THAT(result, StatusIs(absl::StatusCode::kPermissionDenied,
                                 AllOf(HasSubstr("ro"), HasSubstr("'l1."))));
  }
  std::filesystem::permissions(dir.path() + "/ro", std::filesystem::perms::owner_all);
  for (const auto& e : std::filesystem::directory_iterator(dir.path() + "/ro")) {
    EXPECT_THAT(e.path().string(), ::testing::Not(HasSubstr(".tmp.")));
  }
}

TEST(DispatchTest, AFullDiskWhileOffloadingNamesTheTensorAndLeavesNoTemporary) {
  TempDir dir;
  SaveReference(dir.path() + "/ckpt", at::kBFloat16);
  LoadOptions options = Quiet();
  options.dtype = at::kFloat;
  options.offload_folder = dir.path() + "/offload";
  // A full disk, simulated by a file-size limit below the first .dat file.
  absl::StatusOr<std::unique_ptr<DispatchedModel>> result = absl::UnknownError("not run");
  {
    test::FileSizeLimit full_disk(100);
    ASSERT_TRUE(full_disk.ok());
    result = DispatchedModel::Load(EmptyMlp(), dir.path() + "/ckpt", Split(), options);
  }
  EXPECT_THAT(result,
              StatusIs(absl::StatusCode::kResourceExhausted,
                       AllOf(HasSubstr("offloading tensor 'l1."), HasSubstr("offload/l1."))));
  // The folder this load made is gone with everything it wrote.
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/offload"));
}

// A load that fails after writing converted tensors to the offload folder
// takes them away again: a folder it made is removed, and one an earlier
// load filled keeps that load's files and index exactly.
TEST(DispatchTest, AFailedLoadLeavesTheOffloadFolderAsItFoundIt) {
  TempDir dir;
  auto reference = SaveReference(dir.path() + "/ckpt", at::kBFloat16);
  // The same checkpoint without l5.bias: it fails once every tensor is placed.
  std::vector<loader::NamedTensor> lacking;
  for (const auto& p : reference->named_parameters()) {
    if (p.key() != "l5.bias") lacking.emplace_back(p.key(), p.value().detach().to(at::kBFloat16));
  }
  ASSERT_THAT(loader::WriteCheckpoint(dir.path() + "/lacking", lacking), IsOk());
  LoadOptions options = Quiet();
  options.dtype = at::kFloat;
  options.offload_folder = dir.path() + "/offload";
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path() + "/lacking", Split(), options),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("l5.bias")));
  EXPECT_FALSE(std::filesystem::exists(options.offload_folder));

  // A folder a successful load filled, plus a file of someone else's.
  auto first = DispatchedModel::Load(EmptyMlp(), dir.path() + "/ckpt", Split(), options);
  ASSERT_THAT(first, IsOk());
  dir.Write("offload/notes.txt", "mine");
  std::map<std::string, std::string> before;
  for (const auto& e : std::filesystem::directory_iterator(options.offload_folder)) {
    before[e.path().filename()] = test::ReadAll(e.path());
  }
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path() + "/lacking", Split(), options),
              StatusIs(absl::StatusCode::kNotFound));
  std::map<std::string, std::string> after;
  for (const auto& e : std::filesystem::directory_iterator(options.offload_folder)) {
    after[e.path().filename()] = test::ReadAll(e.path());
  }
  EXPECT_EQ(after, before);
  EXPECT_EQ(before.count("index.json"), 1u);
}

TEST(DispatchTest, AnUnconvertibleDtypeNamesTheTensor) {
  TempDir dir;
  struct WithCounter : torch::nn::Module {
    WithCounter() { register_buffer("steps", at::zeros({1}, at::kLong)); }
  };
  ASSERT_THAT(loader::WriteCheckpoint(dir.path(), {{"steps", at::ones({1}) * 0.5}}), IsOk());
  DeviceMap all;
  all.Set("", Placement::Cpu());
  EXPECT_THAT(DispatchedModel::Load(std::make_shared<WithCounter>(), dir.path(), all, Quiet()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'steps'"), HasSubstr("cannot convert F32 to int64"))));
}

TEST(DispatchTest, AMapThatMissesATensorNamesIt) {
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  DeviceMap partial;
  partial.Set("l0", Placement::Cpu());
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path(), partial, Quiet()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no module that holds it")));
}

TEST(DispatchTest, ShapeMismatchAndMissingTensorsAreNamed) {
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  DeviceMap all;
  all.Set("", Placement::Cpu());
  // A model with a wider first layer.
  struct Wider : Mlp {
    Wider() { layers[0] = replace_module("l0", torch::nn::Linear(9, 32)); }
  };
  auto wider = std::make_shared<Wider>();
  EXPECT_THAT(DispatchedModel::Load(wider, dir.path(), all, Quiet()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("'l0.weight'"), HasSubstr("[32, 8]"))));

  // A checkpoint without l5: its parameters are missing.
  TempDir partial;
  std::vector<loader::NamedTensor> tensors;
  for (const auto& p : Mlp().named_parameters()) {
    if (p.key().rfind("l5.", 0) != 0) tensors.emplace_back(p.key(), p.value().detach());
  }
  ASSERT_THAT(loader::WriteCheckpoint(partial.path(), tensors), IsOk());
  EXPECT_THAT(
      DispatchedModel::Load(EmptyMlp(), partial.path(), all, Quiet()),
      StatusIs(absl::StatusCode::kNotFound, AllOf(HasSubstr("l5.weight"), HasSubstr("l5.bias"))));
}

TEST(DispatchTest, UnexpectedTensorsAreListedOrRefusedWhenStrict) {
  TempDir dir;
  std::vector<loader::NamedTensor> tensors;
  for (const auto& p : Mlp().named_parameters()) tensors.emplace_back(p.key(), p.value().detach());
  tensors.emplace_back("foo", at::ones({2}));
  ASSERT_THAT(loader::WriteCheckpoint(dir.path(), tensors), IsOk());
  DeviceMap all;
  all.Set("", Placement::Cpu());
  auto loose = DispatchedModel::Load(EmptyMlp(), dir.path(), all, Quiet());
  ASSERT_THAT(loose, IsOk());
  EXPECT_THAT((*loose)->unexpected(), ::testing::ElementsAre("foo"));
  LoadOptions strict = Quiet();
  strict.strict = true;
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path(), all, strict),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("foo")));
}

// Two modules sharing one weight, as a tied embedding and head do.
struct TiedPair : torch::nn::Module {
  struct Holder : torch::nn::Module {
    explicit Holder(const at::Tensor& w) { weight = register_parameter("weight", w); }
    at::Tensor weight;
  };
  TiedPair() {
    at::Tensor shared = NewParameter({4, 4}, at::kFloat);
    first = register_module("first", std::make_shared<Holder>(shared));
    second = register_module("second", std::make_shared<Holder>(shared));
  }
  std::shared_ptr<Holder> first, second;
};

TEST(DispatchTest, TiedWeightsStayTiedWhenOffloaded) {
  TempDir dir;
  ASSERT_THAT(loader::WriteCheckpoint(
                  dir.path(), {{"first.weight", at::arange(16, at::kFloat).reshape({4, 4})}}),
              IsOk());
  std::shared_ptr<TiedPair> model;
  {
    EmptyWeightsGuard empty;
    model = std::make_shared<TiedPair>();
  }
  DeviceMap map;
  map.Set("first", Placement::Disk());
  map.Set("second", Placement::Disk());
  auto dispatched = DispatchedModel::Load(model, dir.path(), map, Quiet());
  ASSERT_THAT(dispatched, IsOk());
  EXPECT_TRUE(model->second->weight.is_meta());
  {
    // Entering the module that holds the alias brings the shared tensor in.
    ACCEL_ASSERT_OK_AND_ASSIGN(auto scope, (*dispatched)->Enter("second"));
    EXPECT_EQ(model->second->weight.sum().item<float>(), 120.0f);
    EXPECT_EQ(model->first->weight.data_ptr(), model->second->weight.data_ptr());
  }
  EXPECT_TRUE(model->first->weight.is_meta());
}

TEST(DispatchTest, ResidentModulesNeedNoScopeWork) {
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  DeviceMap all;
  all.Set("", Placement::Cpu());
  auto model = EmptyMlp();
  auto dispatched = DispatchedModel::Load(model, dir.path(), all, Quiet());
  ASSERT_THAT(dispatched, IsOk());
  ACCEL_ASSERT_OK_AND_ASSIGN(auto scope, (*dispatched)->Enter("l2"));
  EXPECT_EQ(scope.device(), at::Device(at::kCPU));
  EXPECT_EQ((*dispatched)->stats().fetches, 0);
}

// A LoadHook that claims "l<i>.weight" tensors and hands back `make(value)`.
class TestHook : public LoadHook {
 public:
  using Make = std::function<std::vector<HookTensor>(const std::string&, const at::Tensor&)>;
  explicit TestHook(Make make, absl::Status finish = absl::OkStatus())
      : make_(std::move(make)), finish_(std::move(finish)) {}
  bool Claims(absl::string_view name) const override { return absl::EndsWith(name, ".weight"); }
  absl::StatusOr<std::vector<HookTensor>> Convert(const std::string& name,
                                                  const at::Tensor& stored) override {
    claimed.push_back(name);
    return make_(name, stored);
  }
  absl::Status Finish() override { return finish_; }
  std::vector<std::string> claimed;

 private:
  Make make_;
  absl::Status finish_;
};

TEST(DispatchHookTest, HookTensorsArePlacedLikeCheckpointTensorsOnCpuAndDisk) {
  TempDir dir, offload;
  auto reference = SaveReference(dir.path(), at::kFloat);
  const at::Tensor x = at::randn({3, 8});
  // The hook doubles every weight; halving the reference's gives the same outputs.
  TestHook hook([](const std::string& name, const at::Tensor& w) {
    return std::vector<HookTensor>{{name, w * 2}};
  });
  LoadOptions options = Quiet();
  options.hook = &hook;
  options.offload_folder = offload.path();  // hook tensors on disk are written there
  auto model = EmptyMlp();
  ACCEL_ASSERT_OK_AND_ASSIGN(auto dispatched,
                             DispatchedModel::Load(model, dir.path(), Split(), options));
  EXPECT_EQ(hook.claimed.size(), static_cast<size_t>(kLayers));
  {
    at::NoGradGuard no_grad;
    for (auto& layer : reference->layers) layer->weight.mul_(2);
  }
  EXPECT_TRUE(at::allclose(model->forward(x, dispatched.get()), reference->forward(x)));
  EXPECT_TRUE(std::filesystem::exists(offload.File("l1.weight.dat")));

  // Without an offload folder, a made tensor mapped to disk has nowhere to go.
  LoadOptions no_folder = Quiet();
  no_folder.hook = &hook;
  EXPECT_THAT(DispatchedModel::Load(EmptyMlp(), dir.path(), Split(), no_folder),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("l1.weight"), HasSubstr("made on loading"))));
}

TEST(DispatchHookTest, BadHookTensorsAndHookErrorsNameTheTensor) {
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  DeviceMap cpu;
  cpu.Set("", *Placement::Parse("cpu"));
  const auto load = [&](TestHook& hook) {
    LoadOptions options = Quiet();
    options.hook = &hook;
    return DispatchedModel::Load(EmptyMlp(), dir.path(), cpu, options).status();
  };
  TestHook unknown([](const std::string& name, const at::Tensor& w) {
    return std::vector<HookTensor>{{name + "_extra", w}};
  });
  EXPECT_THAT(load(unknown), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("made on loading, but the model has no such")));
  TestHook wrong_dtype([](const std::string& name, const at::Tensor& w) {
    return std::vector<HookTensor>{{name, w.to(at::kDouble)}};
  });
  EXPECT_THAT(load(wrong_dtype),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("loading made float64"), HasSubstr("expects float32"))));
  TestHook wrong_shape([](const std::string& name, const at::Tensor& w) {
    return std::vector<HookTensor>{{name, w.reshape({-1})}};
  });
  EXPECT_THAT(load(wrong_shape),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("loading made shape")));
  // Tensors the hook keeps (returns none for) are missing parameters.
  TestHook keeps([](const std::string&, const at::Tensor&) { return std::vector<HookTensor>{}; });
  EXPECT_THAT(load(keeps), StatusIs(absl::StatusCode::kNotFound, HasSubstr("l0.weight")));
  TestHook unfinished(
      [](const std::string& name, const at::Tensor& w) {
        return std::vector<HookTensor>{{name, w}};
      },
      absl::NotFoundError("the checkpoint lacks 'x.quant_state'"));
  EXPECT_THAT(load(unfinished), StatusIs(absl::StatusCode::kNotFound, HasSubstr("x.quant_state")));
}

// --- A GPU main device: cpu and disk entries come in over the copy stream ----

DeviceMap GpuSplit() {
  DeviceMap map;
  const char* where[kLayers] = {"0", "disk", "cpu", "disk", "cpu", "0"};
  for (int i = 0; i < kLayers; ++i) map.Set("l" + std::to_string(i), *Placement::Parse(where[i]));
  return map;
}

TEST(DispatchGpuTest, WithoutCudaAGpuMapIsAnErrorNotACrash) {
  if (at::hasCUDA()) GTEST_SKIP() << "this libtorch has CUDA and a device";
  TempDir dir;
  SaveReference(dir.path(), at::kFloat);
  auto result = DispatchedModel::Load(EmptyMlp(), dir.path(), GpuSplit(), Quiet());
  ASSERT_FALSE(result.ok());
  EXPECT_THAT(result.status().message(), HasSubstr("l0."));
}

TEST(DispatchGpuTest, SplitOverGpuCpuAndDiskGivesTheSameOutputs) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device (at::hasCUDA)";
  const at::Device gpu(at::kCUDA, 0);
  TempDir dir;
  auto reference = SaveReference(dir.path(), at::kFloat);
  reference->to(gpu);
  at::Tensor x = at::randn({5, 8}).to(gpu);
  at::Tensor expected = reference->forward(x);
  // l1..l4 (32->32, 32->16, 16->32, 32->16) cross the bus each pass.
  const int64_t per_pass =
      int64_t{4} * ((32 * 32 + 32) + (16 * 32 + 16) + (32 * 16 + 32) + (16 * 32 + 16));
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "prefetch" : "no prefetch");
    auto model = EmptyMlp();
    LoadOptions options = Quiet();
    options.prefetch = prefetch;
    auto dispatched = DispatchedModel::Load(model, dir.path(), GpuSplit(), options);
    ASSERT_THAT(dispatched, IsOk());
    EXPECT_EQ((*dispatched)->main_device(), gpu);
    EXPECT_EQ(model->layers[0]->weight.device(), gpu);
    EXPECT_TRUE(model->layers[1]->weight.is_meta());
    EXPECT_TRUE(model->layers[2]->weight.is_meta());  // cpu entries too, between forwards
    {
      ACCEL_ASSERT_OK_AND_ASSIGN(auto scope, (*dispatched)->Enter("l2"));
      EXPECT_EQ(scope.device(), gpu);
      EXPECT_EQ(model->layers[2]->weight.device(), gpu);
    }
    EXPECT_TRUE(model->layers[2]->weight.is_meta());
    for (int pass = 0; pass < 3; ++pass) {
      EXPECT_TRUE(at::equal(model->forward(x, dispatched->get()), expected)) << "pass " << pass;
    }
    DispatchedModel::Stats stats = (*dispatched)->stats();
    EXPECT_EQ(stats.fetches, 1 + 4 * 3);
    EXPECT_GE(stats.bytes_to_device, 3 * per_pass);
    if (prefetch) {
      EXPECT_GT(stats.prefetch_hits, 0);
    } else {
      EXPECT_EQ(stats.prefetch_hits, 0);
    }
  }
}

}  // namespace
}  // namespace accel::dispatch
