#include "engine/model_runner.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"

#include "core/device_copy.h"
#include "core/status.h"
#include "engine/decode_graphs.h"
#include "engine/internal/decode_graph_runner.h"
#include "engine/internal/draft_proposer.h"
#include "engine/logits_processor.h"
#include "engine/ngram_proposer.h"
#include "engine/rejection_sampler.h"
#include "engine/sampler.h"
#include "models/causal_lm.h"

namespace accel::engine {
namespace {

bool IsLongRope(const loader::ModelConfig& config) {
  return config.rope_scaling && config.rope_scaling->rope_type == "longrope";
}

// Where a static decode step's host inputs go (StaticDecodeInputs' host
// copies): a value per row each, and `max_blocks` table entries a row.
struct StaticRows {
  int64_t* ids = nullptr;
  int64_t* positions = nullptr;
  int64_t* slot_blocks = nullptr;
  int64_t* slot_offsets = nullptr;
  int32_t* tables = nullptr;
  int32_t* totals = nullptr;
  int64_t max_blocks = 0;
};

// Fills `out` for the rows of `chunks` (one token each): the id, the
// position (the cache's length; 0 for rows at `real_rows` and past, the
// padded ones), the slot the key and value go to, the total attended and
// the block table. A row's table entries past its total are left as they
// are (never read). Throws (c10::Error) for a row whose table is too short.
void FillStaticRows(const std::vector<int64_t>& packed,
                    const std::vector<models::SequenceChunk>& chunks, int64_t real_rows,
                    int64_t block_size, const StaticRows& out) {
  for (size_t i = 0; i < chunks.size(); ++i) {
    const auto r = static_cast<int64_t>(i);
    const models::KvCache& cache = *chunks[i].cache;
    const int64_t length = r < real_rows ? cache.length : 0;
    const int64_t used = length / block_size + 1;
    TORCH_CHECK(static_cast<int64_t>(cache.block_table.size()) >= used && used <= out.max_blocks,
                "static decode step: row ", r, " at position ", length, " but its table holds ",
                cache.block_table.size(), " blocks");
    out.ids[r] = packed[i];
    out.positions[r] = length;
    out.slot_blocks[r] = cache.block_table[static_cast<size_t>(length / block_size)];
    out.slot_offsets[r] = length % block_size;
    out.totals[r] = static_cast<int32_t>(length + 1);
    std::copy(cache.block_table.begin(), cache.block_table.begin() + used,
              out.tables + r * out.max_blocks);
  }
}

// After a static decode step (which leaves the caches' host state alone):
// the first `real_rows` rows' caches advance by their token.
void AdvanceStaticRows(const std::vector<int64_t>& packed,
                       const std::vector<models::SequenceChunk>& chunks, int64_t real_rows) {
  for (int64_t r = 0; r < real_rows; ++r) {
    models::KvCache& cache = *chunks[static_cast<size_t>(r)].cache;
    cache.length += 1;
    cache.token_ids.push_back(packed[static_cast<size_t>(r)]);
  }
}

}  // namespace

struct ModelRunner::Impl {
  struct Request {
    explicit Request(Sampler s) : sampler(std::move(s)) {}
    Sampler sampler;
    std::unique_ptr<LogitsProcessor> processor;
    models::KvCache cache;
    bool logprobs = false;
    int64_t top_logprobs = 0;
    // Prompt logprobs: gathered chunk by chunk while the prompt is read,
    // handed over with the first sampled token.
    bool prompt_logprobs = false;
    bool prompt_logprobs_sent = false;
    std::vector<PromptLogprob> prompt_gathered;
    int64_t prompt_tokens = 0;
    int64_t max_new_tokens = 0;
    std::vector<int64_t> stop_token_ids;
    // The distributions the drafts proposed for the next step were drawn
    // from (a draft model, sampled requests): [drafts, draft vocab].
    at::Tensor draft_probs;
  };

  std::shared_ptr<models::CausalLM> model;
  dispatch::DispatchedModel* dispatched = nullptr;
  ModelRunnerOptions options;
  int64_t position_limit = 0;
  bool prefix_caching = true;
  std::unique_ptr<models::KvBlockStore> store;
  std::optional<NgramProposer> ngram;
  std::unique_ptr<internal::DraftProposer> draft;
  std::map<uint64_t, std::unique_ptr<Request>> requests;
  // Padded decode steps (options.decode_buckets): one cache per padded row
  // on the scratch block, and each bucket's static input buffer.
  std::vector<models::KvCache> padding;
  int32_t scratch_block = -1;
  // Each bucket's static buffers on the model's device: what a captured
  // graph reads (ids and the step's positions, slots, tables, totals) and
  // writes (logits). Filled from `host` (their host copies) before a step.
  struct BucketBuffers {
    at::Tensor ids, logits;
    models::StaticDecodeInputs inputs;
    struct {
      at::Tensor ids, positions, slot_blocks, slot_offsets, block_tables, totals;
    } host;
  };
  std::map<int64_t, BucketBuffers> buckets;
  std::unique_ptr<internal::DecodeGraphRunner> graphs;
  int64_t padded_steps = 0, padded_rows = 0;
  // options.unpadded_static_decode resolved for this model and device.
  bool unpadded_static = false;
  int64_t unpadded_static_steps = 0;

