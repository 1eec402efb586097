#include "train/data.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <set>
#include <utility>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "core/status.h"
#include "train/operations.h"

namespace accel::train {

// ---- Index-level building blocks ----

std::vector<int64_t> RandomPermutation(int64_t n, uint64_t seed) {
  at::Tensor perm = at::randperm(n, at::make_generator<at::CPUGeneratorImpl>(seed),
                                 at::TensorOptions().dtype(at::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}

std::vector<IndexBatch> MakeBatches(const std::vector<int64_t>& order, int64_t batch_size,
                                    bool drop_last) {
  std::vector<IndexBatch> batches;
  if (batch_size < 1) return batches;
  for (size_t i = 0; i < order.size(); i += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(order.size(), i + static_cast<size_t>(batch_size));
    if (drop_last && end - i < static_cast<size_t>(batch_size)) break;
    batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(i),
                         order.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return batches;
}

namespace {

absl::Status CheckShard(const ShardOptions& o) {
  if (o.num_processes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_processes must be at least 1, got ", o.num_processes));
  }
  if (o.process_index < 0 || o.process_index >= o.num_processes) {
    return absl::InvalidArgumentError(
        absl::StrCat("process_index ", o.process_index, " is outside [0, ", o.num_processes, ")"));
  }
  return absl::OkStatus();
}

// Python's list[a:b] on a batch (clipped to its length).
IndexBatch Slice(const IndexBatch& batch, int64_t begin, int64_t end) {
  const auto n = static_cast<int64_t>(batch.size());
  begin = std::min(begin, n);
  end = std::min(end, n);
  if (end <= begin) return {};
  return IndexBatch(batch.begin() + begin, batch.begin() + end);
}

std::vector<IndexBatch> ShardSplit(const std::vector<IndexBatch>& batches, int64_t batch_size,
                                   bool drop_last, const ShardOptions& o) {
  std::vector<IndexBatch> out;
  const int64_t per = batch_size / o.num_processes;
  const int64_t begin = per * o.process_index, end = per * (o.process_index + 1);
  IndexBatch initial;
  for (size_t idx = 0; idx < batches.size(); ++idx) {
    if (idx == 0) initial = batches[idx];
    if (static_cast<int64_t>(batches[idx].size()) == batch_size) {
      out.push_back(Slice(batches[idx], begin, end));
    }
  }
  if (batches.empty()) return out;
  IndexBatch last = batches.back();
  if (!drop_last && !initial.empty() && static_cast<int64_t>(last.size()) < batch_size) {
    if (!o.even_batches) {
      if (static_cast<int64_t>(last.size()) > begin) out.push_back(Slice(last, begin, end));
    } else {
      while (static_cast<int64_t>(initial.size()) < batch_size) {
        IndexBatch twice = initial;
        twice.insert(twice.end(), initial.begin(), initial.end());
        initial = std::move(twice);
      }
      last.insert(last.end(), initial.begin(), initial.end());
      out.push_back(Slice(last, begin, end));
    }
  }
  return out;
}

std::vector<IndexBatch> ShardNoSplit(const std::vector<IndexBatch>& batches,
                                     std::optional<int64_t> batch_size, bool drop_last,
                                     const ShardOptions& o) {
  const int64_t p = o.num_processes, r = o.process_index;
  const bool dynamic = !batch_size.has_value();
  auto full = [&](const IndexBatch& b) {
    return dynamic || static_cast<int64_t>(b.size()) == *batch_size;
  };
  std::vector<IndexBatch> out;
  std::vector<IndexBatch> initial;  // the first P batches (only without drop_last)
  IndexBatch to_yield;
  int64_t idx = 0;
  IndexBatch batch;
  for (const IndexBatch& b : batches) {
    batch = b;
    if (!drop_last && idx < p) initial.push_back(b);
    if (idx % p == r) to_yield = b;
    if (idx % p == p - 1 && full(b)) {
      out.push_back(to_yield);
      to_yield.clear();
    }
    ++idx;
  }
  if (batches.empty() || drop_last || initial.empty()) return out;
  --idx;  // Python's loop variable: the index of the last batch
  if (!o.even_batches) {
    if (!to_yield.empty()) out.push_back(to_yield);
    return out;
  }
  if (!to_yield.empty() && full(to_yield)) out.push_back(to_yield);
  if (dynamic) {
    // Whole batches are cycled: at least P of them.
    std::vector<IndexBatch> pool = initial;
    while (static_cast<int64_t>(pool.size()) < p) {
      std::vector<IndexBatch> twice = pool;
      twice.insert(twice.end(), pool.begin(), pool.end());
      pool = std::move(twice);
    }
    ++idx;  // the last batch was "full" and has been yielded by its rank
    size_t cycle = 0;
    while (idx % p != 0) {
      if (idx % p == r) out.push_back(pool[cycle]);
      ++cycle;
      ++idx;
    }
    return out;
  }
  const int64_t bs = *batch_size;
  IndexBatch flat;
  for (const IndexBatch& b : initial) flat.insert(flat.end(), b.begin(), b.end());
  while (static_cast<int64_t>(flat.size()) < p * bs) {
    IndexBatch twice = flat;
    twice.insert(twice.end(), flat.begin(), flat.end());
    flat = std::move(twice);
  }
  if (static_cast<int64_t>(batch.size()) == bs) {
    batch.clear();
    ++idx;
  }
  int64_t cycle = 0;
  while (idx % p != 0 || !batch.empty()) {
    const int64_t end = cycle + bs - static_cast<int64_t>(batch.size());
    IndexBatch more = Slice(flat, cycle, end);
    batch.insert(batch.end(), more.begin(), more.end());
    if (idx % p == r) out.push_back(batch);
    cycle = end;
    batch.clear();
    ++idx;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<IndexBatch>> ShardBatches(const std::vector<IndexBatch>& batches,
                                                     std::optional<int64_t> batch_size,
                                                     bool drop_last, const ShardOptions& options) {
  ACCEL_RETURN_IF_ERROR(CheckShard(options));
  if (options.split_batches) {
    if (!batch_size) {
      return absl::InvalidArgumentError(
          "split_batches needs a batch sampler with a batch size (dynamic batches cannot be split "
          "between processes)");
    }
    if (*batch_size % options.num_processes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "split_batches: the batch size (", *batch_size,
          ") must be a round multiple of the number of processes (", options.num_processes, ")"));
    }
    return ShardSplit(batches, *batch_size, drop_last, options);
  }
  if (batch_size && *batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", *batch_size));
  }
  return ShardNoSplit(batches, batch_size, drop_last, options);
}

int64_t ShardedLength(int64_t num_batches, bool drop_last, const ShardOptions& o) {
  if (o.split_batches) return num_batches;  // Accelerate's quirk: even when uneven
  const int64_t p = o.num_processes;
  if (num_batches % p == 0) return num_batches / p;
  const int64_t length = num_batches / p;
  if (drop_last) return length;
  if (o.even_batches) return length + 1;
  return length + (o.process_index < num_batches % p ? 1 : 0);
}

absl::StatusOr<std::vector<int64_t>> ShardIterable(int64_t n, int64_t batch_size, bool drop_last,
                                                   const ShardOptions& o) {
  ACCEL_RETURN_IF_ERROR(CheckShard(o));
  if (batch_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size must be >= 1, got ", batch_size));
  }
  if (o.split_batches && batch_size > 1 && batch_size % o.num_processes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split_batches: the batch size (", batch_size,
        ") must be a round multiple of the number of processes (", o.num_processes, ")"));
  }
  const int64_t real = o.split_batches ? batch_size : batch_size * o.num_processes;
  const int64_t per = o.split_batches ? batch_size / o.num_processes : batch_size;
  const int64_t begin = o.process_index * per, end = (o.process_index + 1) * per;
  std::vector<int64_t> out, first, current;
  for (int64_t e = 0; e < n; ++e) {
    current.push_back(e);
    if (static_cast<int64_t>(current.size()) == real) {
      for (int64_t i = begin; i < end; ++i) out.push_back(current[static_cast<size_t>(i)]);
      if (first.empty()) first = current;
      current.clear();
    }
  }
  if (!drop_last && !current.empty()) {
    if (first.empty()) first = current;
    while (static_cast<int64_t>(current.size()) < real) {
      current.insert(current.end(), first.begin(), first.end());
    }
    for (int64_t i = begin; i < end; ++i) out.push_back(current[static_cast<size_t>(i)]);
  }
  return out;
}

int64_t IterableShardLength(int64_t n, int64_t batch_size, bool drop_last,
                            const ShardOptions& options) {
  // Accelerate's formula uses batch_size * P even in split mode (its quirk).
  const int64_t real = batch_size * options.num_processes;
  if (real < 1) return 0;
  return (drop_last ? n / real : (n + real - 1) / real) * batch_size;
}

std::vector<IndexBatch> SkipBatches(const std::vector<IndexBatch>& batches, int64_t skip) {
  if (skip <= 0) return batches;
  if (skip >= static_cast<int64_t>(batches.size())) return {};
  return std::vector<IndexBatch>(batches.begin() + skip, batches.end());
}

// ---- Datasets ----

TensorDataset::TensorDataset(TensorMap columns, int64_t rows)
    : columns_(std::move(columns)), rows_(rows) {}

absl::StatusOr<std::shared_ptr<TensorDataset>> TensorDataset::Create(TensorMap columns) {
  if (columns.empty()) return absl::InvalidArgumentError("TensorDataset: no columns");
  int64_t rows = -1;
  std::string first;
  for (const auto& [name, t] : columns) {
    if (!t.defined() || t.dim() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("TensorDataset: column \"", name, "\" has no first dimension"));
    }
    if (rows < 0) {
      rows = t.size(0);
      first = name;
    } else if (t.size(0) != rows) {
      return absl::InvalidArgumentError(absl::StrCat("TensorDataset: column \"", name, "\" has ",
                                                     t.size(0), " rows but \"", first, "\" has ",
                                                     rows));
    }
  }
  return std::shared_ptr<TensorDataset>(new TensorDataset(std::move(columns), rows));
}

int64_t TensorDataset::size() const { return rows_; }

absl::StatusOr<Example> TensorDataset::Get(int64_t index) const {
  if (index < 0 || index >= rows_) {
    return absl::OutOfRangeError(
        absl::StrCat("TensorDataset: index ", index, " is outside [0, ", rows_, ")"));
  }
  Example out;
  for (const auto& [name, t] : columns_) out.emplace(name, t[index]);
  return out;
}

absl::StatusOr<Batch> Collate(const std::vector<Example>& examples) {
  if (examples.empty()) return absl::InvalidArgumentError("Collate: no examples");
  Batch out;
  for (const auto& [name, first] : examples[0]) {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < examples.size(); ++i) {
      auto it = examples[i].find(name);
      if (it == examples[i].end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("Collate: example ", i, " has no \"", name, "\""));
      }
      if (it->second.sizes() != first.sizes() || it->second.scalar_type() != first.scalar_type()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Collate: \"", name, "\" of example ", i, " is ",
            c10::toString(it->second.scalar_type()), c10::str(it->second.sizes()),
            " but example 0's is ", c10::toString(first.scalar_type()), c10::str(first.sizes())));
      }
      parts.push_back(it->second);
    }
    out.emplace(name, at::stack(parts));
  }
  for (size_t i = 1; i < examples.size(); ++i) {
    if (examples[i].size() != examples[0].size()) {
      return absl::InvalidArgumentError(absl::StrCat("Collate: example ", i, " has ",
                                                     examples[i].size(), " keys, example 0 has ",
                                                     examples[0].size()));
    }
  }
  return out;
}

