// accel-train-lm: trains a small Llama-family language model on a text file
// with train::Accelerator, on one process or many (accel-launch), and saves
// it as a HuggingFace-format folder that accel-serve and accel-generate load.
//
//   accel-launch --num_processes 2 accel-train-lm --text corpus.txt --out /tmp/lm
//       --max_steps 300 --grad_accum 2 --save_every 100   (one command line)
//
// The tokenizer (byte-level BPE) is learned by accel's own trainer from the
// training part of the text only; the last --heldout_fraction of the text
// (from a line start) is held out, and the held-out perplexity is printed
// next to a unigram model's (add-one smoothed counts of the training tokens)
// as one JSON line.
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <torch/nn/module.h>
#include <torch/optim/adamw.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "core/status.h"
#include "core/tool_main.h"
#include "loader/loader.h"
#include "models/causal_lm.h"
#include "models/load_model.h"
#include "models/make_model.h"
#include "tokenizer/tokenizer.h"
#include "train/accelerator.h"

ABSL_FLAG(std::string, text, "", "Training text (UTF-8). Required.");
ABSL_FLAG(std::string, out, "", "Output folder for the trained model. Required.");
ABSL_FLAG(std::string, project_dir, "", "Checkpoints and logs (default: OUT/run).");
ABSL_FLAG(int64_t, vocab_size, 1024, "Vocabulary: 256 bytes, 2 special tokens, the rest merges.");
ABSL_FLAG(int64_t, hidden_size, 128, "Model width.");
ABSL_FLAG(int64_t, num_layers, 2, "Decoder layers.");
ABSL_FLAG(int64_t, num_heads, 4, "Attention heads.");
ABSL_FLAG(int64_t, seq_len, 64, "Tokens per training window.");
ABSL_FLAG(int64_t, batch_size, 8, "Windows per batch per process.");
ABSL_FLAG(int64_t, grad_accum, 1, "Gradient accumulation steps.");
ABSL_FLAG(int64_t, max_steps, 100, "Optimizer steps.");
ABSL_FLAG(double, lr, 3e-3, "Peak learning rate (AdamW, cosine schedule with warmup).");
ABSL_FLAG(int64_t, warmup, 10, "Warmup optimizer steps.");
ABSL_FLAG(double, weight_decay, 0.01, "AdamW weight decay.");
ABSL_FLAG(std::string, mixed_precision, "",
          "no, bf16 or fp16; empty: what accel-launch or its config file set "
          "(ACCELERATE_MIXED_PRECISION), else no.");
ABSL_FLAG(int64_t, save_every, 0, "save_state every N optimizer steps (0: never).");
ABSL_FLAG(bool, resume, false, "Resume from the latest checkpoint in the project folder.");
ABSL_FLAG(int64_t, stop_after, 0,
          "Stop (as if interrupted) after this many optimizer steps, without saving the model; "
          "0: run to --max_steps. For testing resume.");
ABSL_FLAG(int64_t, log_every, 10, "Log the training loss every N optimizer steps.");
ABSL_FLAG(double, heldout_fraction, 0.1,
          "Share of the text (bytes, cut at a line start) held out for evaluation.");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the weights, the shuffle and everything else.");