  // The padded step of `chunks` (one token each, the bucket's padded rows
  // last): the static inputs written, the model's static decode step run
  // (or replayed), the caches advanced. Logits [bucket, vocab] on the model's
  // device (the bucket's buffer).
  absl::StatusOr<at::Tensor> RunPaddedDecode(int64_t bucket, const std::vector<int64_t>& packed,
                                             const std::vector<models::SequenceChunk>& chunks,
                                             int64_t batch);

  // A step of one-token decodes (`chunks`, no padding) as the model's
  // static decode step: its inputs built here and copied to the device at
  // once, the caches advanced. Logits [rows, vocab] on the model's device.
  absl::StatusOr<at::Tensor> RunUnpaddedStaticDecode(
      const std::vector<int64_t>& packed, const std::vector<models::SequenceChunk>& chunks);

  void ResetCache(Request& r) {
    r.cache.Clear();
    r.cache.store = store.get();
  }

  // Drafts for a request after this step, or none: room left in
  // max_new_tokens (verifying k drafts gives up to k + 1 tokens) and no stop
  // token just sampled.
  int64_t DraftLimit(const Request& r, absl::Span<const int64_t> ids) const {
    const int64_t generated = static_cast<int64_t>(ids.size()) - r.prompt_tokens;
    if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), ids.back()) !=
        r.stop_token_ids.end()) {
      return 0;
    }
    return std::max<int64_t>(
        std::min({options.speculative.num_speculative_tokens, r.max_new_tokens - generated - 1,
                  position_limit - 1 - static_cast<int64_t>(ids.size())}),
        0);
  }

  // A step between its forward pass's start and its sampling: the
  // requests' runner state, their chunks (caches), what to undo.
  struct Pass {
    SchedulerOutput out;  // Submit's copy (Execute samples from its own)
    std::vector<Request*> scheduled;
    std::vector<models::SequenceChunk> chunks;
    std::vector<int64_t> lengths;                    // before the step, to undo a failed one
    std::vector<size_t> gathered;                    // prompt logprobs before the step, likewise
    std::vector<bool> prompt_rows;                   // the chunk asks logits at every position
    std::unique_ptr<models::PendingLogits> pending;  // a submitted step's logits
  };
  std::map<uint64_t, Pass> submitted;  // steps in flight, by ticket
  uint64_t next_ticket = 1;

  // Drops the preempted requests' caches, then fills `pass` and `packed`
  // (the step's ids) from `out`'s scheduled requests.
  absl::Status Prepare(const SchedulerOutput& out, Pass& pass, std::vector<int64_t>& packed);
  // Puts the step's caches and prompt logprobs back where they were.
  static void Undo(const Pass& pass);
  // Sampling, draft verification and the next drafts from the step's
  // logits (a row per chunk's logit_tokens, in order).
  absl::StatusOr<ModelRunnerOutput> Sample(const SchedulerOutput& out, const Pass& pass,
                                           at::Tensor logits);
  absl::StatusOr<ModelRunnerOutput> Execute(const SchedulerOutput& out);
  absl::StatusOr<uint64_t> Submit(const SchedulerOutput& out);
  absl::StatusOr<ModelRunnerOutput> Collect(uint64_t ticket);

  // The log-probabilities of the prompt tokens that `rows` (the logits at
  // each position of `s`'s chunk) predict: token c + j + 1 from row j, for
  // tokens inside the prompt; the first prompt token has none.
  static void GatherPromptLogprobs(Request& r, const ScheduledRequest& s, const at::Tensor& rows) {
    const int64_t first = s.num_computed_tokens;
    if (first == 0)
      r.prompt_gathered.push_back({s.token_ids[0], std::nullopt, {}});  // nothing before it
    const int64_t count = std::min<int64_t>(rows.size(0), r.prompt_tokens - first - 1);
    if (count <= 0) return;
    const at::Tensor log_probs = at::log_softmax(rows.narrow(0, 0, count).to(at::kFloat), -1);
    const std::vector<int64_t> next(s.token_ids.begin() + first + 1,
                                    s.token_ids.begin() + first + 1 + count);
    const at::Tensor picked =
        log_probs.gather(1, at::tensor(next, at::kLong).unsqueeze(1)).squeeze(1).contiguous();
    const float* value = picked.data_ptr<float>();
    at::Tensor top_values, top_ids;
    if (r.top_logprobs > 0) {
      std::tie(top_values, top_ids) =
          at::topk(log_probs, std::min(r.top_logprobs, log_probs.size(1)));
      top_values = top_values.contiguous();
      top_ids = top_ids.contiguous();
    }
    for (int64_t j = 0; j < count; ++j) {
      PromptLogprob p;
      p.token_id = next[static_cast<size_t>(j)];
      p.logprob = value[j];
      if (top_values.defined()) {
        for (int64_t k = 0; k < top_values.size(1); ++k) {
          p.top_logprobs.push_back({top_ids[j][k].item<int64_t>(), top_values[j][k].item<float>()});
        }
      }
      r.prompt_gathered.push_back(std::move(p));
    }
  }
};