// ---- The loader stack of the gradient state ----

void ActiveLoaders::Push(const LoaderProgress* loader) { stack_.push_back(loader); }

void ActiveLoaders::Pop(const LoaderProgress* loader) {
  auto it = std::find(stack_.rbegin(), stack_.rend(), loader);
  if (it != stack_.rend()) stack_.erase(std::next(it).base());
}

const LoaderProgress* ActiveLoaders::active() const {
  return stack_.empty() ? nullptr : stack_.back();
}

// ---- DataLoader ----

namespace {
// Starts the dispatch header when rank 0 failed to load the batch.
constexpr char kLoadFailed[] = "!load failed: ";
// The dispatch header of a stream that has ended (no batch follows), and the
// first line of the header of its last batch: only rank 0 reads a stream, so
// the others learn from it where the pass ends.
constexpr char kStreamEnded[] = "!end";
constexpr char kLastBatch[] = "!last\n";

// torch.empty((), dtype=torch.int64).random_(generator=g).item(), from the
// global CPU generator when `g` is null.
int64_t DrawInt64(at::Generator* g) {
  at::Tensor t = at::empty({}, at::TensorOptions().dtype(at::kLong));
  if (g != nullptr) {
    t.random_(*g);
  } else {
    t.random_();
  }
  return t.item<int64_t>();
}

at::Tensor GeneratorState(at::Generator g) {
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void SetGeneratorState(at::Generator g, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

std::vector<int64_t> Permutation(int64_t n, const at::Generator& g) {
  at::Tensor perm = at::randperm(n, g, at::TensorOptions().dtype(at::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}
}  // namespace

LoaderPosition LoaderCursor::position() const {
  LoaderPosition p;
  p.epoch = epoch_;
  p.batches_yielded = yielded_;
  p.pass_started = in_pass_;
  if (in_pass_ && pass_state_.defined()) {
    p.generator_state = pass_state_.clone();
  } else if (!in_pass_ && generator_) {
    p.generator_state = GeneratorState(*generator_);
  }
  return p;
}

void LoaderCursor::Restore(const LoaderPosition& position) {
  epoch_ = position.epoch;
  yielded_ = std::max<int64_t>(0, position.batches_yielded);
  resume_ = LoaderPosition();
  resume_->epoch = epoch_;
  resume_->batches_yielded = yielded_;
  const bool has_state = position.generator_state.defined() && position.generator_state.numel() > 0;
  in_pass_ = position.pass_started;
  pass_state_ =
      position.pass_started && has_state ? position.generator_state.clone() : at::Tensor();
  replay_ = in_pass_ && has_state;
  if (generator_ && has_state) SetGeneratorState(*generator_, position.generator_state);
}

struct DataLoader::State {
  std::shared_ptr<const Dataset> dataset;  // null over a stream
  std::shared_ptr<IterableDataset> stream;
  DataLoaderOptions options;
  bool prepared = false;
  PrepareOptions prepare;
  ProcessGroup* group = nullptr;
  ActiveLoaders* active = nullptr;
  // The epoch and position, shared with the loaders SkipFirstBatches makes.
  std::shared_ptr<LoaderCursor> cursor = std::make_shared<LoaderCursor>();
  // SkipFirstBatches: skipped by every pass until one completes (a pass
  // abandoned midway skips again when restarted, like the upstream sampler).
  std::optional<int64_t> skip;

  // The pass in progress.
  std::vector<int64_t> pass_order;  // the sampler's order
  int64_t pass_skip = 0;
  bool running = false;
  bool registered = false;
  std::vector<IndexBatch> batches;  // this rank's, or the global ones (dispatch)
  size_t next = 0;
  std::optional<Batch> lookahead;
  LoaderProgress progress;
  std::optional<Batch> dispatch_first;  // the first P rows of the pass's first global batch
  int64_t last_observed = -1;           // the rows of the last global batch (dispatch)

  // The pass over a stream.
  bool stream_done = false;  // nothing more to fetch in this pass
  bool stream_eof = false;   // the dataset's Next() has returned nullopt
  // Reset's failure on the dispatcher's rank 0, told to the others at the first fetch.
  absl::Status stream_status;
  // IterableDatasetShard's first group of the pass (the examples that
  // complete a short final group), and the real examples in that final
  // group (-1: none was short).
  std::vector<Example> stream_first;
  int64_t stream_tail = -1;
  // The dispatcher's rank 0 reads one group ahead: the next group, once read.
  bool stream_pending_read = false;
  std::optional<std::vector<Example>> stream_pending;

  // Batches per epoch without SkipFirstBatches.
  int64_t FullSize() const;

  int64_t epoch() const { return cursor->epoch_; }
  // What the next pass skips: SkipFirstBatches' count, else the position
  // load_state restored while the loader is still in that epoch.
  int64_t PendingSkip() const {
    if (skip) return *skip;
    const std::optional<LoaderPosition>& resume = cursor->resume_;
    return resume && resume->epoch == epoch() ? resume->batches_yielded : 0;
  }

  int64_t num_processes() const { return prepared ? prepare.shard.num_processes : 1; }
  bool iterable() const { return stream != nullptr; }
  // Whether another batch may come in this pass.
  bool MoreToFetch() const { return iterable() ? !stream_done : next < batches.size(); }
  // Over a stream: the examples that make one global batch (Accelerate's
  // real_batch_size): batch_size * P, or batch_size when split or on one process.
  int64_t StreamGroupSize() const {
    if (!prepared || num_processes() == 1 || prepare.shard.split_batches) {
      return options.batch_size;
    }
    return options.batch_size * num_processes();
  }
  bool dispatch() const { return prepared && prepare.dispatch_batches && num_processes() > 1; }
  uint64_t seed() const {
    if (prepared && prepare.data_seed) return *prepare.data_seed;
    return options.seed.value_or(0);
  }
  // Accelerate's RandomSampler path (use_seedable_sampler false).
  bool synced_shuffle() const {
    return prepared && options.shuffle && !prepare.use_seedable_sampler;
  }
  // Whether this process draws the order (the dispatcher's rank 0 only).
  bool draws() const { return !dispatch() || group->rank() == 0; }

  // The sampler's order for `epoch` when it needs no drawing: the identity,
  // or the seedable sampler's randperm(seed + epoch).
  std::vector<int64_t> SeededOrder() const {
    if (options.shuffle && !synced_shuffle()) {
      return RandomPermutation(dataset->size(), seed() + static_cast<uint64_t>(epoch()));
    }
    std::vector<int64_t> order(static_cast<size_t>(dataset->size()));
    std::iota(order.begin(), order.end(), 0);
    return order;
  }

  // use_seedable_sampler false: the order of the pass that starts, drawn as
  // DataLoaderShard.__iter__ over torch 1.13's DataLoader and RandomSampler
  // would (data.h, PrepareOptions::use_seedable_sampler). A pass restored
  // by load_state replays its generator state and leaves the global RNG alone.
  absl::StatusOr<std::vector<int64_t>> DrawOrder() {
    LoaderCursor& c = *cursor;
    const bool replay = c.replay_ && c.resume_ && c.resume_->epoch == c.epoch_;
    c.replay_ = false;
    c.in_pass_ = true;
    if (!draws()) {
      c.pass_state_ = at::Tensor();
      return SeededOrder();  // only the batch sizes matter on this rank
    }
    const int64_t n = dataset->size();
    std::vector<int64_t> order;
    if (c.generator_) {
      at::Generator& g = *c.generator_;
      if (num_processes() > 1 && !dispatch()) {
        at::Tensor state;
        ACCEL_RETURN_IF_ERROR(CallTorch([&] { state = GeneratorState(g).contiguous(); }));
        ACCEL_ASSIGN_OR_RETURN(
            std::string bytes,
            group->BroadcastBytes(
                absl::string_view(reinterpret_cast<const char*>(state.data_ptr<uint8_t>()),
                                  static_cast<size_t>(state.numel())),
                0));
        ACCEL_RETURN_IF_ERROR(CallTorch([&] {
          at::Tensor synced = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
          std::memcpy(synced.data_ptr<uint8_t>(), bytes.data(), bytes.size());
          SetGeneratorState(g, synced);
        }));
      }
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        c.pass_state_ = GeneratorState(g);
        // torch's DataLoader draws its workers' base seed first: from the
        // loader's generator when the user gave one, else the global RNG.
        if (options.seed) {
          DrawInt64(&g);
        } else if (!replay) {
          DrawInt64(nullptr);
        }
        order = Permutation(n, g);
      }));
      return order;
    }
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      at::Generator g = at::make_generator<at::CPUGeneratorImpl>();
      if (replay && c.pass_state_.defined()) {
        SetGeneratorState(g, c.pass_state_);
      } else {
        DrawInt64(nullptr);  // the base seed, then RandomSampler's seed
        g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(DrawInt64(nullptr)));
      }
      c.pass_state_ = GeneratorState(g);
      order = Permutation(n, g);
    }));
    return order;
  }

  // The base loader's batches (BatchSampler over the sampler's order).
  std::vector<IndexBatch> BaseBatches(const std::vector<int64_t>& order) const {
    return MakeBatches(order, options.batch_size, options.drop_last);
  }

  absl::StatusOr<std::vector<IndexBatch>> RankBatches(const std::vector<int64_t>& order) const {
    std::vector<IndexBatch> base = BaseBatches(order);
    if (!prepared || num_processes() == 1) return base;
    if (dispatch()) {
      // Global batches: P base batches each (one when split); with drop_last
      // an incomplete final group is dropped (its StopIteration ends the pass).
      std::vector<IndexBatch> global;
      const size_t group_size = prepare.shard.split_batches ? 1 : prepare.shard.num_processes;
      for (size_t i = 0; i < base.size(); i += group_size) {
        if (options.drop_last && i + group_size > base.size()) break;
        IndexBatch g;
        for (size_t j = i; j < std::min(base.size(), i + group_size); ++j) {
          g.insert(g.end(), base[j].begin(), base[j].end());
        }
        global.push_back(std::move(g));
      }
      return global;
    }
    return ShardBatches(base, options.batch_size, options.drop_last, prepare.shard);
  }

  int64_t RemainderOf() const {
    if (options.drop_last || iterable()) return -1;  // a stream's is known at its end
    const int64_t total = prepare.shard.split_batches || !prepared
                              ? options.batch_size
                              : options.batch_size * num_processes();
    return dataset->size() % total;
  }

  absl::StatusOr<std::optional<Batch>> Fetch() {
    if (iterable()) return dispatch() ? FetchStreamDispatched() : FetchStream();
    if (next >= batches.size()) return std::optional<Batch>();
    const IndexBatch& indices = batches[next++];
    if (dispatch()) return FetchDispatched(indices);
    return Load(indices);
  }

  absl::StatusOr<std::optional<Batch>> Load(const IndexBatch& indices,
                                            bool to_device = true) const {
    std::vector<Example> examples;
    examples.reserve(indices.size());
    for (int64_t i : indices) {
      ACCEL_ASSIGN_OR_RETURN(Example e, dataset->Get(i));
      examples.push_back(std::move(e));
    }
    ACCEL_ASSIGN_OR_RETURN(Batch batch, Collate(examples));
    if (to_device) {
      ACCEL_ASSIGN_OR_RETURN(batch, Place(std::move(batch)));
    }
    return std::optional<Batch>(std::move(batch));
  }

  // The batch on the prepared loader's device, if it has one.
  absl::StatusOr<Batch> Place(Batch batch) const {
    if (!prepared || !prepare.device) return batch;
    SendToDeviceOptions send;
    send.non_blocking = prepare.non_blocking;
    return SendToDevice(batch, *prepare.device, send);
  }

  // Up to `count` more examples of the stream into `out` (fewer at its end,
  // which stream_eof then records).
  absl::Status ReadStream(int64_t count, std::vector<Example>* out) {
    while (static_cast<int64_t>(out->size()) < count) {
      ACCEL_ASSIGN_OR_RETURN(std::optional<Example> example, stream->Next());
      if (!example) {
        stream_eof = true;
        break;
      }
      out->push_back(*std::move(example));
    }
    return absl::OkStatus();
  }

  // IterableDatasetShard: every rank reads each group of the stream and
  // keeps its slice as one batch. On one process (or unprepared): plain
  // batches, the last one possibly short.
  absl::StatusOr<std::optional<Batch>> FetchStream() {
    if (stream_done) return std::optional<Batch>();
    const int64_t real = StreamGroupSize();
    std::vector<Example> group;
    ACCEL_RETURN_IF_ERROR(ReadStream(real, &group));
    const auto got = static_cast<int64_t>(group.size());
    if (got < real) stream_done = true;
    if (got == 0 || (got < real && options.drop_last)) return std::optional<Batch>();
    const bool shard = prepared && num_processes() > 1;
    if (!shard) {
      ACCEL_ASSIGN_OR_RETURN(Batch batch, Collate(group));
      ACCEL_ASSIGN_OR_RETURN(batch, Place(std::move(batch)));
      return std::optional<Batch>(std::move(batch));
    }
    if (stream_first.empty()) stream_first = group;
    if (got < real) {
      // Completed from the pass's first group, cycled (a stream shorter
      // than one group cycles itself), as Accelerate does.
      stream_tail = got;
      while (static_cast<int64_t>(group.size()) < real) {
        group.insert(group.end(), stream_first.begin(), stream_first.end());
      }
    }
    const int64_t per =
        prepare.shard.split_batches ? options.batch_size / num_processes() : options.batch_size;
    const int64_t begin = prepare.shard.process_index * per;
    std::vector<Example> mine(group.begin() + begin, group.begin() + begin + per);
    ACCEL_ASSIGN_OR_RETURN(Batch batch, Collate(mine));
    ACCEL_ASSIGN_OR_RETURN(batch, Place(std::move(batch)));
    return std::optional<Batch>(std::move(batch));
  }

  // The dispatcher's rank 0: the next global group of the stream (nullopt at
  // its end; a short final group is dropped with drop_last).
  absl::StatusOr<std::optional<std::vector<Example>>> ReadStreamGroup() {
    std::vector<Example> group;
    if (!stream_eof) ACCEL_RETURN_IF_ERROR(ReadStream(StreamGroupSize(), &group));
    if (group.empty() || (stream_eof && options.drop_last &&
                          static_cast<int64_t>(group.size()) < StreamGroupSize())) {
      return std::optional<std::vector<Example>>();
    }
    return std::optional<std::vector<Example>>(std::move(group));
  }

  // DataLoaderDispatcher over a stream: rank 0 reads one group ahead, so the
  // header of the last batch says it is the last.
  absl::StatusOr<std::optional<Batch>> FetchStreamDispatched() {
    if (stream_done && group->rank() != 0) return std::optional<Batch>();
    absl::StatusOr<std::optional<Batch>> loaded = std::optional<Batch>();
    bool last = false;
    if (group->rank() == 0) {
      loaded = [&]() -> absl::StatusOr<std::optional<Batch>> {
        ACCEL_RETURN_IF_ERROR(stream_status);
        if (!stream_pending_read) {
          ACCEL_ASSIGN_OR_RETURN(stream_pending, ReadStreamGroup());
          stream_pending_read = true;
        }
        std::optional<std::vector<Example>> current = std::move(stream_pending);
        stream_pending.reset();
        if (!current) return std::optional<Batch>();
        ACCEL_ASSIGN_OR_RETURN(stream_pending, ReadStreamGroup());
        last = !stream_pending;
        ACCEL_ASSIGN_OR_RETURN(Batch batch, Collate(*current));
        return std::optional<Batch>(std::move(batch));
      }();
    }
    return Dispatch(std::move(loaded), last);
  }

  // DataLoaderDispatcher: rank 0 reads the global batch and broadcasts it;
  // rank r takes rows [r * per, (r + 1) * per) with per = rows / P. The last
  // global batch, when not drop_last and not divisible by P, gets the first P
  // rows of the pass's first global batch appended and per grows by one
  // (Accelerate's rule, split or not; its dispatcher pads whatever
  // even_batches says); gather_for_metrics then keeps the first `remainder`
  // = rows of that batch. Without the padding a split batch of fewer rows
  // than P gives some ranks nothing and the rows beyond a multiple of P are
  // never seen.
  absl::StatusOr<std::optional<Batch>> FetchDispatched(const IndexBatch& indices) {
    const bool last = next >= batches.size();
    absl::StatusOr<std::optional<Batch>> loaded = std::optional<Batch>();
    if (group->rank() == 0) loaded = Load(indices, /*to_device=*/false);
    return Dispatch(std::move(loaded), last);
  }

  // Sends rank 0's global batch (`loaded`: the batch, nullopt when a stream
  // has ended, or the error reading it) to every rank and returns this
  // rank's rows. `last`: whether it is the pass's last batch, as this rank
  // knows it (over a stream only rank 0 does, and the header tells the rest).
  absl::StatusOr<std::optional<Batch>> Dispatch(absl::StatusOr<std::optional<Batch>> loaded,
                                                bool last) {
    Batch global;
    std::string header;
    absl::Status load_status;
    if (group->rank() == 0) {
      if (loaded.ok() && !loaded->has_value()) {
        header = kStreamEnded;
      } else if (loaded.ok()) {
        global = **std::move(loaded);
        if (last) header = kLastBatch;
        for (const auto& [name, t] : global) {
          absl::StrAppend(&header, name, "\t", static_cast<int>(t.scalar_type()));
          for (int64_t d : t.sizes()) absl::StrAppend(&header, "\t", d);
          absl::StrAppend(&header, "\n");
        }
      } else {
        // The other ranks wait for this header: tell them, rather than let
        // them time out.
        stream_done = true;
        load_status = loaded.status();
        header = absl::StrCat(kLoadFailed, load_status.message());
      }
    }
    ACCEL_ASSIGN_OR_RETURN(header, group->BroadcastBytes(header, 0));
    if (!load_status.ok()) return load_status;
    if (absl::StartsWith(header, kLoadFailed)) {
      stream_done = true;
      return absl::AbortedError(
          absl::StrCat("dispatch_batches: rank 0 could not load the batch: ",
                       absl::string_view(header).substr(sizeof(kLoadFailed) - 1)));
    }
    if (header == kStreamEnded) {
      stream_done = true;
      return std::optional<Batch>();
    }
    if (absl::StartsWith(header, kLastBatch)) {
      last = true;
      header.erase(0, sizeof(kLastBatch) - 1);
    }
    if (last && iterable()) stream_done = true;
    if (group->rank() != 0) {
      ACCEL_ASSIGN_OR_RETURN(global, EmptyBatchFromHeader(header));
    }
    for (auto& [name, t] : global) {
      absl::Status broadcast = group->Broadcast(t, 0);
      if (!broadcast.ok()) {
        return absl::Status(broadcast.code(), absl::StrCat("dispatch_batches: broadcasting \"",
                                                           name, "\": ", broadcast.message()));
      }
    }
    const int64_t p = num_processes(), r = prepare.shard.process_index;
    const int64_t observed = global.empty() ? 0 : global.begin()->second.size(0);
    int64_t per = observed / p;
    const bool pad = !options.drop_last && last && observed % p != 0;
    Batch mine;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] {
      if (!options.drop_last && !dispatch_first) {
        Batch first;
        for (const auto& [name, t] : global)
          first.emplace(name, t.narrow(0, 0, std::min(p, t.size(0))));
        dispatch_first = std::move(first);
      }
      if (pad) ++per;
      for (const auto& [name, t] : global) {
        at::Tensor rows = t;
        if (pad) {
          auto it = dispatch_first->find(name);
          if (it != dispatch_first->end()) rows = at::cat({t, it->second});
        }
        // Python's slice: clipped to the rows there are.
        const int64_t begin = std::min(r * per, rows.size(0));
        const int64_t end = std::min((r + 1) * per, rows.size(0));
        mine.emplace(name, rows.narrow(0, begin, end - begin));
      }
    }));
    ACCEL_ASSIGN_OR_RETURN(mine, Place(std::move(mine)));
    if (last) last_observed = observed;
    return std::optional<Batch>(std::move(mine));
  }

  // The batch rank 0 described: "name\tdtype\tdim0\tdim1...\n" per tensor.
  static absl::StatusOr<Batch> EmptyBatchFromHeader(absl::string_view header) {
    Batch batch;
    for (absl::string_view line : absl::StrSplit(header, '\n', absl::SkipEmpty())) {
      std::vector<std::string> fields = absl::StrSplit(line, '\t');
      if (fields.size() < 2) {
        return absl::DataLossError(
            absl::StrCat("dispatch_batches: bad batch header line \"", line, "\""));
      }
      int dtype = 0;
      if (!absl::SimpleAtoi(fields[1], &dtype) || dtype < 0 ||
          dtype >= static_cast<int>(c10::ScalarType::NumOptions)) {
        return absl::DataLossError(absl::StrCat("dispatch_batches: bad dtype \"", fields[1],
                                                "\" for \"", fields[0], "\""));
      }
      std::vector<int64_t> shape;
      for (size_t k = 2; k < fields.size(); ++k) {
        int64_t d = 0;
        if (!absl::SimpleAtoi(fields[k], &d) || d < 0) {
          return absl::DataLossError(absl::StrCat("dispatch_batches: bad dimension \"", fields[k],
                                                  "\" for \"", fields[0], "\""));
        }
        shape.push_back(d);
      }
      at::Tensor t;
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        t = at::empty(shape, at::TensorOptions().dtype(static_cast<c10::ScalarType>(dtype)));
      }));
      batch.emplace(fields[0], std::move(t));
    }
    return batch;
  }

  // end_of_dataloader is set while the last batch is current; the
  // dispatcher's remainder is the size of its last global batch. The pass's
  // sampler is exhausted by then: torch 1.13's RandomSampler draws one more
  // randperm from its generator at that point (the next pass's order
  // depends on it).
  absl::Status MarkEnd() {
    progress.end_of_dataloader = true;
    if (dispatch() && last_observed >= 0) progress.remainder = last_observed;
    if (iterable() && !dispatch() && prepared && num_processes() > 1 && !options.drop_last) {
      // The real examples of the completed final group (0: none was short).
      progress.remainder = std::max<int64_t>(0, stream_tail);
    }
    if (synced_shuffle() && cursor->generator_ && draws()) {
      return CallTorch([&] { Permutation(dataset->size(), *cursor->generator_); });
    }
    return absl::OkStatus();
  }

  void Unregister() {
    if (registered && active != nullptr) active->Pop(&progress);
    registered = false;
  }

  // Start() over a stream: Reset(epoch) where it is read, then the batches
  // to skip are fetched and dropped (a stream cannot seek: Accelerate's skip
  // for iterables), then the first batch is fetched ahead.
  absl::Status StartStream(int64_t skip) {
    batches.clear();
    next = 0;
    pass_skip = skip;
    progress = LoaderProgress{};
    progress.remainder = -1;
    dispatch_first.reset();
    last_observed = -1;
    stream_done = false;
    stream_eof = false;
    stream_status = absl::OkStatus();
    stream_first.clear();
    stream_tail = -1;
    stream_pending_read = false;
    stream_pending.reset();
    if (draws()) {
      absl::Status reset = Annotate(stream->Reset(epoch()), "IterableDataset::Reset");
      // The dispatcher's other ranks wait for rank 0's first header: its
      // failure travels there instead of returning before it.
      if (!reset.ok() && !dispatch()) return reset;
      stream_status = reset;
    }
    running = true;
    if (active != nullptr) {
      active->Push(&progress);
      registered = true;
    }
    int64_t skipped = 0;
    while (skipped < skip && MoreToFetch()) {
      ACCEL_ASSIGN_OR_RETURN(std::optional<Batch> dropped, Fetch());
      if (!dropped) break;
      ++skipped;
    }
    cursor->yielded_ = skipped;
    lookahead.reset();
    if (MoreToFetch()) {
      ACCEL_ASSIGN_OR_RETURN(lookahead, Fetch());
    }
    if (!MoreToFetch() || !lookahead) ACCEL_RETURN_IF_ERROR(MarkEnd());
    return absl::OkStatus();
  }
};