namespace accel {
namespace {

using train::Accelerator;
using train::Batch;

// The optimizer step count, saved with each checkpoint
// (register_for_checkpointing). The loader's epoch and position are saved by
// save_state itself.
struct Progress : train::Checkpointable {
  int64_t optimizer_steps = 0;
  std::map<std::string, at::Tensor> StateDict() const override {
    return {{"progress", at::tensor({optimizer_steps}, at::kLong)}};
  }
  absl::Status LoadStateDict(const std::map<std::string, at::Tensor>& state) override {
    auto it = state.find("progress");
    if (it == state.end() || it->second.numel() != 1) {
      return absl::InvalidArgumentError("progress state: expected 1 number");
    }
    optimizer_steps = it->second[0].item<int64_t>();
    return absl::OkStatus();
  }
};

// Each parameter once: tied weights (the embedding and the output head) are
// one tensor listed under two names, and an optimizer given it twice would
// update it twice per step.
std::vector<at::Tensor> UniqueParameters(torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::set<const void*> seen;
  for (const at::Tensor& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

// Mean next-token cross-entropy of windows [B, T+1].
absl::StatusOr<at::Tensor> WindowLoss(models::CausalLM& model, const at::Tensor& windows) {
  const int64_t b = windows.size(0), t = windows.size(1) - 1;
  at::Tensor inputs = windows.narrow(1, 0, t).reshape({-1}).contiguous();
  at::Tensor targets = windows.narrow(1, 1, t).reshape({-1});
  std::vector<models::SequenceChunk> chunks(static_cast<size_t>(b), {nullptr, t});
  ACCEL_ASSIGN_OR_RETURN(at::Tensor logits,
                         model.Forward(inputs, chunks, models::Logits::kAll, nullptr));
  at::Tensor loss;
  ACCEL_RETURN_IF_ERROR(CallTorch([&] { loss = at::cross_entropy_loss(logits, targets); }));
  return loss;
}

// Non-overlapping windows of seq_len + 1 tokens (each window's last token is
// the next one's first).
at::Tensor Windows(const std::vector<int64_t>& ids, int64_t seq_len) {
  const int64_t n = (static_cast<int64_t>(ids.size()) - 1) / seq_len;
  at::Tensor all = at::tensor(ids, at::kLong);
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < n; ++i) rows.push_back(all.narrow(0, i * seq_len, seq_len + 1));
  return rows.empty() ? at::empty({0, seq_len + 1}, at::kLong) : at::stack(rows);
}

absl::Status Train() {
  const std::string text_path = absl::GetFlag(FLAGS_text);
  const std::string out = absl::GetFlag(FLAGS_out);
  if (text_path.empty()) return absl::InvalidArgumentError("--text is required");
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  const int64_t seq_len = absl::GetFlag(FLAGS_seq_len);
  if (seq_len < 2) return absl::InvalidArgumentError("--seq_len must be at least 2");
  if (absl::GetFlag(FLAGS_max_steps) < 1) {
    return absl::InvalidArgumentError("--max_steps must be at least 1");
  }
  const double heldout = absl::GetFlag(FLAGS_heldout_fraction);
  if (heldout <= 0 || heldout >= 0.5) {
    return absl::InvalidArgumentError("--heldout_fraction must be in (0, 0.5)");
  }
  ACCEL_ASSIGN_OR_RETURN(std::string text, loader::ReadFile(text_path));
  // The held-out text is the tail from a line start, and the tokenizer never
  // sees it: a vocabulary learned from it would flatter the held-out figure.
  size_t cut = static_cast<size_t>(static_cast<double>(text.size()) * (1 - heldout));
  cut = text.find('\n', cut);
  cut = cut == std::string::npos ? text.size() : cut + 1;
  const std::string train_text = text.substr(0, cut);
  const std::string heldout_text = text.substr(cut);
  std::string project = absl::GetFlag(FLAGS_project_dir);
  if (project.empty()) project = out + "/run";

  train::SetSeed(absl::GetFlag(FLAGS_seed));
  train::AcceleratorOptions options;
  options.mixed_precision = absl::GetFlag(FLAGS_mixed_precision);
  options.gradient_accumulation_steps = absl::GetFlag(FLAGS_grad_accum);
  options.project_config.project_dir = project;
  options.project_config.automatic_checkpoint_naming = true;
  options.project_config.total_limit = 2;
  options.log_with = {"jsonl"};
  ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<Accelerator> acc, Accelerator::Create(options));

  // The initial model (random weights, and the tokenizer learned from the
  // text), made once by the main process.
  const std::string init = project + "/init";
  if (acc->is_main_process() && !std::filesystem::exists(init + "/config.json")) {
    models::MakeModelOptions make;
    make.family = "llama";
    make.vocab_size = absl::GetFlag(FLAGS_vocab_size);
    make.hidden_size = absl::GetFlag(FLAGS_hidden_size);
    make.num_layers = absl::GetFlag(FLAGS_num_layers);
    make.num_heads = absl::GetFlag(FLAGS_num_heads);
    make.max_position_embeddings = std::max<int64_t>(256, seq_len);
    make.tie_word_embeddings = true;
    make.seed = absl::GetFlag(FLAGS_seed);
    make.tokenizer_text = train_text;
    ACCEL_RETURN_IF_ERROR(models::MakeModel(init, make).status());
  }
  ACCEL_RETURN_IF_ERROR(acc->WaitForEveryone());
  models::ModelLoadOptions load;
  load.device_map = "cpu";
  load.dtype = "float32";
  ACCEL_ASSIGN_OR_RETURN(models::LoadedModel loaded, models::LoadModel(init, load));
  std::shared_ptr<models::CausalLM> model = loaded.model;
  for (at::Tensor& p : model->parameters()) p.set_requires_grad(true);

  ACCEL_ASSIGN_OR_RETURN(tokenizer::Tokenizer tokenizer,
                         tokenizer::Tokenizer::FromFile(init + "/tokenizer.json"));
  ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> train_ids, tokenizer.Encode(train_text, false));
  ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> heldout_ids, tokenizer.Encode(heldout_text, false));
  const size_t token_count = train_ids.size() + heldout_ids.size();
  at::Tensor train_windows = Windows(train_ids, seq_len);
  at::Tensor heldout_windows = Windows(heldout_ids, seq_len);
  if (train_windows.size(0) == 0 || heldout_windows.size(0) == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        text_path, ": ", token_count, " tokens are too few for windows of --seq_len ", seq_len));
  }
  ACCEL_ASSIGN_OR_RETURN(auto dataset, train::TensorDataset::Create({{"ids", train_windows}}));
  train::DataLoaderOptions loader_options;
  loader_options.batch_size = absl::GetFlag(FLAGS_batch_size);
  loader_options.shuffle = true;
  loader_options.drop_last = true;
  ACCEL_ASSIGN_OR_RETURN(auto base_loader, train::DataLoader::Create(dataset, loader_options));

  const std::vector<at::Tensor> params = UniqueParameters(*model);
  auto optimizer = std::make_shared<torch::optim::AdamW>(
      params, torch::optim::AdamWOptions(absl::GetFlag(FLAGS_lr))
                  .weight_decay(absl::GetFlag(FLAGS_weight_decay)));
  const int64_t max_steps = absl::GetFlag(FLAGS_max_steps);
  // The scheduler ticks num_processes times per optimizer step (Accelerate's rule).
  std::shared_ptr<train::LRScheduler> schedule =
      train::MakeCosineWarmupLR(*optimizer, absl::GetFlag(FLAGS_warmup) * acc->num_processes(),
                                max_steps * acc->num_processes());
  ACCEL_ASSIGN_OR_RETURN(train::PreparedModel * prepared, acc->PrepareModel(model));
  ACCEL_ASSIGN_OR_RETURN(train::PreparedOptimizer * opt, acc->PrepareOptimizer(optimizer));
  ACCEL_ASSIGN_OR_RETURN(train::PreparedScheduler * sched, acc->PrepareScheduler(schedule));
  ACCEL_ASSIGN_OR_RETURN(std::unique_ptr<train::DataLoader> loader,
                         acc->PrepareDataLoader(*base_loader));
  if (loader->size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batch_size ", loader_options.batch_size, " leaves no full batch of the ",
                     train_windows.size(0), " training windows on each of ", acc->num_processes(),
                     " processes"));
  }
  auto progress = std::make_shared<Progress>();
  acc->RegisterForCheckpointing(progress);

  if (absl::GetFlag(FLAGS_resume)) {
    // The loader continues the saved epoch where it was.
    ACCEL_RETURN_IF_ERROR(acc->LoadState());
    acc->Print(absl::StrFormat("resumed at optimizer step %d (epoch %d, batch %d)",
                               progress->optimizer_steps, loader->position().epoch,
                               loader->position().batches_yielded));
  }
  ACCEL_RETURN_IF_ERROR(
      acc->InitTrackers("train_lm", {{"lr", absl::StrCat(absl::GetFlag(FLAGS_lr))},
                                     {"batch_size", absl::StrCat(loader_options.batch_size)},
                                     {"num_processes", absl::StrCat(acc->num_processes())}}));

  double loss_sum = 0;
  int64_t loss_count = 0;
  double last_loss = 0;
  // Each pass is one epoch; the loader moves to the next when a pass completes.
  while (progress->optimizer_steps < max_steps) {
    ACCEL_RETURN_IF_ERROR(loader->Start());
    while (progress->optimizer_steps < max_steps) {
      ACCEL_ASSIGN_OR_RETURN(std::optional<Batch> batch, loader->Next());
      if (!batch) break;
      ACCEL_ASSIGN_OR_RETURN(train::AccumulateScope scope, acc->Accumulate({prepared}));
      at::Tensor loss;
      {
        ACCEL_ASSIGN_OR_RETURN(train::ForwardScope forward, acc->BeginForward(*prepared));
        ACCEL_ASSIGN_OR_RETURN(loss, WindowLoss(*model, batch->at("ids")));
      }
      ACCEL_RETURN_IF_ERROR(acc->Backward(loss));
      loss_sum += loss.item<double>();
      ++loss_count;
      if (!acc->sync_gradients()) continue;
      ACCEL_RETURN_IF_ERROR(acc->ClipGradNorm(params, 1.0).status());
      ACCEL_RETURN_IF_ERROR(opt->Step());
      ACCEL_RETURN_IF_ERROR(sched->Step());
      opt->ZeroGrad();
      ++progress->optimizer_steps;
      const int64_t step = progress->optimizer_steps;
      if (step % absl::GetFlag(FLAGS_log_every) == 0 || step == max_steps) {
        ACCEL_ASSIGN_OR_RETURN(at::Tensor mean,
                               acc->Reduce(at::tensor({loss_sum / static_cast<double>(loss_count)}),
                                           train::Reduction::kMean));
        last_loss = mean.item<double>();
        acc->Print(absl::StrFormat("step %d loss %.4f lr %.2e", step, last_loss,
                                   schedule->last_lrs().at(0)));
        ACCEL_RETURN_IF_ERROR(acc->Log({{"loss", last_loss}}, step));
        loss_sum = 0;
        loss_count = 0;
      }
      const int64_t save_every = absl::GetFlag(FLAGS_save_every);
      if (save_every > 0 && step % save_every == 0) {
        ACCEL_ASSIGN_OR_RETURN(std::string dir, acc->SaveState());
        acc->Print("saved " + dir);
      }
      if (step == absl::GetFlag(FLAGS_stop_after)) {
        acc->Print(absl::StrFormat("stopping after optimizer step %d (--stop_after)", step));
        return acc->WaitForEveryone();
      }
    }
  }
  ACCEL_RETURN_IF_ERROR(acc->EndTraining());

  // Held-out perplexity against the unigram baseline.
  double heldout_loss = 0;
  {
    at::NoGradGuard no_grad;
    double sum = 0;
    int64_t windows = heldout_windows.size(0);
    for (int64_t i = 0; i < windows; i += 8) {
      at::Tensor chunk = heldout_windows.narrow(0, i, std::min<int64_t>(8, windows - i));
      ACCEL_ASSIGN_OR_RETURN(at::Tensor loss, WindowLoss(*model, chunk));
      sum += loss.item<double>() * static_cast<double>(chunk.size(0));
    }
    heldout_loss = sum / static_cast<double>(windows);
  }
  const int64_t vocab = loaded.config.vocab_size;
  std::vector<double> counts(static_cast<size_t>(vocab), 1.0);  // add-one
  for (int64_t id : train_ids) counts[static_cast<size_t>(id)] += 1;
  const double total = static_cast<double>(train_ids.size() + static_cast<size_t>(vocab));
  double unigram = 0;
  int64_t targets = 0;
  const at::Tensor flat = heldout_windows.narrow(1, 1, seq_len).reshape({-1});
  for (int64_t k = 0; k < flat.size(0); ++k) {
    unigram -= std::log(counts[static_cast<size_t>(flat[k].item<int64_t>())] / total);
    ++targets;
  }
  unigram /= static_cast<double>(targets);
  // Every rank: a sharded (FSDP) model is gathered by all of them.
  ACCEL_RETURN_IF_ERROR(acc->SaveModel(*prepared, out, "10GB"));
  if (acc->is_main_process()) {
    for (const char* name :
         {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}) {
      ACCEL_ASSIGN_OR_RETURN(std::string bytes, loader::ReadFile(init + "/" + name));
      ACCEL_RETURN_IF_ERROR(loader::WriteFileAtomically(out + "/" + name, bytes));
    }
    std::cout << absl::StrFormat(
                     "{\"steps\": %d, \"processes\": %d, \"train_loss\": %.6f, "
                     "\"heldout_loss\": %.6f, \"heldout_perplexity\": %.4f, "
                     "\"unigram_loss\": %.6f, \"unigram_perplexity\": %.4f}",
                     progress->optimizer_steps, acc->num_processes(), last_loss, heldout_loss,
                     std::exp(heldout_loss), unigram, std::exp(unigram))
              << std::endl;
  }
  return acc->WaitForEveryone();
}

int Run(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "accel-train-lm --text FILE --out DIR [flags]: trains a small Llama-family model with "
      "train::Accelerator (run it under accel-launch for several processes).");
  absl::ParseCommandLine(argc, argv);
  absl::Status status = Train();
  if (!status.ok()) {
    std::cerr << "accel-train-lm: " << status.message() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace accel

int main(int argc, char** argv) {
  return accel::ToolMain("accel-train-lm", argc, argv, accel::Run);
}