absl::StatusOr<at::Tensor> ModelRunner::Impl::RunPaddedDecode(
    int64_t bucket, const std::vector<int64_t>& packed,
    const std::vector<models::SequenceChunk>& chunks, int64_t batch) {
  const int64_t block_size = options.block_size;
  // Tables wide enough for the longest sequence the store and the model
  // allow: the attention's plan is fixed by it, whatever this step's lengths.
  const int64_t max_total = std::min<int64_t>(position_limit, options.num_blocks * block_size);
  const int64_t max_blocks = (max_total + block_size - 1) / block_size;
  BucketBuffers* b = nullptr;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    // The bucket's static buffers, on the device the model takes its ids
    // on, and their host copies (pinned for a CUDA device), made once.
    const at::Device device =
        dispatched != nullptr ? dispatched->main_device() : at::Device(at::kCPU);
    b = &buckets[bucket];
    if (!b->ids.defined()) {
      const bool pin = device.is_cuda();
      const auto make = [&](at::IntArrayRef shape, at::ScalarType type, at::Tensor& on_device,
                            at::Tensor& on_host) {
        on_device = at::empty(shape, at::TensorOptions().device(device).dtype(type));
        on_host = at::empty(shape, at::TensorOptions().dtype(type).pinned_memory(pin));
      };
      make({bucket}, at::kLong, b->ids, b->host.ids);
      make({1, bucket}, at::kLong, b->inputs.positions, b->host.positions);
      make({bucket}, at::kLong, b->inputs.slot_blocks, b->host.slot_blocks);
      make({bucket}, at::kLong, b->inputs.slot_offsets, b->host.slot_offsets);
      make({bucket, max_blocks}, at::kInt, b->inputs.block_tables, b->host.block_tables);
      make({bucket}, at::kInt, b->inputs.totals, b->host.totals);
      b->inputs.max_total = max_total;
    }
    // The host copy of this step's inputs; a padded row is position 0 of
    // the scratch block (its cache's table).
    StaticRows rows;
    rows.ids = b->host.ids.data_ptr<int64_t>();
    rows.positions = b->host.positions.data_ptr<int64_t>();
    rows.slot_blocks = b->host.slot_blocks.data_ptr<int64_t>();
    rows.slot_offsets = b->host.slot_offsets.data_ptr<int64_t>();
    rows.tables = b->host.block_tables.data_ptr<int32_t>();
    rows.totals = b->host.totals.data_ptr<int32_t>();
    rows.max_blocks = max_blocks;
    FillStaticRows(packed, chunks, batch, block_size, rows);
    // Asynchronous from pinned memory on a CUDA device: the last step ended
    // by reading its logits back, so no earlier copy still reads these.
    const bool async = device.is_cuda();
    b->ids.copy_(b->host.ids, async);
    b->inputs.positions.copy_(b->host.positions, async);
    b->inputs.slot_blocks.copy_(b->host.slot_blocks, async);
    b->inputs.slot_offsets.copy_(b->host.slot_offsets, async);
    b->inputs.block_tables.copy_(b->host.block_tables, async);
    b->inputs.totals.copy_(b->host.totals, async);
  }));
  // The step itself: captured and replayed per bucket on a CUDA device,
  // called directly elsewhere. It writes the bucket's logits buffer.
  absl::Status inner;
  const absl::Status ran = graphs->Run(bucket, [&] {
    absl::StatusOr<at::Tensor> logits =
        model->ForwardStaticDecode(b->ids, chunks, b->inputs, dispatched);
    if (!logits.ok()) {
      // Thrown, so that a capture in progress ends and keeps no graph; the
      // status itself is returned below.
      inner = logits.status();
      throw std::runtime_error(inner.ToString());
    }
    if (!b->logits.defined()) b->logits = at::empty_like(*logits);
    b->logits.copy_(*logits);
  });
  ACCEL_RETURN_IF_ERROR(inner);
  ACCEL_RETURN_IF_ERROR(ran);
  // The caches advance here (the static step does not touch the host's
  // state): the real rows only.
  AdvanceStaticRows(packed, chunks, batch);
  // On the device (the bucket's buffer, read before the next step writes
  // it): Sample copies back what it needs.
  return b->logits;
}

absl::StatusOr<at::Tensor> ModelRunner::Impl::RunUnpaddedStaticDecode(
    const std::vector<int64_t>& packed, const std::vector<models::SequenceChunk>& chunks) {
  const int64_t rows = static_cast<int64_t>(chunks.size()), block_size = options.block_size;
  at::Tensor ids;
  models::StaticDecodeInputs inputs;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] {
    const at::Device device =
        dispatched != nullptr ? dispatched->main_device() : at::Device(at::kCPU);
    // This step's longest row fixes the attention's plan (no graph reuses it).
    int64_t max_length = 0;
    for (const models::SequenceChunk& chunk : chunks) {
      max_length = std::max(max_length, chunk.cache->length);
    }
    const int64_t max_blocks = max_length / block_size + 1;
    // Two host buffers, sent without waiting (core/device_copy.h): ids,
    // positions, slot blocks and offsets as int64; the tables and totals as
    // int32.
    at::Tensor wide = HostStaging({4, rows}, at::kLong, device);
    at::Tensor narrow = HostStaging({rows * max_blocks + rows}, at::kInt, device).zero_();
    int64_t* w = wide.data_ptr<int64_t>();
    StaticRows out;
    out.ids = w;
    out.positions = w + rows;
    out.slot_blocks = w + 2 * rows;
    out.slot_offsets = w + 3 * rows;
    out.tables = narrow.data_ptr<int32_t>();
    out.totals = out.tables + rows * max_blocks;
    out.max_blocks = max_blocks;
    FillStaticRows(packed, chunks, rows, block_size, out);
    const at::Tensor wide_on_device = SendToDevice(wide, device);
    const at::Tensor narrow_on_device = SendToDevice(narrow, device);
    ids = wide_on_device[0];
    inputs.positions = wide_on_device[1].view({1, rows});
    inputs.slot_blocks = wide_on_device[2];
    inputs.slot_offsets = wide_on_device[3];
    inputs.block_tables = narrow_on_device.narrow(0, 0, rows * max_blocks).view({rows, max_blocks});
    inputs.totals = narrow_on_device.narrow(0, rows * max_blocks, rows);
    inputs.max_total = max_length + 1;
  }));
  ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                         model->ForwardStaticDecode(ids, chunks, inputs, dispatched));
  AdvanceStaticRows(packed, chunks, rows);
  ++unpadded_static_steps;
  return logits;  // on the device: Sample copies back what it needs
}

