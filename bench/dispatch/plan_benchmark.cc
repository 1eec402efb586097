// How long device-map planning takes on big trees: a 1000-layer Llama-shaped
// model and a Qwen3-Next-80B-shaped MoE (48 layers x 512 experts, the case
// where transformers' planner took 60 s: its PR #41548). The baseline, from
// the same run, is one linear pass over every tensor (ComputeModuleSizes).
//
//   build/bin/accel-bench-plan [--repeats 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "dispatch/device_map.h"
#include "dispatch/module_tree.h"

namespace {

using accel::dispatch::ModuleTree;

void Linear(ModuleTree& t, int parent, const std::string& name, int64_t in, int64_t out) {
  int id = t.AddChild(parent, name, "Linear");
  t.AddParam(id, {"weight", {out, in}, c10::ScalarType::BFloat16});
}

// Llama-shaped: embed, `layers` decoder layers of 9 tensors, norm, head.
ModuleTree Dense(int layers, int64_t h, int64_t inter) {
  ModuleTree t("LlamaForCausalLM");
  int model = t.AddChild(0, "model", "LlamaModel");
  t.AddParam(t.AddChild(model, "embed_tokens", "Embedding"),
             {"weight", {128256, h}, c10::ScalarType::BFloat16});
  int list = t.AddChild(model, "layers", "ModuleList");
  for (int i = 0; i < layers; ++i) {
    int block = t.AddChild(list, std::to_string(i), "LlamaDecoderLayer");
    int attn = t.AddChild(block, "self_attn", "LlamaAttention");
    for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) Linear(t, attn, p, h, h);
    int mlp = t.AddChild(block, "mlp", "LlamaMLP");
    Linear(t, mlp, "gate_proj", h, inter);
    Linear(t, mlp, "up_proj", h, inter);
    Linear(t, mlp, "down_proj", inter, h);
    for (const char* n : {"input_layernorm", "post_attention_layernorm"}) {
      t.AddParam(t.AddChild(block, n, "LlamaRMSNorm"), {"weight", {h}, c10::ScalarType::BFloat16});
    }
  }
  t.AddParam(t.AddChild(model, "norm", "LlamaRMSNorm"), {"weight", {h}, c10::ScalarType::BFloat16});
  Linear(t, 0, "lm_head", h, 128256);
  return t;
}

// Qwen3-Next-80B-shaped MoE: 48 layers, 512 experts of 3 linears each.
ModuleTree Moe() {
  const int64_t h = 2048, expert = 512;
  ModuleTree t("Qwen3NextForCausalLM");
  int model = t.AddChild(0, "model", "Qwen3NextModel");
  t.AddParam(t.AddChild(model, "embed_tokens", "Embedding"),
             {"weight", {151936, h}, c10::ScalarType::BFloat16});
  int list = t.AddChild(model, "layers", "ModuleList");
  for (int i = 0; i < 48; ++i) {
    int block = t.AddChild(list, std::to_string(i), "Qwen3NextDecoderLayer");
    int attn = t.AddChild(block, "self_attn", "Qwen3NextAttention");
    for (const char* p : {"q_proj", "k_proj", "v_proj", "o_proj"}) Linear(t, attn, p, h, h);
    int mlp = t.AddChild(block, "mlp", "Qwen3NextSparseMoeBlock");
    Linear(t, mlp, "gate", h, 512);
    int experts = t.AddChild(mlp, "experts", "ModuleList");
    for (int e = 0; e < 512; ++e) {
      int ex = t.AddChild(experts, std::to_string(e), "Qwen3NextMLP");
      Linear(t, ex, "gate_proj", h, expert);
      Linear(t, ex, "up_proj", h, expert);
      Linear(t, ex, "down_proj", expert, h);
    }
    for (const char* n : {"input_layernorm", "post_attention_layernorm"}) {
      t.AddParam(t.AddChild(block, n, "Qwen3NextRMSNorm"),
                 {"weight", {h}, c10::ScalarType::BFloat16});
    }
  }
  t.AddParam(t.AddChild(model, "norm", "Qwen3NextRMSNorm"),
             {"weight", {h}, c10::ScalarType::BFloat16});
  Linear(t, 0, "lm_head", h, 151936);
  return t;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double Seconds(const std::function<void()>& fn) {
  auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Report(const char* label, const ModuleTree& tree, const accel::dispatch::MaxMemory& mm,
            const std::vector<std::string>& no_split, int repeats) {
  accel::dispatch::PlanOptions options;
  options.no_split = no_split;
  std::vector<double> baseline, plan;
  size_t entries = 0;
  for (int r = 0; r < repeats; ++r) {
    baseline.push_back(Seconds([&] { accel::dispatch::ComputeModuleSizes(tree); }));
    plan.push_back(Seconds([&] {
      auto map = accel::dispatch::PlanDeviceMap(tree, "auto", mm, options);
      if (!map.ok()) {
        std::fprintf(stderr, "planning failed: %s\n", std::string(map.status().message()).c_str());
        std::exit(1);
      }
      entries = map->entries().size();
    }));
  }
  const size_t tensors = tree.NamedParameters().size();
  std::printf(
      "%-44s %8zu modules %8zu tensors  sizes pass %7.3f s  plan %7.3f s  (x%.1f)  %zu map "
      "entries\n",
      label, static_cast<size_t>(tree.size()), tensors, Median(baseline), Median(plan),
      Median(plan) / Median(baseline), entries);
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 5;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--repeats") == 0) repeats = std::max(1, std::atoi(argv[i + 1]));
  }
  auto mm = accel::dispatch::ParseMaxMemory("0=20GiB,1=20GiB,2=20GiB,3=20GiB,cpu=200GiB");
  std::printf("median of %d runs; baseline: one ComputeModuleSizes pass over the same tree\n",
              repeats);
  ModuleTree dense = Dense(1000, 4096, 14336);
  Report("1000-layer Llama (no_split LlamaDecoderLayer)", dense, *mm, {"LlamaDecoderLayer"},
         repeats);
  Report("1000-layer Llama (no no_split: split to leaves)", dense, *mm, {}, repeats);
  ModuleTree moe = Moe();
  Report("Qwen3-Next-80B MoE (no_split DecoderLayer)", moe, *mm, {"Qwen3NextDecoderLayer"},
         repeats);
  auto small = accel::dispatch::ParseMaxMemory("0=10GiB,1=10GiB,cpu=40GiB");
  Report("Qwen3-Next-80B MoE, 2x10GiB+cpu (spills)", moe, *small, {"Qwen3NextDecoderLayer"},
         repeats);
  Report("Qwen3-Next-80B MoE, no no_split, spills", moe, *small, {}, repeats);
  return 0;
}
