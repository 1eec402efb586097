#include "dispatch/module_tree.h"

#include <functional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

#include "core/dtype.h"
#include "core/json.h"
#include "core/status.h"
#include "dispatch/layer.h"

namespace accel::dispatch {
namespace {

using Json = nlohmann::json;

std::string Join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

// "torch::nn::LinearImpl" -> "Linear"; "LlamaDecoderLayer" stays.
std::string ShortClassName(const std::string& name) {
  std::string out = name;
  if (auto colon = out.rfind("::"); colon != std::string::npos) out = out.substr(colon + 2);
  if (absl::EndsWith(out, "Impl") && out.size() > 4) out.resize(out.size() - 4);
  return out;
}

class JsonReader {
 public:
  explicit JsonReader(absl::string_view label) : label_(label) {}

  absl::Status Error(const std::string& path, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(label_, ": ", path.empty() ? "<root>" : path, ": ", what));
  }

  absl::StatusOr<TensorDecl> Tensor(const Json& j, const std::string& path, bool buffer) const {
    if (!j.is_object()) return Error(path, "expected an object {\"name\", \"shape\", \"dtype\"}");
    TensorDecl decl;
    auto name = j.find("name");
    if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) {
      return Error(path, "\"name\" must be a non-empty string");
    }
    decl.name = name->get<std::string>();
    if (absl::StrContains(decl.name, '.'))
      return Error(path, absl::StrCat("name '", decl.name, "' contains a '.'"));
    auto shape = j.find("shape");
    if (shape == j.end() || !shape->is_array())
      return Error(path, "\"shape\" must be a list of sizes");
    for (const Json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) {
        return Error(path,
                     absl::StrCat("shape entry ", d.dump(), " is not a non-negative integer"));
      }
      decl.shape.push_back(d.get<int64_t>());
    }
    auto dtype = j.find("dtype");
    if (dtype == j.end()) {
      decl.dtype = c10::ScalarType::Float;
    } else if (!dtype->is_string()) {
      return Error(path, "\"dtype\" must be a string such as \"float32\"");
    } else {
      auto parsed = ParseDType(dtype->get<std::string>());
      if (!parsed.ok()) return Error(path, parsed.status().message());
      decl.dtype = *parsed;
    }
    if (auto persistent = j.find("persistent"); persistent != j.end()) {
      if (!buffer) return Error(path, "\"persistent\" is only for buffers");
      if (!persistent->is_boolean()) return Error(path, "\"persistent\" must be true or false");
      decl.persistent = persistent->get<bool>();
    }
    return decl;
  }

  absl::Status Module(const Json& j, const std::string& path, int node, ModuleTree& tree) const {
    if (!j.is_object()) return Error(path, "expected a module object");
    std::set<std::string> names;
    auto unique = [&](const std::string& name, const std::string& where) -> absl::Status {
      if (!names.insert(name).second)
        return Error(where, absl::StrCat("'", name, "' is defined twice"));
      return absl::OkStatus();
    };
    for (const char* field : {"params", "buffers"}) {
      auto list = j.find(field);
      if (list == j.end()) continue;
      if (!list->is_array()) return Error(path, absl::StrCat("\"", field, "\" must be a list"));
      const bool buffer = std::string(field) == "buffers";
      for (size_t i = 0; i < list->size(); ++i) {
        std::string where = absl::StrCat(path, path.empty() ? "" : ".", field, "[", i, "]");
        ACCEL_ASSIGN_OR_RETURN(TensorDecl decl, Tensor((*list)[i], where, buffer));
        ACCEL_RETURN_IF_ERROR(unique(decl.name, where));
        if (buffer) {
          tree.AddBuffer(node, std::move(decl));
        } else {
          tree.AddParam(node, std::move(decl));
        }
      }
    }
    auto children = j.find("children");
    if (children == j.end()) return absl::OkStatus();
    if (!children->is_array()) return Error(path, "\"children\" must be a list");
    for (size_t i = 0; i < children->size(); ++i) {
      const Json& child = (*children)[i];
      std::string where = absl::StrCat(path, path.empty() ? "" : ".", "children[", i, "]");
      if (!child.is_object()) return Error(where, "expected a module object");
      auto name = child.find("name");
      if (name == child.end() || !name->is_string() || name->get<std::string>().empty()) {
        return Error(where, "\"name\" must be a non-empty string");
      }
      std::string child_name = name->get<std::string>();
      if (absl::StrContains(child_name, '.')) {
        return Error(where, absl::StrCat("name '", child_name, "' contains a '.'"));
      }
      ACCEL_RETURN_IF_ERROR(unique(child_name, where));
      std::string class_name;
      if (auto cls = child.find("class"); cls != child.end()) {
        if (!cls->is_string()) return Error(where, "\"class\" must be a string");
        class_name = cls->get<std::string>();
      }
      if (child.contains("tied")) return Error(where, "\"tied\" is only allowed at the root");
      int id = tree.AddChild(node, child_name, class_name);
      ACCEL_RETURN_IF_ERROR(Module(child, Join(path, child_name), id, tree));
    }
    return absl::OkStatus();
  }

 private:
  std::string label_;
};

