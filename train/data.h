// train/data.h: datasets, samplers and data loaders with Accelerate's exact
// sharding semantics (data_loader.py): BatchSamplerShard, IterableDatasetShard,
// SeedableRandomSampler (bit-identical to torch.randperm for the same seed),
// skip_first_batches, and the prepared loader that knows when it is on its
// last batch (end_of_dataloader, remainder) for gradient accumulation and
// gather_for_metrics.
#ifndef ACCEL_TRAIN_DATA_H_
#define ACCEL_TRAIN_DATA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "train/collectives.h"
#include "train/process_group.h"

namespace accel::train {

using IndexBatch = std::vector<int64_t>;

// ---- Index-level building blocks (pure; the unit tests use Accelerate's vectors) ----

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)), bit for bit.
std::vector<int64_t> RandomPermutation(int64_t n, uint64_t seed);
// torch's BatchSampler over `order`.
std::vector<IndexBatch> MakeBatches(const std::vector<int64_t>& order, int64_t batch_size,
                                    bool drop_last);

struct ShardOptions {
  int num_processes = 1;
  int process_index = 0;
  bool split_batches = false;
  bool even_batches = true;
};

// BatchSamplerShard: rank process_index's batches out of `batches` (the
// output of a batch sampler). `batch_size` is the sampler's batch size, or
// nullopt for dynamic batches; `drop_last` the sampler's. InvalidArgument
// (mentioning "split_batches" / "round multiple") as Accelerate raises.
absl::StatusOr<std::vector<IndexBatch>> ShardBatches(const std::vector<IndexBatch>& batches,
                                                     std::optional<int64_t> batch_size,
                                                     bool drop_last, const ShardOptions& options);
// BatchSamplerShard.__len__ (the split-mode quirk included).
int64_t ShardedLength(int64_t num_batches, bool drop_last, const ShardOptions& options);

// IterableDatasetShard over a stream of `n` elements 0..n-1: the elements
// rank process_index yields, in order.
absl::StatusOr<std::vector<int64_t>> ShardIterable(int64_t n, int64_t batch_size, bool drop_last,
                                                   const ShardOptions& options);

// IterableDatasetShard.__len__ for a stream of `n` elements (the split-mode
// quirk included: it counts batch_size * num_processes per real batch).
int64_t IterableShardLength(int64_t n, int64_t batch_size, bool drop_last,
                            const ShardOptions& options);

// SkipBatchSampler: everything after the first `skip` batches.
std::vector<IndexBatch> SkipBatches(const std::vector<IndexBatch>& batches, int64_t skip);

// ---- Datasets and loaders ----

// One example or one batch: named tensors ("input_ids", "labels", ...).
using Example = TensorMap;
using Batch = TensorMap;

// A map-style dataset.
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual absl::StatusOr<Example> Get(int64_t index) const = 0;
};

// An iterable (streaming) dataset, torch's IterableDataset: examples come
// one after another and the loader cannot index them. A loader starts each
// pass with Reset(epoch) (torch's set_epoch, then iter()) and reads with
// Next() until it returns nullopt. Resuming (load_state, SkipFirstBatches)
// re-reads the pass and drops the batches already handed out, as Accelerate's
// skip does: it is exact when Reset with the same epoch replays the same
// examples in the same order. One pass at a time: the loaders made from one
// loader (prepared, skipping) share the dataset, and so share its stream.
class IterableDataset {
 public:
  virtual ~IterableDataset() = default;
  virtual absl::Status Reset(int64_t epoch) = 0;
  // The next example of the pass; nullopt at its end.
  virtual absl::StatusOr<std::optional<Example>> Next() = 0;
  // Examples per pass when known (__len__), for DataLoader::size().
  virtual std::optional<int64_t> size() const { return std::nullopt; }
};

// Rows of named tensors that share their first dimension.
class TensorDataset : public Dataset {
 public:
  // InvalidArgument naming the tensor whose first dimension differs.
  static absl::StatusOr<std::shared_ptr<TensorDataset>> Create(TensorMap columns);
  int64_t size() const override;
  absl::StatusOr<Example> Get(int64_t index) const override;