ModelRunner::ModelRunner(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ModelRunner::~ModelRunner() = default;

absl::StatusOr<std::unique_ptr<ModelRunner>> ModelRunner::Create(
    std::shared_ptr<models::CausalLM> model, dispatch::DispatchedModel* dispatched,
    ModelRunnerOptions options) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  const loader::ModelConfig& config = model->config();
  m.position_limit = config.max_position_embeddings > 0 ? config.max_position_embeddings
                                                        : std::numeric_limits<int64_t>::max();
  options.block_size = std::max<int64_t>(options.block_size, 1);
  // A step's drafts come from the step before it, and padded decode steps
  // share one static buffer: both run one step at a time.
  if (options.speculative.enabled() || !options.decode_buckets.empty() ||
      options.steps_in_flight < 1) {
    options.steps_in_flight = 1;
  }
  // LongRoPE: a position's keys depend on the sequence's length (the short
  // factors until it passes the original context, then the long ones for
  // the whole sequence), so equal tokens need not have equal keys and blocks
  // cannot be shared between sequences.
  m.prefix_caching = !IsLongRope(config);
  if (options.num_blocks <= 0) {
    const int64_t per_block =
        models::KvBlockStore::BytesPerBlock(config, model->dtype(), options.block_size);
    const int64_t limit = std::min<int64_t>(m.position_limit, 8192);
    int64_t blocks = (4 * limit + options.block_size - 1) / options.block_size;
    if (per_block > 0) blocks = std::min<int64_t>(blocks, (int64_t{1} << 30) / per_block);
    options.num_blocks = std::max<int64_t>(blocks, 1);
  }
  const SpeculativeConfig& spec = options.speculative;
  if (spec.enabled() && IsLongRope(config)) {
    // A verification chunk that crosses the original context would compute
    // every position of it with the long factors, where decoding one token
    // at a time computes those before the boundary with the short ones.
    return absl::InvalidArgumentError(
        "--speculative_config: a LongRoPE model (rope_scaling longrope) cannot verify drafts: "
        "its keys change when a sequence crosses the original context");
  }
  if (spec.method == SpeculativeConfig::Method::kNgram) {
    m.ngram.emplace(spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens);
  } else if (spec.method == SpeculativeConfig::Method::kDraftModel) {
    if (options.draft_model == nullptr) {
      return absl::InvalidArgumentError(
          "--speculative_config: the draft model was not loaded (model)");
    }
    const loader::ModelConfig& draft = options.draft_model->config();
    if (draft.vocab_size > config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("--speculative_config: the draft model (", spec.model,
                       ") has a vocabulary of ", draft.vocab_size, " tokens, the target ",
                       config.vocab_size, "; a draft model must share the target's tokenizer"));
    }
    if (IsLongRope(draft)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--speculative_config: the draft model (", spec.model,
                       ") uses LongRoPE, whose keys change with the sequence's length"));
    }
    m.draft = std::make_unique<internal::DraftProposer>(
        options.draft_model, options.draft_dispatched, options.num_blocks, options.block_size,
        spec.num_speculative_tokens);
  }
  m.model = std::move(model);
  m.dispatched = dispatched;
  m.options = std::move(options);
  std::sort(m.options.decode_buckets.begin(), m.options.decode_buckets.end());
  // A model without a static decode step (GPT-2, LongRoPE, split) runs
  // every step unpadded.
  if (!m.model->SupportsStaticDecode()) m.options.decode_buckets.clear();
  {
    using Unpadded = ModelRunnerOptions::UnpaddedStaticDecode;
    const bool on_cuda = dispatched != nullptr && dispatched->main_device().is_cuda();
    m.unpadded_static = m.model->SupportsStaticDecode() &&
                        (m.options.unpadded_static_decode == Unpadded::kAlways ||
                         (m.options.unpadded_static_decode == Unpadded::kAuto && on_cuda));
  }
  const bool padding = !m.options.decode_buckets.empty();
  // The scratch block of padded rows is the store's last, past every block
  // the scheduler hands out.
  m.store = std::make_unique<models::KvBlockStore>(m.options.num_blocks + (padding ? 1 : 0),
                                                   m.options.block_size,
                                                   static_cast<size_t>(config.num_hidden_layers));
  if (padding) {
    m.scratch_block = static_cast<int32_t>(m.options.num_blocks);
    m.padding.resize(static_cast<size_t>(m.options.decode_buckets.back() - 1));
    m.graphs = std::make_unique<internal::DecodeGraphRunner>(m.options.capture_decode_graphs);
  }
  return std::unique_ptr<ModelRunner>(new ModelRunner(std::move(impl)));
}

