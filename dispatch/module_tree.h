// dispatch/module_tree.h: a model's module structure without its data:
// modules (class names, children in registration order), parameters and
// buffers (shape, dtype, persistent) and tied parameters. Device maps are
// planned on this, so a model can be planned before (or without) loading it.
//
//   ACCEL_ASSIGN_OR_RETURN(ModuleTree tree, ModuleTree::FromJson(text, "tree.json"));
//   ACCEL_ASSIGN_OR_RETURN(ModuleTree tree, ModuleTree::FromModule(*model));
//
// JSON form: {"class": "...", "params": [{"name", "shape", "dtype"}],
// "buffers": [{"name", "shape", "dtype", "persistent"}], "children":
// [{"name": "...", <the same fields>}], "tied": [["a.weight", "b.weight"]]}
// with dtypes in torch spelling; "tied" only at the root.
#ifndef ACCEL_DISPATCH_MODULE_TREE_H_
#define ACCEL_DISPATCH_MODULE_TREE_H_

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace torch::nn {
class Module;
}

namespace accel::dispatch {

struct TensorDecl {
  std::string name;  // local to its module: "weight"
  std::vector<int64_t> shape;
  c10::ScalarType dtype = c10::ScalarType::Float;
  bool persistent = true;  // buffers only: false ones are not in the state dict

  int64_t numel() const;
};

// Not thread-safe to build; const methods may be called from any thread.
class ModuleTree {
 public:
  struct Node {
    std::string class_name;
    std::vector<TensorDecl> params;
    std::vector<TensorDecl> buffers;
    std::vector<std::pair<std::string, int>> children;  // (name, node), registration order
  };

  // One tensor with its full dotted name, as named_parameters() /
  // named_buffers() yield it.
  struct Named {
    std::string name;
    const TensorDecl* decl;
    int module;  // the node that holds it
    bool is_buffer;
  };

  explicit ModuleTree(std::string root_class);

  // Builder: nodes are numbered in creation order; the root is node 0.
  int AddChild(int parent, std::string name, std::string class_name);
  void AddParam(int node, TensorDecl decl);
  void AddBuffer(int node, TensorDecl decl);
  // Declares that these parameters (full names) are one tensor. InvalidArgument
  // if a name is not a parameter or shapes / dtypes differ.
  absl::Status Tie(const std::vector<std::string>& names);

  // InvalidArgument naming `label` and the JSON path of what is wrong.
  static absl::StatusOr<ModuleTree> FromJson(absl::string_view text, absl::string_view label);
  // A libtorch module (meta or real): class names are the module's name()
  // without namespace and "Impl" ("torch::nn::LinearImpl" -> "Linear");
  // parameters that share a TensorImpl are tied; buffers are persistent
  // unless a dispatch::Layer says otherwise (libtorch's layers cannot).
  static absl::StatusOr<ModuleTree> FromModule(const torch::nn::Module& module);
  std::string ToJson() const;

  const Node& node(int i) const { return nodes_[i]; }
  int size() const { return static_cast<int>(nodes_.size()); }

  // Pre-order, children in registration order, each module's own tensors
  // in registration order; a tied parameter appears once, under the first
  // name in this order (torch's named_parameters()).
  std::vector<Named> NamedParameters() const;
  std::vector<Named> NamedBuffers() const;
  // Every module with its full name ("" for the root), pre-order.
  std::vector<std::pair<std::string, int>> NamedModules() const;
  // Groups of tied parameter names, each sorted, groups ordered by their
  // first member in NamedParameters() order (Accelerate's find_tied_parameters,
  // made deterministic).
  std::vector<std::vector<std::string>> TiedParameters() const;
  // The node with this dotted name ("" is the root); NotFound otherwise.
  absl::StatusOr<int> FindModule(absl::string_view name) const;
  // Names of the state dict: parameters (tied ones under every name) and
  // persistent buffers.
  std::vector<std::string> StateDictKeys() const;

 private:
  std::vector<Node> nodes_;
  std::vector<std::vector<std::string>> tied_;  // as declared
  std::map<std::string, int> tie_group_;        // full param name -> index in tied_
};

}  // namespace accel::dispatch

#endif  // ACCEL_DISPATCH_MODULE_TREE_H_