DataLoader::DataLoader(std::unique_ptr<State> state) : state_(std::move(state)) {}

DataLoader::~DataLoader() {
  if (state_) state_->Unregister();
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(
    std::shared_ptr<const Dataset> dataset, const DataLoaderOptions& options) {
  if (dataset == nullptr) return absl::InvalidArgumentError("DataLoader: no dataset");
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DataLoader: batch_size must be >= 1, got ", options.batch_size));
  }
  auto state = std::make_unique<State>();
  state->dataset = std::move(dataset);
  state->options = options;
  return std::unique_ptr<DataLoader>(new DataLoader(std::move(state)));
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Create(
    std::shared_ptr<IterableDataset> dataset, const DataLoaderOptions& options) {
  if (dataset == nullptr) return absl::InvalidArgumentError("DataLoader: no dataset");
  if (options.batch_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DataLoader: batch_size must be >= 1, got ", options.batch_size));
  }
  if (options.shuffle) {
    return absl::InvalidArgumentError(
        "DataLoader: shuffle is for map-style datasets; an IterableDataset reads in its own order "
        "(shuffle in its Reset(epoch))");
  }
  auto state = std::make_unique<State>();
  state->stream = std::move(dataset);
  state->options = options;
  return std::unique_ptr<DataLoader>(new DataLoader(std::move(state)));
}

absl::StatusOr<std::unique_ptr<DataLoader>> DataLoader::Prepare(const DataLoader& loader,
                                                                ProcessGroup& group,
                                                                ActiveLoaders* active,
                                                                const PrepareOptions& options) {
  PrepareOptions prepare = options;
  prepare.shard.num_processes = group.size();
  prepare.shard.process_index = group.rank();
  ACCEL_RETURN_IF_ERROR(CheckShard(prepare.shard));
  if (prepare.shard.split_batches && loader.state_->options.batch_size % group.size() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("split_batches: the batch size (", loader.state_->options.batch_size,
                     ") must be a round multiple of the number of processes (", group.size(), ")"));
  }
  auto state = std::make_unique<State>();
  state->dataset = loader.state_->dataset;
  state->stream = loader.state_->stream;
  state->options = loader.state_->options;
  state->prepared = true;
  state->prepare = prepare;
  state->group = &group;
  state->active = active;
  state->cursor->epoch_ = loader.state_->epoch();
  if (state->synced_shuffle()) {
    // The sampler's generator: the user's (DataLoaderOptions::seed), or one
    // prepare_data_loader makes, seeded from the global RNG, to synchronise
    // across processes. One process, or a dispatcher, without a seed keeps
    // none: RandomSampler seeds a fresh one every pass.
    const std::optional<uint64_t> user_seed = state->options.seed;
    if (user_seed || (group.size() > 1 && !state->dispatch())) {
      ACCEL_RETURN_IF_ERROR(CallTorch([&] {
        const uint64_t seed = user_seed ? *user_seed : static_cast<uint64_t>(DrawInt64(nullptr));
        state->cursor->generator_ = at::make_generator<at::CPUGeneratorImpl>(seed);
      }));
    }
  }
  return std::unique_ptr<DataLoader>(new DataLoader(std::move(state)));
}

