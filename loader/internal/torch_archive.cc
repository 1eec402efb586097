#include "loader/internal/torch_archive.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include <minizip/unzip.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#include "core/status.h"
#include "loader/internal/safetensors_format.h"

namespace accel::loader::internal {

int64_t TorchTensorRef::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool TorchTensorRef::contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expected) return shape[i] == 0 || numel() == 0;
    expected *= shape[i];
  }
  return true;
}

namespace {

// Pickle opcodes (Python's Lib/pickle.py).
enum Op : uint8_t {
  kMark = '(',
  kStop = '.',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kBinInt2 = 'M',
  kNone = 'N',
  kBinPersId = 'Q',
  kReduce = 'R',
  kBinUnicode = 'X',
  kBuild = 'b',
  kGlobal = 'c',
  kEmptyDict = '}',
  kBinGet = 'h',
  kLongBinGet = 'j',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  kProto = 0x80,
  kNewObj = 0x81,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
};

// What a pickle may name, and what each is.
enum class Global { kOrderedDict, kRebuildTensor, kRestoreTypeTag, kStorageType };

// torch.<Name>Storage -> safetensors dtype: the dtypes both formats have.
constexpr std::pair<absl::string_view, absl::string_view> kStorageTypes[] = {
    {"FloatStorage", "F32"},     {"DoubleStorage", "F64"}, {"HalfStorage", "F16"},
    {"BFloat16Storage", "BF16"}, {"LongStorage", "I64"},   {"IntStorage", "I32"},
    {"ShortStorage", "I16"},     {"CharStorage", "I8"},    {"ByteStorage", "U8"},
    {"BoolStorage", "BOOL"},
};

// The one type tag libtorch's pickler writes for a state dict.
constexpr absl::string_view kStateDictTypeTag = "Dict[str, Tensor]";

constexpr int kMaxDepth = 32;     // containers inside containers
constexpr size_t kMaxMarks = 64;  // open MARKs
constexpr size_t kMaxDims = 64;   // a tensor's dimensions

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kTuple, kDict, kGlobal, kStorage, kTensor };
  Kind kind = Kind::kNone;
  int64_t number = 0;  // kInt, kBool
  std::string text;    // kStr; kGlobal: its name; kStorage: its key
  Global global = Global::kOrderedDict;
  std::string dtype;            // kGlobal kStorageType, kStorage: safetensors spelling
  std::vector<ValuePtr> items;  // kTuple
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // kDict
  int64_t storage_numel = 0;                           // kStorage
  TorchTensorRef tensor;                               // kTensor
  int depth = 1;
  // A dict becomes sealed once it is inside another value: later SETITEMS on
  // it are refused, so no container can ever hold itself.
  bool sealed = false;
};

const char* KindName(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kStr:
      return "str";
    case Value::Kind::kTuple:
      return "tuple";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kGlobal:
      return "global";
    case Value::Kind::kStorage:
      return "storage";
    case Value::Kind::kTensor:
      return "tensor";
  }
  return "?";
}