Json TensorJson(const TensorDecl& t, bool buffer) {
  Json j = {{"name", t.name}, {"shape", t.shape}, {"dtype", std::string(DTypeName(t.dtype))}};
  if (buffer) j["persistent"] = t.persistent;
  return j;
}

}  // namespace

int64_t TensorDecl::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

ModuleTree::ModuleTree(std::string root_class) {
  nodes_.push_back({std::move(root_class), {}, {}, {}});
}

int ModuleTree::AddChild(int parent, std::string name, std::string class_name) {
  int id = static_cast<int>(nodes_.size());
  nodes_.push_back({std::move(class_name), {}, {}, {}});
  nodes_[parent].children.emplace_back(std::move(name), id);
  return id;
}

void ModuleTree::AddParam(int node, TensorDecl decl) {
  nodes_[node].params.push_back(std::move(decl));
}
void ModuleTree::AddBuffer(int node, TensorDecl decl) {
  nodes_[node].buffers.push_back(std::move(decl));
}

absl::Status ModuleTree::Tie(const std::vector<std::string>& names) {
  if (names.size() < 2)
    return absl::InvalidArgumentError("a tie needs at least two parameter names");
  std::unordered_map<std::string, const TensorDecl*> params;
  for (const auto& [module_name, node] : NamedModules()) {
    for (const TensorDecl& p : nodes_[node].params) params.emplace(Join(module_name, p.name), &p);
  }
  const TensorDecl* first = nullptr;
  for (const std::string& name : names) {
    auto it = params.find(name);
    if (it == params.end()) {
      return absl::InvalidArgumentError(absl::StrCat("tied name '", name, "' is not a parameter"));
    }
    if (tie_group_.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' is tied twice"));
    }
    if (first != nullptr &&
        (first->shape != it->second->shape || first->dtype != it->second->dtype)) {
      return absl::InvalidArgumentError(absl::StrCat("tied parameters '", names[0], "' and '", name,
                                                     "' differ in shape or dtype"));
    }
    first = it->second;
  }
  for (const std::string& name : names) tie_group_[name] = static_cast<int>(tied_.size());
  tied_.push_back(names);
  return absl::OkStatus();
}

std::vector<std::pair<std::string, int>> ModuleTree::NamedModules() const {
  std::vector<std::pair<std::string, int>> out;
  std::vector<std::pair<std::string, int>> stack = {{"", 0}};
  while (!stack.empty()) {
    auto [name, node] = stack.back();
    stack.pop_back();
    out.emplace_back(name, node);
    const auto& children = nodes_[node].children;
    for (auto it = children.rbegin(); it != children.rend(); ++it)
      stack.emplace_back(Join(name, it->first), it->second);
  }
  return out;
}

std::vector<ModuleTree::Named> ModuleTree::NamedParameters() const {
  std::vector<Named> out;
  std::set<int> groups_seen;
  for (const auto& [module_name, node] : NamedModules()) {
    for (const TensorDecl& p : nodes_[node].params) {
      std::string full = Join(module_name, p.name);
      if (auto g = tie_group_.find(full);
          g != tie_group_.end() && !groups_seen.insert(g->second).second)
        continue;
      out.push_back({std::move(full), &p, node, false});
    }
  }
  return out;
}

std::vector<ModuleTree::Named> ModuleTree::NamedBuffers() const {
  std::vector<Named> out;
  for (const auto& [module_name, node] : NamedModules()) {
    for (const TensorDecl& b : nodes_[node].buffers)
      out.push_back({Join(module_name, b.name), &b, node, true});
  }
  return out;
}

std::vector<std::vector<std::string>> ModuleTree::TiedParameters() const {
  std::vector<std::vector<std::string>> out;
  for (const Named& p : NamedParameters()) {
    auto g = tie_group_.find(p.name);
    if (g == tie_group_.end()) continue;
    std::vector<std::string> group = tied_[g->second];
    std::sort(group.begin(), group.end());
    out.push_back(std::move(group));
  }
  return out;
}

absl::StatusOr<int> ModuleTree::FindModule(absl::string_view name) const {
  int node = 0;
  if (name.empty()) return node;
  for (absl::string_view part : absl::StrSplit(name, '.')) {
    bool found = false;
    for (const auto& [child_name, child] : nodes_[node].children) {
      if (child_name == part) {
        node = child;
        found = true;
        break;
      }
    }
    if (!found) return absl::NotFoundError(absl::StrCat("no module named '", name, "'"));
  }
  return node;
}

std::vector<std::string> ModuleTree::StateDictKeys() const {
  std::vector<std::string> keys;
  for (const auto& [module_name, node] : NamedModules()) {
    for (const TensorDecl& p : nodes_[node].params) keys.push_back(Join(module_name, p.name));
    for (const TensorDecl& b : nodes_[node].buffers) {
      if (b.persistent) keys.push_back(Join(module_name, b.name));
    }
  }
  return keys;
}