absl::Status ModelRunner::AddRequest(uint64_t id, const GenerationRequest& request) {
  ACCEL_ASSIGN_OR_RETURN(Sampler sampler, Sampler::Create(request.sampling));
  auto r = std::make_unique<Impl::Request>(std::move(sampler));
  r->cache.store = impl_->store.get();
  r->logprobs = request.logprobs;
  r->top_logprobs = request.top_logprobs;
  r->prompt_logprobs = request.prompt_logprobs;
  r->prompt_tokens = static_cast<int64_t>(request.prompt_ids.size());
  r->max_new_tokens = request.max_new_tokens;
  r->stop_token_ids = request.stop_token_ids;
  if (impl_->options.logits_processors) r->processor = impl_->options.logits_processors(request);
  if (impl_->draft) impl_->draft->Add(id, r->sampler);
  impl_->requests[id] = std::move(r);
  return absl::OkStatus();
}

void ModelRunner::RemoveRequest(uint64_t id) {
  impl_->requests.erase(id);
  if (impl_->draft) impl_->draft->Remove(id);
}

absl::StatusOr<ModelRunnerOutput> ModelRunner::Execute(const SchedulerOutput& output) {
  return impl_->Execute(output);
}

int ModelRunner::max_steps_in_flight() const { return impl_->options.steps_in_flight; }

absl::StatusOr<uint64_t> ModelRunner::Submit(const SchedulerOutput& output) {
  return impl_->Submit(output);
}

absl::StatusOr<ModelRunnerOutput> ModelRunner::Collect(uint64_t ticket) {
  return impl_->Collect(ticket);
}

void ModelRunner::AbandonSubmitted() {
  // Their caches advanced at submit: back to where the scheduler has them.
  for (const auto& [ticket, pass] : impl_->submitted) Impl::Undo(pass);
  impl_->submitted.clear();
}

absl::Status ModelRunner::Impl::Prepare(const SchedulerOutput& out, Pass& pass,
                                        std::vector<int64_t>& packed) {
  for (uint64_t id : out.preempted) {
    auto found = requests.find(id);
    if (found == requests.end()) continue;
    ResetCache(*found->second);
    // Read again from its first token: the prompt's logprobs too.
    if (!found->second->prompt_logprobs_sent) found->second->prompt_gathered.clear();
    if (draft) draft->Reset(id, 0);
  }
  std::vector<Request*>& scheduled = pass.scheduled;
  std::vector<models::SequenceChunk>& chunks = pass.chunks;
  for (const ScheduledRequest& s : out.scheduled) {
    auto found = requests.find(s.id);
    if (found == requests.end()) {
      return absl::InternalError(absl::StrCat("request ", s.id, " is not in the model runner"));
    }
    Request& r = *found->second;
    models::KvCache& cache = r.cache;
    if (cache.length != s.num_computed_tokens) {
      // A request that joined (or resumed) on a cached prefix: the blocks
      // already hold its first tokens.
      if (cache.length != 0 || !cache.paged()) {
        return absl::InternalError(absl::StrCat("request ", s.id, ": the cache holds ",
                                                cache.length, " tokens, the scheduler says ",
                                                s.num_computed_tokens));
      }
      cache.length = s.num_computed_tokens;
      cache.token_ids.assign(s.token_ids.begin(), s.token_ids.begin() + s.num_computed_tokens);
      if (draft) draft->Reset(s.id, s.num_computed_tokens);
    }
    if (cache.paged()) cache.block_table.assign(s.block_table.begin(), s.block_table.end());
    const int64_t drafts = static_cast<int64_t>(s.draft_token_ids.size());
    const auto first = s.token_ids.begin() + s.num_computed_tokens;
    packed.insert(packed.end(), first, first + (s.num_tokens - drafts));
    packed.insert(packed.end(), s.draft_token_ids.begin(), s.draft_token_ids.end());
    // A prompt chunk of a request that wants prompt logprobs: logits at
    // each of its positions (row j: the distribution of token j + 1).
    const bool all_rows = r.prompt_logprobs && !r.prompt_logprobs_sent && drafts == 0 &&
                          s.num_computed_tokens < r.prompt_tokens;
    chunks.push_back({&cache, s.num_tokens, all_rows ? s.num_tokens : s.samples ? 1 + drafts : 1});
    pass.prompt_rows.push_back(all_rows);
    pass.gathered.push_back(r.prompt_gathered.size());
    pass.lengths.push_back(cache.length);
    scheduled.push_back(&r);
  }
  return absl::OkStatus();
}