std::unique_ptr<DataLoader> DataLoader::SkipFirstBatches(int64_t num_batches) const {
  auto state = std::make_unique<State>();
  state->dataset = state_->dataset;
  state->stream = state_->stream;
  state->options = state_->options;
  state->prepared = state_->prepared;
  state->prepare = state_->prepare;
  state->group = state_->group;
  state->active = state_->active;
  state->cursor = state_->cursor;  // the epoch carries over (Accelerate PR #4071)
  state->skip = std::max<int64_t>(0, num_batches);
  return std::unique_ptr<DataLoader>(new DataLoader(std::move(state)));
}

absl::Status DataLoader::Start() {
  State& s = *state_;
  LoaderCursor& cursor = *s.cursor;
  s.Unregister();
  // A restored position belongs to its epoch only.
  if (cursor.resume_ && cursor.resume_->epoch != cursor.epoch_) cursor.resume_.reset();
  const int64_t skip = s.PendingSkip();
  if (s.iterable()) return s.StartStream(skip);
  if (s.synced_shuffle()) {
    ACCEL_ASSIGN_OR_RETURN(s.pass_order, s.DrawOrder());
  } else {
    s.pass_order = s.SeededOrder();
  }
  s.pass_skip = skip;
  ACCEL_ASSIGN_OR_RETURN(s.batches, s.RankBatches(s.pass_order));
  cursor.yielded_ = std::min<int64_t>(skip, static_cast<int64_t>(s.batches.size()));
  s.batches = SkipBatches(s.batches, skip);
  s.next = 0;
  s.progress = LoaderProgress{};
  s.progress.remainder = s.RemainderOf();
  s.dispatch_first.reset();
  s.last_observed = -1;
  s.running = true;
  if (s.active != nullptr) {
    s.active->Push(&s.progress);
    s.registered = true;
  }
  ACCEL_ASSIGN_OR_RETURN(s.lookahead, s.Fetch());
  if (s.next >= s.batches.size()) {
    ACCEL_RETURN_IF_ERROR(s.MarkEnd());  // no batch, or the first is the last
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<Batch>> DataLoader::Next() {
  State& s = *state_;
  if (!s.running) {
    return absl::FailedPreconditionError("DataLoader::Next before Start (or after the pass ended)");
  }
  if (!s.lookahead) {
    // The pass is over: the next one is a new epoch, from its start.
    s.running = false;
    s.Unregister();
    LoaderCursor& cursor = *s.cursor;
    ++cursor.epoch_;
    cursor.yielded_ = 0;
    cursor.resume_.reset();
    cursor.in_pass_ = false;
    cursor.pass_state_ = at::Tensor();
    cursor.replay_ = false;
    s.skip.reset();  // only the first complete pass skips
    return std::optional<Batch>();
  }
  std::optional<Batch> current = std::move(s.lookahead);
  s.lookahead.reset();
  ++s.cursor->yielded_;
  if (s.MoreToFetch()) {
    ACCEL_ASSIGN_OR_RETURN(s.lookahead, s.Fetch());
  }
  if (!s.lookahead) ACCEL_RETURN_IF_ERROR(s.MarkEnd());
  return current;
}

int64_t DataLoader::size() const {
  const State& s = *state_;
  // SkipBatchSampler.__len__: the skipped batches are not counted.
  const int64_t full = s.FullSize();
  if (full < 0) return -1;
  return std::max<int64_t>(0, full - s.PendingSkip());
}

bool DataLoader::is_iterable() const { return state_->iterable(); }

int64_t DataLoader::State::FullSize() const {
  const State& s = *this;
  if (s.iterable()) {
    // One batch per group of the stream, on every rank and in every mode.
    const std::optional<int64_t> n = s.stream->size();
    if (!n) return -1;
    const int64_t group = s.StreamGroupSize();
    return s.options.drop_last ? *n / group : (*n + group - 1) / group;
  }
  const int64_t n = static_cast<int64_t>(s.dataset->size());
  const int64_t bs = s.options.batch_size;
  const int64_t base = s.options.drop_last ? n / bs : (n + bs - 1) / bs;
  if (!s.prepared || s.num_processes() == 1) return base;
  if (s.dispatch()) {
    if (s.prepare.shard.split_batches) return base;
    return s.options.drop_last ? base / s.num_processes()
                               : (base + s.num_processes() - 1) / s.num_processes();
  }
  return ShardedLength(base, s.options.drop_last, s.prepare.shard);
}

int64_t DataLoader::epoch() const { return state_->epoch(); }
void DataLoader::set_epoch(int64_t epoch) { state_->cursor->epoch_ = epoch; }
LoaderPosition DataLoader::position() const { return state_->cursor->position(); }
const std::shared_ptr<LoaderCursor>& DataLoader::cursor() const { return state_->cursor; }
const LoaderProgress& DataLoader::progress() const { return state_->progress; }
const DataLoaderOptions& DataLoader::options() const { return state_->options; }

int64_t DataLoader::total_batch_size() const {
  const State& s = *state_;
  if (!s.prepared || s.prepare.shard.split_batches) return s.options.batch_size;
  return s.options.batch_size * s.num_processes();
}

int64_t DataLoader::dataset_size() const {
  if (state_->iterable()) return state_->stream->size().value_or(-1);
  return state_->dataset->size();
}

absl::StatusOr<std::vector<IndexBatch>> DataLoader::EpochBatches() const {
  const State& s = *state_;
  if (s.iterable()) {
    return absl::FailedPreconditionError(
        "EpochBatches: the loader reads an IterableDataset, whose examples have no indices");
  }
  if (s.synced_shuffle()) {
    if (!s.running) {
      return absl::FailedPreconditionError(
          "EpochBatches: with use_seedable_sampler false the order is drawn when a pass starts "
          "(call Start first)");
    }
    ACCEL_ASSIGN_OR_RETURN(std::vector<IndexBatch> batches, s.RankBatches(s.pass_order));
    return SkipBatches(batches, s.pass_skip);
  }
  ACCEL_ASSIGN_OR_RETURN(std::vector<IndexBatch> batches, s.RankBatches(s.SeededOrder()));
  return SkipBatches(batches, s.PendingSkip());
}

}  // namespace accel::train