 private:
  explicit TensorDataset(TensorMap columns, int64_t rows);
  TensorMap columns_;
  int64_t rows_;
};

// Stacks the examples' tensors along a new dimension 0; InvalidArgument
// naming the key when examples disagree on keys or shapes.
absl::StatusOr<Batch> Collate(const std::vector<Example>& examples);

// What a user builds (torch.utils.data.DataLoader's arguments).
struct DataLoaderOptions {
  int64_t batch_size = 1;
  bool shuffle = false;  // a seeded random permutation per epoch
  bool drop_last = false;
  // The seed of the shuffle (SeedableRandomSampler's initial_seed); unset:
  // the seed of the last SetSeed, else 0.
  std::optional<uint64_t> seed;
};

// The gradient state's view of the loaders being iterated: a stack, the
// innermost active loader last (Accelerate's GradientState.dataloader_references).
struct LoaderProgress {
  bool end_of_dataloader = false;
  int64_t remainder = -1;  // len(dataset) % total_batch_size, -1 when unknown or drop_last
};
class ActiveLoaders {
 public:
  void Push(const LoaderProgress* loader);
  void Pop(const LoaderProgress* loader);
  // The innermost active loader, or nullptr.
  const LoaderProgress* active() const;

 private:
  std::vector<const LoaderProgress*> stack_;
};

// Where a loader is in its epochs: what save_state records for each prepared
// loader (the sampler's epoch and how far this rank got into it).
struct LoaderPosition {
  int64_t epoch = 0;
  // Batches of `epoch` this rank has been handed, the skipped ones included;
  // 0 between passes (a completed pass has moved to the next epoch).
  int64_t batches_yielded = 0;
  // use_seedable_sampler false only (else false / undefined): whether a pass
  // of `epoch` has started, and the generator state its order was drawn from
  // (before it started: the sampler's generator's state, if it keeps one).
  bool pass_started = false;
  at::Tensor generator_state;
};

// The position of a loader, shared by the loader, the loaders
// SkipFirstBatches makes from it (they walk the same sampler) and whoever
// records it (the Accelerator keeps one per prepared loader for save_state,
// so it outlives the loader).
class LoaderCursor {
 public:
  LoaderPosition position() const;
  // load_state: the epoch becomes position.epoch, and the passes of that
  // epoch skip its first position.batches_yielded batches (as
  // skip_first_batches does) until one completes. With
  // use_seedable_sampler false the generator state comes back too, and a
  // pass that had started draws the same order again (global RNG untouched:
  // load_state restores that separately).
  void Restore(const LoaderPosition& position);

 private:
  friend class DataLoader;
  int64_t epoch_ = 0;
  int64_t yielded_ = 0;
  std::optional<LoaderPosition> resume_;
  // use_seedable_sampler false: the sampler's generator when it keeps one,
  // whether a pass of the epoch has started, the state its order came from,
  // and whether the next pass replays that state (after a restore).
  std::optional<at::Generator> generator_;
  bool in_pass_ = false;
  at::Tensor pass_state_;
  bool replay_ = false;
};

// DataLoaderConfiguration's options that shape the prepared loader.
struct PrepareOptions {
  ShardOptions shard;             // num_processes and process_index come from the group
  bool dispatch_batches = false;  // rank 0 reads and broadcasts (DataLoaderDispatcher)
  // true: a shuffle is SeedableRandomSampler's, randperm seeded with
  // data_seed + epoch. false: Accelerate's RandomSampler path, as torch 1.13
  // draws it: a loader given DataLoaderOptions::seed keeps a generator seeded
  // with it (the user's torch.Generator); without one, several processes
  // (not dispatching) share a generator each process seeds from one draw of
  // its global RNG when prepared; either way every pass first broadcasts
  // rank 0's generator state (synchronize_rng_states), draws torch's
  // DataLoader base seed (from that generator, else the global RNG), then
  // randperm, and a second randperm once the pass is exhausted. One process,
  // or the dispatcher's rank 0, without a seed: each pass seeds a fresh
  // generator from the global RNG (after the base seed). Accelerate's
  // default is false; ours is true (the Accelerator's option says why).
  bool use_seedable_sampler = true;
  std::optional<uint64_t> data_seed;  // the seedable sampler's seed
  // Batches are moved here (non_blocking where the device allows); nullopt:
  // they stay where the dataset made them (device_placement false).
  std::optional<c10::Device> device = c10::Device(c10::kCPU);
  bool non_blocking = false;
};