void ModelRunner::Impl::Undo(const Pass& pass) {
  for (size_t i = 0; i < pass.scheduled.size(); ++i) {
    models::KvCache& cache = pass.scheduled[i]->cache;
    cache.length = pass.lengths[i];
    pass.scheduled[i]->prompt_gathered.resize(pass.gathered[i]);
    if (static_cast<int64_t>(cache.token_ids.size()) > pass.lengths[i]) {
      cache.token_ids.resize(static_cast<size_t>(pass.lengths[i]));
    }
  }
}

absl::StatusOr<ModelRunnerOutput> ModelRunner::Impl::Execute(const SchedulerOutput& out) {
  c10::InferenceMode inference;
  Pass pass;
  std::vector<int64_t> packed;
  ACCEL_RETURN_IF_ERROR(Prepare(out, pass, packed));
  if (out.scheduled.empty()) return ModelRunnerOutput();
  std::vector<models::SequenceChunk>& chunks = pass.chunks;
  // A step of one-token decodes only, padded to its bucket.
  const int64_t batch = static_cast<int64_t>(chunks.size());
  std::optional<int64_t> bucket;
  const bool decodes_only =
      std::all_of(chunks.begin(), chunks.end(), [](const models::SequenceChunk& c) {
        return c.tokens == 1 && c.logit_tokens == 1 && c.cache->paged();
      });
  if (!options.decode_buckets.empty() && decodes_only) {
    bucket = DecodeBucketFor(options.decode_buckets, batch);
  }
  if (bucket) {
    // Padded rows: token 0 at position 0 of the scratch block, each its own
    // cache (a step's caches are distinct); their logits come after every
    // real row's and are never read.
    for (int64_t p = 0; p < *bucket - batch; ++p) {
      models::KvCache& pad = padding[static_cast<size_t>(p)];
      pad.Clear();
      pad.store = store.get();
      pad.block_table.assign(1, scratch_block);
      chunks.push_back({&pad, 1, 1});
      packed.push_back(0);
    }
    ++padded_steps;
    padded_rows += *bucket - batch;
  }
  absl::StatusOr<at::Tensor> forwarded;
  if (bucket) {
    forwarded = RunPaddedDecode(*bucket, packed, chunks, batch);
    if (!forwarded.ok()) {
      // The padded step is an optimisation: one that fails (a capture
      // libtorch refuses, blocks the CUDA kernels do not take) turns it off
      // for good, and this step runs unpadded. The caches have not moved.
      std::fprintf(stderr, "accel: padded decode steps (CUDA graphs) off: %s\n",
                   forwarded.status().ToString().c_str());
      options.decode_buckets.clear();
      chunks.resize(static_cast<size_t>(batch));
      packed.resize(static_cast<size_t>(batch));
      bucket.reset();
    }
  }
  bool ran_static = false;
  if (!bucket && decodes_only && unpadded_static) {
    forwarded = RunUnpaddedStaticDecode(packed, chunks);
    ran_static = forwarded.ok();
    if (!ran_static) {
      // As the padded step: an optimisation, off for good once it fails; the
      // caches have not moved (a row's key and value written at its next
      // position are written again below).
      std::fprintf(stderr, "accel: unpadded static decode steps off: %s\n",
                   forwarded.status().ToString().c_str());
      unpadded_static = false;
    }
  }
  if (!bucket && !ran_static) {
    at::Tensor input_ids;
    ACCEL_RETURN_IF_ERROR(CallTorch([&] { input_ids = at::tensor(packed, at::kLong); }));
    forwarded = model->Forward(input_ids, chunks, models::Logits::kLastOfEach, dispatched);
  }
  if (!forwarded.ok()) {
    Undo(pass);
    return forwarded.status();
  }
  chunks.resize(static_cast<size_t>(batch));  // the padded rows' logits are never read
  return Sample(out, pass, *std::move(forwarded));
}