bool IsUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int extra = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      extra = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      extra = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      extra = 3;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i <= static_cast<size_t>(extra)) return false;
    for (int k = 1; k <= extra; ++k) {
      const auto d = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((d & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[extra] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

// A key or label quoted for an error message: at most 64 bytes, escaped.
std::string Quoted(absl::string_view s) {
  std::string out = absl::CEscape(s.substr(0, 64));
  if (s.size() > 64) absl::StrAppend(&out, "... (", s.size(), " bytes)");
  return absl::StrCat("'", out, "'");
}

class PickleChecker {
 public:
  PickleChecker(absl::string_view pickle, absl::string_view label) : in_(pickle), label_(label) {}

  absl::StatusOr<CheckedPickle> Run() {
    if (in_.size() > kMaxTorchPickleBytes) {
      return Bad(absl::StrCat("data.pkl is ", in_.size(), " bytes, over the bound of ",
                              kMaxTorchPickleBytes));
    }
    uint8_t op = 0;
    if (!Byte(op) || op != kProto) return Bad("data.pkl does not start with a PROTO opcode");
    uint8_t protocol = 0;
    if (!Byte(protocol)) return Truncated();
    if (protocol != 2) {
      return Bad(absl::StrCat("pickle protocol ", int{protocol},
                              ": torch.save writes protocol 2 (its default), the only one "
                              "libtorch reads"));
    }
    Emit(kProto);
    Emit(2);
    while (true) {
      if (!Byte(op)) return Truncated();
      if (op == kStop) break;
      ACCEL_RETURN_IF_ERROR(Step(op));
    }
    if (pos_ != in_.size()) return Bad("bytes after the pickle's STOP");
    if (!marks_.empty()) return Bad("a MARK is never closed");
    if (stack_.size() != 1) {
      return Bad(absl::StrCat("the pickle leaves ", stack_.size(), " values, not one"));
    }
    Emit(kStop);
    return Finish(*stack_.back().value);
  }

 private:
  // A value on the stack, and where in the output the opcodes that push it
  // begin (SETITEM puts a MARK there).
  struct Slot {
    ValuePtr value;
    size_t start = 0;
  };
  struct Mark {
    size_t height = 0;  // of the stack when it was set
    size_t start = 0;   // its position in the output
  };

  absl::Status Bad(absl::string_view why) const {
    return absl::InvalidArgumentError(absl::StrCat(label_, ": data.pkl: ", why));
  }
  absl::Status BadAt(absl::string_view why) const {
    return absl::InvalidArgumentError(
        absl::StrCat(label_, ": data.pkl at byte ", op_pos_, ": ", why));
  }
  absl::Status Truncated() const { return Bad("truncated (no STOP opcode)"); }

  bool Byte(uint8_t& out) {
    if (pos_ >= in_.size()) return false;
    op_pos_ = pos_;
    out = static_cast<uint8_t>(in_[pos_++]);
    return true;
  }
  bool Bytes(size_t n, absl::string_view& out) {
    if (in_.size() - pos_ < n) return false;
    out = in_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  template <typename T>
  bool Little(T& out) {
    absl::string_view b;
    if (!Bytes(sizeof(T), b)) return false;
    uint64_t v = 0;
    for (size_t i = sizeof(T); i-- > 0;) v = (v << 8) | static_cast<unsigned char>(b[i]);
    out = static_cast<T>(v);
    return true;
  }

  void Emit(uint8_t byte) { out_.push_back(static_cast<char>(byte)); }
  void EmitBytes(absl::string_view b) { out_.append(b.data(), b.size()); }
  template <typename T>
  void EmitLittle(T v) {
    auto u = static_cast<uint64_t>(v);
    for (size_t i = 0; i < sizeof(T); ++i) Emit(static_cast<uint8_t>(u >> (8 * i)));
  }

  ValuePtr Make(Value::Kind kind) {
    auto v = std::make_shared<Value>();
    v->kind = kind;
    return v;
  }

  size_t Floor() const { return marks_.empty() ? 0 : marks_.back().height; }

  absl::Status Push(ValuePtr v, size_t start) {
    if (v->depth > kMaxDepth) return BadAt("values nest deeper than 32 levels");
    stack_.push_back({std::move(v), start});
    return absl::OkStatus();
  }
  // The values above the innermost MARK, which is closed; `mark` gets it.
  absl::StatusOr<std::vector<ValuePtr>> PopMark(Mark& mark) {
    if (marks_.empty()) return BadAt("no MARK to close");
    mark = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items;
    for (size_t i = mark.height; i < stack_.size(); ++i) items.push_back(stack_[i].value);
    stack_.resize(mark.height);
    return items;
  }
  absl::StatusOr<Slot> Pop() {
    if (stack_.size() <= Floor()) return BadAt("the stack is empty (or holds only a MARK)");
    Slot s = std::move(stack_.back());
    stack_.pop_back();
    return s;
  }
  // The value SETITEM(S) or BUILD works on, left on the stack.
  absl::StatusOr<Value*> Top(absl::string_view op) {
    if (stack_.size() <= Floor()) return BadAt(absl::StrCat(op, " with nothing below it"));
    return stack_.back().value.get();
  }

  ValuePtr Tuple(std::vector<ValuePtr> items) {
    ValuePtr t = Make(Value::Kind::kTuple);
    for (const ValuePtr& item : items) {
      item->sealed = true;
      t->depth = std::max(t->depth, item->depth + 1);
    }
    t->items = std::move(items);
    return t;
  }

  absl::Status SetItems(Value& dict, const std::vector<ValuePtr>& pairs) {
    if (dict.kind != Value::Kind::kDict) {
      return BadAt(absl::StrCat("SETITEM(S) on a ", KindName(dict.kind), ", not a dict"));
    }
    if (dict.sealed) return BadAt("SETITEM(S) on a dict already inside another value");
    if (pairs.size() % 2 != 0) return BadAt("SETITEMS with a key but no value");
    for (size_t i = 0; i < pairs.size(); i += 2) {
      const ValuePtr& key = pairs[i];
      const ValuePtr& value = pairs[i + 1];
      if (key->kind != Value::Kind::kStr && key->kind != Value::Kind::kInt) {
        return BadAt(absl::StrCat("a dict key is a ", KindName(key->kind), ", not a str"));
      }
      if (value.get() == &dict) return BadAt("a dict holds itself");
      value->sealed = true;
      dict.depth = std::max(dict.depth, value->depth + 1);
      if (dict.depth > kMaxDepth) return BadAt("values nest deeper than 32 levels");
      dict.entries.emplace_back(key, value);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint32_t> MemoIndex(uint8_t op, uint8_t short_op) {
    if (op == short_op) {
      uint8_t u = 0;
      if (!Little(u)) return Truncated();
      return u;
    }
    uint32_t u = 0;
    if (!Little(u)) return Truncated();
    return u;
  }
  void EmitMemo(uint8_t op, uint8_t short_op, uint32_t id) {
    Emit(op);
    if (op == short_op) {
      Emit(static_cast<uint8_t>(id));
    } else {
      EmitLittle(id);
    }
  }

  absl::Status Step(uint8_t op) {
    const size_t at = out_.size();
    switch (op) {
      case kMark:
        if (marks_.size() >= kMaxMarks) return BadAt("more than 64 open MARKs");
        marks_.push_back({stack_.size(), at});
        Emit(op);
        return absl::OkStatus();
      case kNone:
        Emit(op);
        return Push(Make(Value::Kind::kNone), at);
      case kNewTrue:
      case kNewFalse: {
        ValuePtr v = Make(Value::Kind::kBool);
        v->number = op == kNewTrue;
        Emit(op);
        return Push(v, at);
      }
      case kBinInt:
      case kBinInt1:
      case kBinInt2: {
        int64_t n = 0;
        bool ok = false;
        if (op == kBinInt) {
          uint32_t u = 0;
          ok = Little(u);
          n = static_cast<int32_t>(u);
        } else if (op == kBinInt1) {
          uint8_t u = 0;
          ok = Little(u);
          n = u;
        } else {
          uint16_t u = 0;
          ok = Little(u);
          n = u;
        }
        if (!ok) return Truncated();
        ValuePtr v = Make(Value::Kind::kInt);
        v->number = n;
        Emit(kBinInt);
        EmitLittle(static_cast<uint32_t>(static_cast<int32_t>(n)));
        return Push(v, at);
      }
      case kLong1: {
        uint8_t n = 0;
        absl::string_view b;
        if (!Little(n) || !Bytes(n, b)) return Truncated();
        if (n > 8) return BadAt(absl::StrCat("LONG1 of ", int{n}, " bytes: beyond 64 bits"));
        uint64_t u = 0;
        for (size_t i = n; i-- > 0;) u = (u << 8) | static_cast<unsigned char>(b[i]);
        if (n > 0 && n < 8 && (static_cast<unsigned char>(b[n - 1]) & 0x80) != 0) {
          u |= ~uint64_t{0} << (8 * n);  // two's complement: sign-extend
        }
        ValuePtr v = Make(Value::Kind::kInt);
        v->number = static_cast<int64_t>(u);
        // libtorch 1.13 reads LONG1 of 8 bytes only; Python writes the fewest.
        Emit(kLong1);
        Emit(8);
        EmitLittle(u);
        return Push(v, at);
      }
      case kBinFloat: {
        absl::string_view b;
        if (!Bytes(8, b)) return Truncated();
        Emit(op);
        EmitBytes(b);
        return Push(Make(Value::Kind::kFloat), at);
      }
      case kBinUnicode: {
        uint32_t n = 0;
        absl::string_view b;
        if (!Little(n) || !Bytes(n, b)) return Truncated();
        if (!IsUtf8(b)) return BadAt("a string that is not UTF-8");
        ValuePtr v = Make(Value::Kind::kStr);
        v->text = std::string(b);
        Emit(op);
        EmitLittle(n);
        EmitBytes(b);
        return Push(v, at);
      }
      case kEmptyTuple:
        Emit(op);
        return Push(Tuple({}), at);
      case kTuple: {
        Mark mark;
        ACCEL_ASSIGN_OR_RETURN(std::vector<ValuePtr> items, PopMark(mark));
        Emit(op);
        return Push(Tuple(std::move(items)), mark.start);
      }
      case kTuple1:
      case kTuple2:
      case kTuple3: {
        const size_t n = static_cast<size_t>(op - kTuple1) + 1;
        std::vector<ValuePtr> items(n);
        size_t start = at;
        for (size_t i = n; i-- > 0;) {
          ACCEL_ASSIGN_OR_RETURN(Slot slot, Pop());
          items[i] = std::move(slot.value);
          start = slot.start;
        }
        Emit(op);
        return Push(Tuple(std::move(items)), start);
      }
      case kEmptyDict:
        Emit(op);
        return Push(Make(Value::Kind::kDict), at);
      case kSetItems: {
        Mark mark;
        ACCEL_ASSIGN_OR_RETURN(std::vector<ValuePtr> pairs, PopMark(mark));
        ACCEL_ASSIGN_OR_RETURN(Value * dict, Top("SETITEMS"));
        ACCEL_RETURN_IF_ERROR(SetItems(*dict, pairs));
        Emit(op);
        return absl::OkStatus();
      }
      case kSetItem: {
        // libtorch 1.13 has no SETITEM (Python writes it for a dict of one
        // item): MARK before the key, then SETITEMS.
        ACCEL_ASSIGN_OR_RETURN(Slot value, Pop());
        ACCEL_ASSIGN_OR_RETURN(Slot key, Pop());
        ACCEL_ASSIGN_OR_RETURN(Value * dict, Top("SETITEM"));
        ACCEL_RETURN_IF_ERROR(SetItems(*dict, {key.value, value.value}));
        marks_before_.push_back(key.start);
        Emit(kSetItems);
        return absl::OkStatus();
      }
      case kBinPut:
      case kLongBinPut: {
        ACCEL_ASSIGN_OR_RETURN(uint32_t id, MemoIndex(op, kBinPut));
        if (stack_.size() <= Floor()) return BadAt("PUT with nothing to store");
        // Picklers number memo entries 0, 1, 2, ...: a larger index would make
        // libtorch grow its memo to it.
        if (id > memo_.size()) {
          return BadAt(
              absl::StrCat("memo index ", id, " skips past the ", memo_.size(), " entries so far"));
        }
        if (id == memo_.size()) {
          memo_.push_back(stack_.back().value);
        } else {
          memo_[id] = stack_.back().value;
        }
        EmitMemo(op, kBinPut, id);
        return absl::OkStatus();
      }
      case kBinGet:
      case kLongBinGet: {
        ACCEL_ASSIGN_OR_RETURN(uint32_t id, MemoIndex(op, kBinGet));
        if (id >= memo_.size()) return BadAt(absl::StrCat("GET of memo entry ", id, ", never PUT"));
        EmitMemo(op, kBinGet, id);
        return Push(memo_[id], at);
      }
      case kGlobal:
        return ReadGlobal(at);
      case kReduce:
        return Reduce();
      case kBuild:
        return Build();
      case kBinPersId:
        return PersistentId();
      default: {
        std::string shown = absl::StrCat("0x", absl::Hex(op, absl::kZeroPad2));
        if (absl::ascii_isprint(op))
          absl::StrAppend(&shown, " '", std::string(1, static_cast<char>(op)), "'");
        return BadAt(absl::StrCat("opcode ", shown,
                                  " is not allowed (a weights file holds only what torch.save "
                                  "writes for a dict of tensors)"));
      }
    }
  }

  absl::StatusOr<std::string> Line() {
    const size_t end = in_.find('\n', pos_);
    if (end == absl::string_view::npos || end - pos_ > 256) {
      return BadAt("GLOBAL without a name line of at most 256 bytes");
    }
    std::string line(in_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return line;
  }

  absl::Status ReadGlobal(size_t at) {
    ACCEL_ASSIGN_OR_RETURN(std::string module, Line());
    ACCEL_ASSIGN_OR_RETURN(std::string name, Line());
    const std::string full = absl::StrCat(module, ".", name);
    ValuePtr g = Make(Value::Kind::kGlobal);
    g->text = full;
    if (module == "collections" && name == "OrderedDict") {
      g->global = Global::kOrderedDict;
    } else if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      g->global = Global::kRebuildTensor;
    } else if (module == "torch.jit._pickle" && name == "restore_type_tag") {
      g->global = Global::kRestoreTypeTag;
    } else if (module == "torch" && absl::EndsWith(name, "Storage")) {
      for (const auto& [storage, dtype] : kStorageTypes) {
        if (name == storage) {
          g->global = Global::kStorageType;
          g->dtype = std::string(dtype);
        }
      }
      if (g->dtype.empty()) {
        return BadAt(absl::StrCat("storage type ", Quoted(full),
                                  " has no safetensors dtype (allowed: Float, Double, Half, "
                                  "BFloat16, Long, Int, Short, Char, Byte, Bool)"));
      }
    } else {
      return BadAt(absl::StrCat(
          "global ", Quoted(full),
          " is not allowed: a weights file may name only torch._utils._rebuild_tensor_v2, "
          "torch.<Type>Storage and collections.OrderedDict (nothing that runs code)"));
    }
    Emit(kGlobal);
    EmitBytes(module);
    Emit('\n');
    EmitBytes(name);
    Emit('\n');
    return Push(g, at);
  }

  absl::Status Reduce() {
    ACCEL_ASSIGN_OR_RETURN(Slot args_slot, Pop());
    ACCEL_ASSIGN_OR_RETURN(Slot callable_slot, Pop());
    const ValuePtr& args = args_slot.value;
    const ValuePtr& callable = callable_slot.value;
    const size_t start = callable_slot.start;
    if (callable->kind != Value::Kind::kGlobal || callable->global == Global::kStorageType) {
      return BadAt(absl::StrCat(
          "REDUCE calls a ", KindName(callable->kind),
          callable->kind == Value::Kind::kGlobal ? absl::StrCat(" ", Quoted(callable->text)) : "",
          ", which is not a function it may call"));
    }
    if (args->kind != Value::Kind::kTuple) {
      return BadAt(absl::StrCat("REDUCE of ", callable->text, " with a ", KindName(args->kind),
                                " for its arguments"));
    }
    switch (callable->global) {
      case Global::kOrderedDict: {
        if (!args->items.empty()) return BadAt("OrderedDict(...) with arguments");
        // libtorch turns OrderedDict() into None; a dict it can fill instead:
        // drop the arguments and the callable, push an empty dict.
        Emit(kNewObj);  // libtorch: pops the top of its stack
        Emit(kNewObj);
        Emit(kEmptyDict);
        return Push(Make(Value::Kind::kDict), start);
      }
      case Global::kRestoreTypeTag: {
        if (args->items.size() != 2 || args->items[0]->kind != Value::Kind::kDict ||
            args->items[1]->kind != Value::Kind::kStr ||
            args->items[1]->text != kStateDictTypeTag) {
          return BadAt(absl::StrCat("restore_type_tag is allowed only for a ", kStateDictTypeTag));
        }
        Emit(kReduce);
        return Push(args->items[0], start);
      }
      case Global::kRebuildTensor: {
        ACCEL_ASSIGN_OR_RETURN(ValuePtr tensor, RebuildTensor(*args));
        Emit(kReduce);
        return Push(tensor, start);
      }
      case Global::kStorageType:
        break;
    }
    return BadAt("unreachable");
  }

  absl::StatusOr<std::vector<int64_t>> IntTuple(const Value& v, absl::string_view what) {
    if (v.kind != Value::Kind::kTuple || v.items.size() > kMaxDims) {
      return BadAt(absl::StrCat("a tensor's ", what, " is not a tuple of at most 64 ints"));
    }
    std::vector<int64_t> out;
    for (const ValuePtr& item : v.items) {
      if (item->kind != Value::Kind::kInt || item->number < 0) {
        return BadAt(absl::StrCat("a tensor's ", what, " holds something not a natural number"));
      }
      out.push_back(item->number);
    }
    return out;
  }

  absl::StatusOr<ValuePtr> RebuildTensor(const Value& args) {
    // torch's Tensor.__reduce_ex__: (storage, storage_offset, size, stride,
    // requires_grad, backward_hooks).
    if (args.items.size() != 6) {
      return BadAt(absl::StrCat("_rebuild_tensor_v2 with ", args.items.size(),
                                " arguments, not 6 (a tensor with Python metadata?)"));
    }
    const Value& storage = *args.items[0];
    const Value& offset = *args.items[1];
    const Value& requires_grad = *args.items[4];
    const Value& hooks = *args.items[5];
    if (storage.kind != Value::Kind::kStorage) {
      return BadAt("_rebuild_tensor_v2's first argument is not a storage");
    }
    if (offset.kind != Value::Kind::kInt || offset.number < 0) {
      return BadAt("_rebuild_tensor_v2's storage offset is not a natural number");
    }
    ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> shape, IntTuple(*args.items[2], "size"));
    ACCEL_ASSIGN_OR_RETURN(std::vector<int64_t> stride, IntTuple(*args.items[3], "stride"));
    if (stride.size() != shape.size()) {
      return BadAt(absl::StrCat("a tensor of ", shape.size(), " dimensions with ", stride.size(),
                                " strides"));
    }
    if (requires_grad.kind != Value::Kind::kBool) {
      return BadAt("_rebuild_tensor_v2's requires_grad is not a bool");
    }
    if (!(hooks.kind == Value::Kind::kNone ||
          (hooks.kind == Value::Kind::kDict && hooks.entries.empty()))) {
      return BadAt("a tensor with backward hooks");
    }
    const bool floating = storage.dtype == "F32" || storage.dtype == "F64" ||
                          storage.dtype == "F16" || storage.dtype == "BF16";
    if (requires_grad.number != 0 && !floating) {
      return BadAt(absl::StrCat("a ", storage.dtype, " tensor that requires grad"));
    }
    // numel, and the last element the view reaches, without overflow.
    constexpr uint64_t kLimit = uint64_t{1} << 62;
    const bool empty = std::find(shape.begin(), shape.end(), 0) != shape.end();
    uint64_t numel = 1;
    uint64_t last = static_cast<uint64_t>(offset.number);
    for (size_t i = 0; i < shape.size(); ++i) {
      const auto d = static_cast<uint64_t>(shape[i]);
      if (d != 0 && numel > kLimit / d) return BadAt("a tensor of more than 2^62 elements");
      numel *= d;
      if (empty) continue;
      const auto s = static_cast<uint64_t>(stride[i]);
      if (s != 0 && d - 1 > (kLimit - last) / s) return BadAt("a tensor view past 2^62");
      last += (d - 1) * s;
    }
    // An empty view reads nothing, but its offset still points into the
    // storage (where a loader would look for its bytes).
    if (static_cast<uint64_t>(offset.number) > static_cast<uint64_t>(storage.storage_numel)) {
      return BadAt(absl::StrCat("a tensor view starts at element ", offset.number, " of storage ",
                                Quoted(storage.text), ", which has ", storage.storage_numel));
    }
    if (!empty && last >= static_cast<uint64_t>(storage.storage_numel)) {
      return BadAt(absl::StrCat("a tensor view reaches element ", last, " of storage ",
                                Quoted(storage.text), ", which has ", storage.storage_numel));
    }
    ValuePtr t = Make(Value::Kind::kTensor);
    t->tensor.storage_key = storage.text;
    t->tensor.dtype = storage.dtype;
    t->tensor.storage_offset = offset.number;
    t->tensor.shape = std::move(shape);
    t->tensor.stride = std::move(stride);
    t->tensor.requires_grad = requires_grad.number != 0;
    return t;
  }

  absl::Status Build() {
    ACCEL_ASSIGN_OR_RETURN(Slot state, Pop());
    ACCEL_ASSIGN_OR_RETURN(Value * object, Top("BUILD"));
    // Python pickles an OrderedDict's attributes (a state dict's _metadata)
    // with BUILD after its items; they are not weights: dropped.
    if (object->kind != Value::Kind::kDict || state.value->kind != Value::Kind::kDict) {
      return BadAt(absl::StrCat("BUILD of a ", KindName(object->kind), " from a ",
                                KindName(state.value->kind),
                                " (only a dict's attributes may be set)"));
    }
    state.value->sealed = true;
    Emit(kNewObj);  // libtorch: pops the state
    return absl::OkStatus();
  }

  absl::Status PersistentId() {
    ACCEL_ASSIGN_OR_RETURN(Slot slot, Pop());
    const Value& pid = *slot.value;
    const auto is = [&](size_t i, Value::Kind kind) {
      return pid.items.size() > i && pid.items[i]->kind == kind;
    };
    if (pid.kind != Value::Kind::kTuple || pid.items.size() != 5 || !is(0, Value::Kind::kStr) ||
        pid.items[0]->text != "storage" || !is(1, Value::Kind::kGlobal) ||
        pid.items[1]->global != Global::kStorageType || !is(2, Value::Kind::kStr) ||
        !is(3, Value::Kind::kStr) || !is(4, Value::Kind::kInt)) {
      return BadAt(
          "a persistent id that is not ('storage', torch.<Type>Storage, key, location, numel)");
    }
    const std::string& key = pid.items[2]->text;
    if (key.empty() || key.size() > 64 || !std::all_of(key.begin(), key.end(), [](char c) {
          return absl::ascii_isalnum(c) || c == '_';
        })) {
      return BadAt(
          absl::StrCat("storage key ", Quoted(key), " is not 1-64 letters, digits or underscores"));
    }
    const std::string& location = pid.items[3]->text;
    const bool cuda_n = absl::StartsWith(location, "cuda:") && location.size() > 5 &&
                        location.size() <= 9 &&
                        std::all_of(location.begin() + 5, location.end(),
                                    [](char c) { return absl::ascii_isdigit(c); });
    if (!(location == "cpu" || location == "cuda" || location == "mps" || cuda_n)) {
      return BadAt(absl::StrCat("storage ", Quoted(key), " has location ", Quoted(location),
                                " (expected cpu, cuda, cuda:N or mps)"));
    }
    const std::string& dtype = pid.items[1]->dtype;
    const int64_t numel = pid.items[4]->number;
    const int element = DTypeElementSize(dtype).value_or(1);
    if (numel < 0 || numel > (int64_t{1} << 62) / element) {
      return BadAt(absl::StrCat("storage ", Quoted(key), " of ", numel, " elements"));
    }
    auto [it, added] = storages_.emplace(key, TorchStorageRef{key, dtype, numel});
    if (!added && (it->second.dtype != dtype || it->second.numel != numel)) {
      return BadAt(absl::StrCat("storage ", Quoted(key), " is named as ", it->second.numel, " ",
                                it->second.dtype, " and as ", numel, " ", dtype));
    }
    ValuePtr s = Make(Value::Kind::kStorage);
    s->text = key;
    s->dtype = dtype;
    s->storage_numel = numel;
    Emit(kBinPersId);
    return Push(s, slot.start);
  }

  absl::StatusOr<CheckedPickle> Finish(const Value& top) {
    if (top.kind != Value::Kind::kDict) {
      return Bad(absl::StrCat("the pickle holds a ", KindName(top.kind),
                              ", not a dict of tensors (a state dict)"));
    }
    CheckedPickle out;
    std::set<std::string> names;
    for (const auto& [key, value] : top.entries) {
      if (key->kind != Value::Kind::kStr) return Bad("a state dict key is not a string");
      if (value->kind != Value::Kind::kTensor) {
        return Bad(absl::StrCat("entry ", Quoted(key->text), " is a ", KindName(value->kind),
                                ", not a tensor: not a state dict of weights"));
      }
      if (!names.insert(key->text).second) {
        return Bad(absl::StrCat("tensor ", Quoted(key->text), " appears twice"));
      }
      TorchTensorRef t = value->tensor;
      t.name = key->text;
      out.tensors.push_back(std::move(t));
    }
    // Only the storages some tensor uses need a record.
    for (const TorchTensorRef& t : out.tensors) {
      out.storages.emplace(t.storage_key, storages_.at(t.storage_key));
    }
    // The MARKs that SETITEM needs, put in where their keys begin.
    std::sort(marks_before_.begin(), marks_before_.end());
    out.canonical.reserve(out_.size() + marks_before_.size());
    size_t copied = 0;
    for (size_t p : marks_before_) {
      out.canonical.append(out_, copied, p - copied);
      out.canonical.push_back(static_cast<char>(kMark));
      copied = p;
    }
    out.canonical.append(out_, copied, std::string::npos);
    return out;
  }

  absl::string_view in_;
  std::string label_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  std::string out_;
  std::vector<size_t> marks_before_;
  std::vector<Slot> stack_;
  std::vector<Mark> marks_;
  std::vector<ValuePtr> memo_;
  std::map<std::string, TorchStorageRef> storages_;
};

// ---- The zip archive, through minizip over bytes in memory ----

struct MemoryStream {
  absl::string_view bytes;
  uint64_t pos = 0;
};

voidpf OpenStream(voidpf opaque, const void* /*name*/, int mode) {
  if ((mode & ZLIB_FILEFUNC_MODE_WRITE) != 0) return nullptr;
  return new MemoryStream{*static_cast<const absl::string_view*>(opaque), 0};
}
uLong ReadStream(voidpf /*opaque*/, voidpf stream, void* buf, uLong size) {
  auto* s = static_cast<MemoryStream*>(stream);
  if (s->pos >= s->bytes.size()) return 0;
  const uint64_t n = std::min<uint64_t>(size, s->bytes.size() - s->pos);
  std::memcpy(buf, s->bytes.data() + s->pos, n);
  s->pos += n;
  return static_cast<uLong>(n);
}
uLong WriteStream(voidpf, voidpf, const void*, uLong) { return 0; }
ZPOS64_T TellStream(voidpf /*opaque*/, voidpf stream) {
  return static_cast<MemoryStream*>(stream)->pos;
}
long SeekStream(voidpf /*opaque*/, voidpf stream, ZPOS64_T offset, int origin) {  // NOLINT
  auto* s = static_cast<MemoryStream*>(stream);
  uint64_t base = 0;
  switch (origin) {
    case ZLIB_FILEFUNC_SEEK_SET:
      base = 0;
      break;
    case ZLIB_FILEFUNC_SEEK_CUR:
      base = s->pos;
      break;
    case ZLIB_FILEFUNC_SEEK_END:
      base = s->bytes.size();
      break;
    default:
      return -1;
  }
  if (offset > std::numeric_limits<uint64_t>::max() - base) return -1;
  s->pos = base + offset;
  return 0;
}
int CloseStream(voidpf /*opaque*/, voidpf stream) {
  delete static_cast<MemoryStream*>(stream);
  return 0;
}
int ErrorStream(voidpf, voidpf) { return 0; }

struct ZipCloser {
  void operator()(unzFile f) const { unzClose(f); }
};
using ZipPtr = std::unique_ptr<void, ZipCloser>;

struct ZipEntry {
  std::string name;
  uint64_t offset = 0;  // of the data
  uint64_t compressed = 0;
  uint64_t size = 0;
  int method = 0;
  bool encrypted = false;
};

constexpr uint64_t kMaxZipEntries = uint64_t{1} << 22;

}  // namespace

bool IsLegacyTorchSave(absl::string_view bytes) {
  // A bare pickle (PROTO 2) whose first value is torch's magic number
  // 0x1950a86a20f9469cfc6c, written as LONG1 of 10 bytes.
  static constexpr unsigned char kStart[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                             0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
  return bytes.size() >= sizeof(kStart) && std::memcmp(bytes.data(), kStart, sizeof(kStart)) == 0;
}

absl::StatusOr<CheckedPickle> CheckTorchPickle(absl::string_view pickle, absl::string_view label) {
  return PickleChecker(pickle, label).Run();
}

absl::StatusOr<ParsedTorchArchive> ParseTorchArchive(absl::string_view file,
                                                     absl::string_view label) {
  const auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(label, ": ", why));
  };
  if (IsLegacyTorchSave(file)) {
    return bad(
        "a torch.save file in the legacy format (before PyTorch 1.6, or "
        "_use_new_zipfile_serialization=False), which accel does not read: save it again with "
        "torch.save, or convert it to safetensors");
  }
  if (file.size() < 4 || file.substr(0, 4) != absl::string_view("PK\x03\x04", 4)) {
    return bad("not a torch.save file (a zip archive) nor a safetensors file");
  }
  // The end record, whole, at the end of the file (minizip accepts one that
  // a truncation cut short).
  bool whole_end = false;
  const size_t floor = file.size() > 22 + 65535 ? file.size() - 22 - 65535 : 0;
  for (size_t pos = file.size() >= 22 ? file.size() - 22 + 1 : 0; pos-- > floor;) {
    if (file.substr(pos, 4) != absl::string_view("PK\x05\x06", 4)) continue;
    const size_t comment = static_cast<unsigned char>(file[pos + 20]) |
                           static_cast<size_t>(static_cast<unsigned char>(file[pos + 21])) << 8;
    whole_end = pos + 22 + comment == file.size();
    break;
  }
  if (!whole_end) {
    return absl::DataLossError(
        absl::StrCat(label, ": the zip archive has no whole end record (truncated?)"));
  }
  zlib_filefunc64_def funcs{};
  funcs.zopen64_file = OpenStream;
  funcs.zread_file = ReadStream;
  funcs.zwrite_file = WriteStream;
  funcs.ztell64_file = TellStream;
  funcs.zseek64_file = SeekStream;
  funcs.zclose_file = CloseStream;
  funcs.zerror_file = ErrorStream;
  funcs.opaque = &file;
  ZipPtr zip(unzOpen2_64("memory", &funcs));
  if (zip == nullptr) return bad("not a readable zip archive (its central directory is damaged)");
  unz_global_info64 global{};
  if (unzGetGlobalInfo64(zip.get(), &global) != UNZ_OK) return bad("unreadable zip directory");
  if (global.number_entry > kMaxZipEntries) {
    return bad(absl::StrCat("a zip of ", global.number_entry, " entries"));
  }

  std::map<std::string, ZipEntry> entries;
  int rc = unzGoToFirstFile(zip.get());
  while (rc == UNZ_OK) {
    if (entries.size() >= kMaxZipEntries) return bad("too many zip entries");
    unz_file_info64 info{};
    char name[65536];
    if (unzGetCurrentFileInfo64(zip.get(), &info, name, sizeof(name), nullptr, 0, nullptr, 0) !=
        UNZ_OK) {
      return bad("an unreadable zip directory entry");
    }
    ZipEntry e;
    e.name.assign(name, std::min<size_t>(info.size_filename, sizeof(name) - 1));
    e.method = static_cast<int>(info.compression_method);
    e.encrypted = (info.flag & 1) != 0;
    e.compressed = info.compressed_size;
    e.size = info.uncompressed_size;
    if (!e.encrypted) {
      // Opening it checks the local header against the directory and gives
      // where the data starts.
      if (unzOpenCurrentFile2(zip.get(), nullptr, nullptr, /*raw=*/1) != UNZ_OK) {
        return bad(absl::StrCat("zip entry ", Quoted(e.name), ": its local header is damaged"));
      }
      e.offset = unzGetCurrentFileZStreamPos64(zip.get());
      unzCloseCurrentFile(zip.get());
    }
    if (!entries.emplace(e.name, e).second) {
      return bad(absl::StrCat("zip entry ", Quoted(e.name), " appears twice"));
    }
    rc = unzGoToNextFile(zip.get());
  }
  if (rc != UNZ_END_OF_LIST_OF_FILE) return bad("an unreadable zip directory entry");

  ParsedTorchArchive out;
  std::string pickle_name;
  for (const auto& [name, e] : entries) {
    const size_t slash = name.find('/');
    if (slash != std::string::npos && name.substr(slash) == "/data.pkl") {
      if (!pickle_name.empty()) return bad("more than one data.pkl");
      pickle_name = name;
      out.archive = name.substr(0, slash);
    }
  }
  if (pickle_name.empty()) return bad("a zip archive without <archive>/data.pkl: not torch.save's");
  const std::string prefix = out.archive + "/";
  for (const auto& [name, e] : entries) {
    if (!absl::StartsWith(name, prefix)) {
      return bad(absl::StrCat("zip entry ", Quoted(name), " is outside the archive folder ",
                              Quoted(out.archive)));
    }
  }
  // A stored (uncompressed, unencrypted) entry inside the file.
  const auto stored = [&](const ZipEntry& e) -> absl::Status {
    if (e.encrypted) return bad(absl::StrCat("zip entry ", Quoted(e.name), " is encrypted"));
    if (e.method != 0 || e.compressed != e.size) {
      return bad(absl::StrCat("zip entry ", Quoted(e.name), " is compressed (method ", e.method,
                              "); torch.save stores entries uncompressed, and accel uses their "
                              "bytes in place"));
    }
    if (e.offset > file.size() || e.size > file.size() - e.offset) {
      return absl::DataLossError(absl::StrCat(label, ": zip entry ", Quoted(e.name),
                                              " reaches past the end of the file (truncated?)"));
    }
    return absl::OkStatus();
  };
  if (auto it = entries.find(prefix + "byteorder"); it != entries.end()) {
    ACCEL_RETURN_IF_ERROR(stored(it->second));
    absl::string_view order = file.substr(it->second.offset, it->second.size);
    if (order != "little") {
      return bad(absl::StrCat("byte order ", Quoted(order), ": accel reads little-endian only"));
    }
  }
  const ZipEntry& pkl = entries.at(pickle_name);
  ACCEL_RETURN_IF_ERROR(stored(pkl));
  if (pkl.size > kMaxTorchPickleBytes) {
    return bad(
        absl::StrCat("data.pkl is ", pkl.size, " bytes, over the bound of ", kMaxTorchPickleBytes));
  }
  auto checked = CheckTorchPickle(file.substr(pkl.offset, pkl.size), label);
  if (!checked.ok()) return checked.status();
  out.pickle = *std::move(checked);
  for (const auto& [key, storage] : out.pickle.storages) {
    auto it = entries.find(absl::StrCat(prefix, "data/", key));
    if (it == entries.end() && storage.numel == 0) {
      out.records.emplace(key, ZipRecord{});  // libtorch reads nothing for it
      continue;
    }
    if (it == entries.end()) {
      return absl::DataLossError(
          absl::StrCat(label, ": storage ", Quoted(key), " has no record data/", key));
    }
    ACCEL_RETURN_IF_ERROR(stored(it->second));
    const uint64_t need = static_cast<uint64_t>(storage.numel) *
                          static_cast<uint64_t>(*DTypeElementSize(storage.dtype));
    if (it->second.size < need) {
      return absl::DataLossError(absl::StrCat(label, ": storage ", Quoted(key), " holds ",
                                              it->second.size, " bytes, not the ", need, " of its ",
                                              storage.numel, " ", storage.dtype, " elements"));
    }
    out.records.emplace(key, ZipRecord{it->second.offset, it->second.size});
  }
  return out;
}

}  // namespace accel::loader::internal