absl::StatusOr<ModuleTree> ModuleTree::FromJson(absl::string_view text, absl::string_view label) {
  JsonLimits limits;
  limits.max_depth = 256;
  ACCEL_ASSIGN_OR_RETURN(Json j, ParseJson(text, label, limits));
  JsonReader reader(label);
  if (!j.is_object()) return reader.Error("", "expected a module object");
  std::string root_class;
  if (auto cls = j.find("class"); cls != j.end()) {
    if (!cls->is_string()) return reader.Error("", "\"class\" must be a string");
    root_class = cls->get<std::string>();
  }
  ModuleTree tree(root_class);
  ACCEL_RETURN_IF_ERROR(reader.Module(j, "", 0, tree));
  if (auto tied = j.find("tied"); tied != j.end()) {
    if (!tied->is_array())
      return reader.Error("tied", "must be a list of lists of parameter names");
    for (size_t i = 0; i < tied->size(); ++i) {
      const Json& group = (*tied)[i];
      std::vector<std::string> names;
      if (group.is_array()) {
        for (const Json& n : group) {
          if (n.is_string()) names.push_back(n.get<std::string>());
        }
      }
      if (!group.is_array() || names.size() != group.size()) {
        return reader.Error(absl::StrCat("tied[", i, "]"), "must be a list of parameter names");
      }
      absl::Status tie = tree.Tie(names);
      if (!tie.ok()) return reader.Error(absl::StrCat("tied[", i, "]"), tie.message());
    }
  }
  return tree;
}

std::string ModuleTree::ToJson() const {
  std::function<Json(int)> emit = [&](int node) {
    const Node& n = nodes_[node];
    Json j = {{"class", n.class_name}};
    if (!n.params.empty()) {
      j["params"] = Json::array();
      for (const TensorDecl& p : n.params) j["params"].push_back(TensorJson(p, false));
    }
    if (!n.buffers.empty()) {
      j["buffers"] = Json::array();
      for (const TensorDecl& b : n.buffers) j["buffers"].push_back(TensorJson(b, true));
    }
    if (!n.children.empty()) {
      j["children"] = Json::array();
      for (const auto& [name, child] : n.children) {
        Json c = emit(child);
        c["name"] = name;
        j["children"].push_back(std::move(c));
      }
    }
    return j;
  };
  Json root = emit(0);
  if (!tied_.empty()) root["tied"] = tied_;
  return root.dump();
}

absl::StatusOr<ModuleTree> ModuleTree::FromModule(const torch::nn::Module& module) {
  ModuleTree tree(ShortClassName(module.name()));
  std::map<const c10::TensorImpl*, std::vector<std::string>> owners;
  absl::Status status = CallTorch([&] {
    std::vector<std::tuple<const torch::nn::Module*, int, std::string>> stack = {{&module, 0, ""}};
    while (!stack.empty()) {
      auto [m, node, prefix] = stack.back();
      stack.pop_back();
      for (const auto& item : m->named_parameters(/*recurse=*/false)) {
        const at::Tensor& t = item.value();
        tree.AddParam(node, {item.key(), t.sizes().vec(), t.scalar_type(), true});
        owners[t.unsafeGetTensorImpl()].push_back(Join(prefix, item.key()));
      }
      const auto* layer = dynamic_cast<const Layer*>(m);
      for (const auto& item : m->named_buffers(/*recurse=*/false)) {
        const at::Tensor& t = item.value();
        const bool persistent = layer == nullptr || layer->IsPersistentBuffer(item.key());
        tree.AddBuffer(node, {item.key(), t.sizes().vec(), t.scalar_type(), persistent});
      }
      std::vector<std::tuple<const torch::nn::Module*, int, std::string>> children;
      std::set<const torch::nn::Module*> seen;
      for (const auto& child : m->named_children()) {
        if (!seen.insert(child.value().get()).second)
          continue;  // torch skips a child registered twice
        int id = tree.AddChild(node, child.key(), ShortClassName(child.value()->name()));
        children.emplace_back(child.value().get(), id, Join(prefix, child.key()));
      }
      for (auto it = children.rbegin(); it != children.rend(); ++it) stack.push_back(*it);
    }
  });
  ACCEL_RETURN_IF_ERROR(status);
  // Ties in first-appearance order.
  std::map<std::string, const std::vector<std::string>*> by_first;
  for (const auto& [impl, names] : owners) {
    if (names.size() > 1) by_first.emplace(names.front(), &names);
  }
  for (const auto& [module_name, node] : tree.NamedModules()) {
    for (const TensorDecl& p : tree.nodes_[node].params) {
      auto it = by_first.find(Join(module_name, p.name));
      if (it != by_first.end()) ACCEL_RETURN_IF_ERROR(tree.Tie(*it->second));
    }
  }
  return tree;
}

}  // namespace accel::dispatch