absl::StatusOr<ModelRunnerOutput> ModelRunner::Impl::Sample(const SchedulerOutput& out,
                                                            const Pass& pass, at::Tensor logits) {
  ModelRunnerOutput result;
  const std::vector<Request*>& scheduled = pass.scheduled;
  const std::vector<models::SequenceChunk>& chunks = pass.chunks;
  const std::vector<bool>& prompt_rows = pass.prompt_rows;
  // Every request that read its whole input samples (verifying its drafts)
  // before any state moves on: if sampling fails, the caches go back to
  // where they were.
  const absl::Status sampled = CallTorch([&] {
    // Rows that need only their argmax (plain greedy, no logits processor,
    // no drafts, no logprobs): all of them in one argmax where the logits
    // are, so that a step of greedy rows on a CUDA device copies back their
    // tokens, not [rows, vocab] floats, and no row goes through the
    // sampler's float64 copy. The other rows are sampled from a host copy.
    // Likewise rows sampled with temperature, top-k, top-p and min-p alone
    // (the OpenAI API's default is temperature 1): all of them at once where
    // the logits are (Sampler::NextRows), each with its own generator.
    std::vector<int64_t> argmax_rows, drawn_rows;
    std::vector<Sampler*> drawn_samplers;
    std::vector<int64_t> argmax_slot(out.scheduled.size(), -1);
    std::vector<int64_t> drawn_slot(out.scheduled.size(), -1);
    int64_t host_rows = 0;
    {
      int64_t row = 0;
      for (size_t i = 0; i < out.scheduled.size(); ++i) {
        const ScheduledRequest& s = out.scheduled[i];
        Request& r = *scheduled[i];
        const int64_t rows = chunks[i].logit_tokens;
        const bool plain = s.samples && !prompt_rows[i] && rows == 1 && s.draft_token_ids.empty() &&
                           r.processor == nullptr && !r.logprobs;
        if (plain && r.sampler.plain_greedy()) {
          argmax_slot[i] = static_cast<int64_t>(argmax_rows.size());
          argmax_rows.push_back(row);
        } else if (plain && r.sampler.batch_samplable()) {
          drawn_slot[i] = static_cast<int64_t>(drawn_rows.size());
          drawn_rows.push_back(row);
          drawn_samplers.push_back(&r.sampler);
        } else if (s.samples || prompt_rows[i]) {
          host_rows += rows;
        }
        row += rows;
      }
    }
    const auto rows_of = [&](const std::vector<int64_t>& which) {
      return static_cast<int64_t>(which.size()) == logits.size(0)
                 ? logits
                 : logits.index_select(0, Int64sOn(which, logits.device()));
    };
    std::vector<int64_t> argmax_ids, drawn_ids;
    if (!argmax_rows.empty()) {
      const at::Tensor ids = rows_of(argmax_rows).argmax(-1).to(at::kCPU).contiguous();
      argmax_ids.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + ids.numel());
    }
    if (!drawn_rows.empty()) drawn_ids = Sampler::NextRows(rows_of(drawn_rows), drawn_samplers);
    const at::Tensor host_logits =
        host_rows == 0 ? at::Tensor() : (logits.is_cpu() ? logits : logits.to(at::kCPU));
    int64_t row = 0;
    for (size_t i = 0; i < out.scheduled.size(); ++i) {
      const ScheduledRequest& s = out.scheduled[i];
      Request& r = *scheduled[i];
      const int64_t rows = chunks[i].logit_tokens;
      if (argmax_slot[i] >= 0 || drawn_slot[i] >= 0) {
        SampledTokens t;
        t.id = s.id;
        t.token_ids = {argmax_slot[i] >= 0 ? argmax_ids[static_cast<size_t>(argmax_slot[i])]
                                           : drawn_ids[static_cast<size_t>(drawn_slot[i])]};
        result.sampled.push_back(std::move(t));
        row += rows;
        continue;
      }
      if (!s.samples && !prompt_rows[i]) {
        row += rows;
        continue;
      }
      const at::Tensor all = host_logits.narrow(0, row, rows);
      row += rows;
      if (prompt_rows[i]) GatherPromptLogprobs(r, s, all);
      if (!s.samples) continue;
      // With every position's logits, the sampling row is the last.
      const at::Tensor own = prompt_rows[i] ? all.narrow(0, rows - 1, 1) : all;
      at::Tensor draft_probs;
      if (r.draft_probs.defined() && !s.draft_token_ids.empty() &&
          r.draft_probs.size(0) >= static_cast<int64_t>(s.draft_token_ids.size())) {
        draft_probs = r.draft_probs;
      }
      // The chunk reaches the end of the request's tokens: the drafts come
      // after all of them.
      Verification v = VerifyDrafts(r.sampler, own, s.token_ids, s.draft_token_ids, draft_probs,
                                    r.processor.get());
      SampledTokens t;
      t.id = s.id;
      t.num_drafts = static_cast<int64_t>(s.draft_token_ids.size());
      t.num_accepted_drafts = v.accepted;
      t.token_ids = std::move(v.token_ids);
      if (r.logprobs) {
        for (size_t j = 0; j < t.token_ids.size(); ++j) {
          const at::Tensor log_probs = at::log_softmax(own[static_cast<int64_t>(j)], -1);
          t.logprobs.push_back(log_probs[t.token_ids[j]].item<float>());
          std::vector<TokenLogprob> top;
          if (r.top_logprobs > 0) {
            const auto [values, ids] =
                at::topk(log_probs, std::min(r.top_logprobs, log_probs.size(0)));
            for (int64_t k = 0; k < values.size(0); ++k) {
              top.push_back({ids[k].item<int64_t>(), values[k].item<float>()});
            }
          }
          t.top_logprobs.push_back(std::move(top));
        }
      }
      result.sampled.push_back(std::move(t));
    }
  });
  if (!sampled.ok()) {
    Undo(pass);
    return sampled;
  }
  // Rejected drafts leave the cache: its length goes back to the last
  // accepted one (their keys and values are overwritten by the next step).
  for (size_t i = 0, t = 0; i < out.scheduled.size(); ++i) {
    const ScheduledRequest& s = out.scheduled[i];
    if (!s.samples) continue;
    const SampledTokens& got = result.sampled[t++];
    const int64_t rejected = got.num_drafts - got.num_accepted_drafts;
    models::KvCache& cache = scheduled[i]->cache;
    cache.length -= rejected;
    if (static_cast<int64_t>(cache.token_ids.size()) > cache.length) {
      cache.token_ids.resize(static_cast<size_t>(cache.length));
    }
    scheduled[i]->draft_probs = at::Tensor();
  }
  // The next step's drafts, for requests that go on decoding.
  const int64_t decoding = static_cast<int64_t>(result.sampled.size());
  const bool drafting =
      options.speculative.enabled() && (options.speculative.disable_by_batch_size <= 0 ||
                                        decoding < options.speculative.disable_by_batch_size);
  if (ngram || draft) {
    std::vector<std::vector<int64_t>> ids(out.scheduled.size());
    std::vector<internal::DraftProposer::Job> jobs;
    for (size_t i = 0, t = 0; i < out.scheduled.size(); ++i) {
      const ScheduledRequest& s = out.scheduled[i];
      Request& r = *scheduled[i];
      int64_t limit = 0;
      if (s.samples) {
        const SampledTokens& got = result.sampled[t++];
        // Its tokens before the step, the accepted drafts and the new token.
        ids[i].assign(s.token_ids.begin(), s.token_ids.end());
        ids[i].insert(ids[i].end(), got.token_ids.begin(), got.token_ids.end());
        limit = drafting ? DraftLimit(r, ids[i]) : 0;
      } else {
        ids[i].assign(s.token_ids.begin(), s.token_ids.end());
      }
      if (ngram && limit > 0) {
        std::vector<int64_t> proposal = ngram->Propose(ids[i], limit);
        if (!proposal.empty()) result.drafts[s.id] = std::move(proposal);
      }
      if (draft) {
        internal::DraftProposer::Job job;
        job.id = s.id;
        job.ids = ids[i];
        job.computed = r.cache.length;
        job.block_table = s.block_table;
        job.max_drafts = limit;
        jobs.push_back(job);
      }
    }
    if (draft && !jobs.empty()) {
      absl::StatusOr<std::map<uint64_t, internal::DraftProposer::Proposal>> proposals =
          draft->Run(jobs);
      if (!proposals.ok()) {
        Undo(pass);
        return proposals.status();
      }
      for (auto& [id, proposal] : *proposals) {
        if (proposal.tokens.empty()) continue;
        requests.at(id)->draft_probs = proposal.probs;
        result.drafts[id] = std::move(proposal.tokens);
      }
    }
  }
  // The prompt's logprobs go with the request's first token, once the step
  // can no longer fail.
  for (size_t i = 0, t = 0; i < out.scheduled.size(); ++i) {
    if (!out.scheduled[i].samples) continue;
    Request& r = *scheduled[i];
    SampledTokens& got = result.sampled[t++];
    if (r.prompt_logprobs && !r.prompt_logprobs_sent) {
      got.prompt_logprobs = std::move(r.prompt_gathered);
      r.prompt_gathered.clear();
      r.prompt_logprobs_sent = true;
    }
  }
  return result;
}