// DataLoaderShard / DataLoaderDispatcher: iterate with
//   ACCEL_RETURN_IF_ERROR(loader.Start());
//   while (true) { ACCEL_ASSIGN_OR_RETURN(std::optional<Batch> b, loader.Next()); if (!b) break;
//   ... }
// The loader runs one batch ahead, so end_of_dataloader() is true while the
// last batch is being used. A full pass moves to the next epoch.
//
// Over an IterableDataset, prepared for several processes: without
// dispatch_batches every rank reads the whole stream and keeps its slice of
// each group of batch_size * P examples (batch_size with split_batches) as
// one batch, Accelerate's IterableDatasetShard; a short final group is
// completed by cycling the pass's first group (drop_last: dropped), so every
// rank yields the same number of batches, and gather_for_metrics keeps the
// final group's real examples (remainder: their count; Accelerate computes
// 0 there and keeps the duplicates). With dispatch_batches (Accelerate's
// default for iterables) rank 0 alone reads, one group ahead so that it
// knows which group is the last, and sends each rank its rows
// (DataLoaderDispatcher; remainder: the rows of the last group). On one
// process the stream is simply batched, the last batch possibly short.
// even_batches does not apply to a stream (Accelerate's shard always evens
// it out, as here).
class DataLoader {
 public:
  // An unprepared, single-process loader.
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(std::shared_ptr<const Dataset> dataset,
                                                            const DataLoaderOptions& options);
  // The same over a stream; `options.shuffle` is refused (torch's
  // DataLoader refuses it too: an iterable dataset shuffles itself, in
  // Reset(epoch)).
  static absl::StatusOr<std::unique_ptr<DataLoader>> Create(
      std::shared_ptr<IterableDataset> dataset, const DataLoaderOptions& options);
  // The sharded loader of one rank. `group` and `active` must outlive it;
  // `group` is used by dispatch_batches only.
  static absl::StatusOr<std::unique_ptr<DataLoader>> Prepare(const DataLoader& loader,
                                                             ProcessGroup& group,
                                                             ActiveLoaders* active,
                                                             const PrepareOptions& options);
  // skip_first_batches: a loader that skips the first `num_batches` of the
  // current epoch once (the epoch carries over), then behaves as this one.
  // It shares this loader's cursor: its passes move this loader's epoch and
  // position, and its skip replaces a position restored by load_state.
  std::unique_ptr<DataLoader> SkipFirstBatches(int64_t num_batches) const;

  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  absl::Status Start();
  absl::StatusOr<std::optional<Batch>> Next();
  // Batches this rank yields per epoch (BatchSamplerShard.__len__), less the
  // ones the next pass skips; over a stream of unknown size, -1.
  int64_t size() const;
  // Whether the dataset is an IterableDataset.
  bool is_iterable() const;
  int64_t epoch() const;
  void set_epoch(int64_t epoch);
  // The epoch and the batches of it handed out so far (save_state).
  LoaderPosition position() const;
  // The cursor behind position(), for a caller that must read or restore it
  // after the loader is gone.
  const std::shared_ptr<LoaderCursor>& cursor() const;
  const LoaderProgress& progress() const;
  const DataLoaderOptions& options() const;
  // batch_size * num_processes (or batch_size when split_batches).
  int64_t total_batch_size() const;
  // The examples per pass; over a stream of unknown size, -1.
  int64_t dataset_size() const;
  // The indices of the batches this rank yields in the current epoch (for
  // tests and resume). With use_seedable_sampler false the order is drawn
  // when a pass starts: FailedPrecondition outside a pass, and always over
  // an IterableDataset (a stream has no indices).
  absl::StatusOr<std::vector<IndexBatch>> EpochBatches() const;

 private:
  struct State;
  explicit DataLoader(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace accel::train

#endif  // ACCEL_TRAIN_DATA_H_