absl::StatusOr<uint64_t> ModelRunner::Impl::Submit(const SchedulerOutput& out) {
  c10::InferenceMode inference;
  Pass pass;
  pass.out = out;
  std::vector<int64_t> packed;
  ACCEL_RETURN_IF_ERROR(Prepare(out, pass, packed));
  if (out.scheduled.empty()) {
    return absl::InvalidArgumentError("a step submitted with no request scheduled");
  }
  at::Tensor input_ids;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { input_ids = at::tensor(packed, at::kLong); }));
  absl::StatusOr<std::unique_ptr<models::PendingLogits>> pending =
      model->Submit(input_ids, pass.chunks, models::Logits::kLastOfEach, dispatched);
  if (!pending.ok()) {
    Undo(pass);
    return pending.status();
  }
  pass.pending = *std::move(pending);
  const uint64_t ticket = next_ticket++;
  submitted.emplace(ticket, std::move(pass));
  return ticket;
}

absl::StatusOr<ModelRunnerOutput> ModelRunner::Impl::Collect(uint64_t ticket) {
  c10::InferenceMode inference;
  auto found = submitted.find(ticket);
  if (found == submitted.end()) {
    return absl::InternalError(absl::StrCat("step ", ticket, " is not in flight"));
  }
  Pass pass = std::move(found->second);
  submitted.erase(found);
  absl::StatusOr<at::Tensor> logits = pass.pending->Wait();
  if (!logits.ok()) {
    Undo(pass);
    return logits.status();
  }
  return Sample(pass.out, pass, *std::move(logits));
}

int64_t ModelRunner::num_blocks() const { return impl_->options.num_blocks; }
int64_t ModelRunner::block_size() const { return impl_->options.block_size; }
bool ModelRunner::supports_prefix_caching() const { return impl_->prefix_caching; }
int64_t ModelRunner::position_limit() const { return impl_->position_limit; }
int64_t ModelRunner::lookahead_tokens() const {
  return impl_->draft ? impl_->options.speculative.num_speculative_tokens : 0;
}

int64_t ModelRunner::padded_decode_steps() const { return impl_->padded_steps; }
int64_t ModelRunner::unpadded_static_decode_steps() const { return impl_->unpadded_static_steps; }
int64_t ModelRunner::padded_decode_rows() const { return impl_->padded_rows; }

int64_t ModelRunner::kv_cache_bytes() const {
  // The store, and contiguous caches that LongRoPE recomputes made.
  int64_t bytes = impl_->store->bytes();
  for (const auto& [id, r] : impl_->requests) bytes += r->cache.bytes();
  if (impl_->draft) bytes += impl_->draft->kv_cache_bytes();
  return bytes;
}

}  // namespace accel::engine
