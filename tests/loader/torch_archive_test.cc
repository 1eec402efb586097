// The torch.save checks without torch: the pickle walk (what is allowed, what
// is refused by name, what is rewritten for libtorch's unpickler) on pickles
// built opcode by opcode here, and the zip archive around it, built with
// minizip's writer (stored and deflated records). Files Python and libtorch
// write are read end to end in torch_bin_test.cc.
#include "loader/internal/torch_archive.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <minizip/zip.h>

#include "absl/strings/str_cat.h"

#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace accel::loader::internal {
namespace {

using ::accel::test::IsOk;
using ::accel::test::StatusIs;
using ::accel::test::TempDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A protocol-2 pickle, opcode by opcode (Python's Lib/pickle.py names).
class Pickle {
 public:
  Pickle() { Op(0x80).Op(2); }
  Pickle& Op(uint8_t op) {
    bytes_.push_back(static_cast<char>(op));
    return *this;
  }
  Pickle& Raw(const std::string& s) {
    bytes_ += s;
    return *this;
  }
  Pickle& Mark() { return Op('('); }
  Pickle& Str(const std::string& s) {
    Op('X');
    Le32(static_cast<uint32_t>(s.size()));
    return Raw(s);
  }
  Pickle& Int(int32_t v) {
    Op('J');
    return Le32(static_cast<uint32_t>(v));
  }
  Pickle& Long1(const std::string& little_endian) {
    Op(0x8a).Op(static_cast<uint8_t>(little_endian.size()));
    return Raw(little_endian);
  }
  Pickle& Global(const std::string& module, const std::string& name) {
    return Op('c').Raw(module + "\n" + name + "\n");
  }
  Pickle& Put(uint8_t id) { return Op('q').Op(id); }
  Pickle& Get(uint8_t id) { return Op('h').Op(id); }
  // OrderedDict(): GLOBAL, EMPTY_TUPLE, REDUCE, as Python writes it.
  Pickle& OrderedDict() { return Global("collections", "OrderedDict").Op(')').Op('R'); }
  // A storage's persistent id.
  Pickle& Storage(const std::string& type, const std::string& key, int32_t numel,
                  const std::string& location = "cpu") {
    Mark().Str("storage").Global("torch", type).Str(key).Str(location).Int(numel).Op('t');
    return Op('Q');
  }
  Pickle& IntTuple(const std::vector<int32_t>& values) {
    Mark();
    for (int32_t v : values) Int(v);
    return Op('t');
  }
  // torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()).
  Pickle& Tensor(const std::string& key, int32_t numel, int32_t offset,
                 const std::vector<int32_t>& size, const std::vector<int32_t>& stride,
                 const std::string& type = "FloatStorage") {
    Global("torch._utils", "_rebuild_tensor_v2").Mark().Storage(type, key, numel).Int(offset);
    IntTuple(size).IntTuple(stride).Op(0x89).OrderedDict().Op('t');
    return Op('R');
  }
  Pickle& Stop() { return Op('.'); }
  const std::string& bytes() const { return bytes_; }

 private:
  Pickle& Le32(uint32_t v) {
    for (int i = 0; i < 4; ++i) bytes_.push_back(static_cast<char>(v >> (8 * i)));
    return *this;
  }
  std::string bytes_;
};

// {"w": a 2x3 float tensor, storage "0"}.
Pickle OneTensor() {
  Pickle p;
  p.Op('}').Mark().Str("w").Tensor("0", 6, 0, {2, 3}, {3, 1}).Op('u').Stop();
  return p;
}

// The opcodes of a pickle in the canonical subset, their arguments skipped.
std::vector<uint8_t> Opcodes(const std::string& pickle) {
  std::vector<uint8_t> ops;
  size_t i = 0;
  const auto le32 = [&](size_t at) {
    uint32_t v = 0;
    for (size_t k = 4; k-- > 0;) v = (v << 8) | static_cast<unsigned char>(pickle[at + k]);
    return v;
  };
  while (i < pickle.size()) {
    const auto op = static_cast<uint8_t>(pickle[i++]);
    ops.push_back(op);
    switch (op) {
      case 0x80:
      case 'K':
      case 'q':
      case 'h':
        i += 1;
        break;
      case 'M':
        i += 2;
        break;
      case 'J':
      case 'r':
      case 'j':
        i += 4;
        break;
      case 'G':
        i += 8;
        break;
      case 0x8a:
        i += 1 + static_cast<unsigned char>(pickle[i]);
        break;
      case 'X':
        i += 4 + le32(i);
        break;
      case 'c':
        i = pickle.find('\n', pickle.find('\n', i) + 1) + 1;
        break;
      default:
        break;
    }
  }
  return ops;
}

absl::StatusOr<CheckedPickle> Check(const Pickle& p) {
  return CheckTorchPickle(p.bytes(), "f.bin");
}

TEST(TorchPickle, ReadsAStateDictOfTensors) {
  Pickle p;
  p.Op('}').Put(0).Mark();
  p.Str("a").Tensor("0", 6, 0, {2, 3}, {3, 1});
  p.Str("b").Tensor("1", 8, 2, {3}, {2}, "BFloat16Storage");  // strided, at an offset
  p.Op('u').Stop();
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckedPickle checked, Check(p));
  ASSERT_EQ(checked.tensors.size(), 2u);
  const TorchTensorRef& a = checked.tensors[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_EQ(a.dtype, "F32");
  EXPECT_THAT(a.shape, ElementsAre(2, 3));
  EXPECT_TRUE(a.contiguous());
  const TorchTensorRef& b = checked.tensors[1];
  EXPECT_EQ(b.dtype, "BF16");
  EXPECT_EQ(b.storage_offset, 2);
  EXPECT_FALSE(b.contiguous());
  EXPECT_EQ(checked.storages.at("1").numel, 8);
}

TEST(TorchPickle, RefusesGlobalsThatCouldRunCodeByName) {
  for (const auto& [module, name] :
       std::vector<std::pair<std::string, std::string>>{{"posix", "system"},
                                                        {"builtins", "eval"},
                                                        {"__builtin__", "getattr"},
                                                        {"torch._utils", "_rebuild_parameter"},
                                                        {"torch", "load"},
                                                        {"torch._tensor", "_rebuild_from_type_v2"},
                                                        {"torch", "ComplexFloatStorage"}}) {
    SCOPED_TRACE(module + "." + name);
    Pickle p;
    p.Op('}').Mark().Str("w").Global(module, name).Str("echo hacked").Op(0x85).Op('R');
    p.Op('u').Stop();
    EXPECT_THAT(Check(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr(absl::StrCat("'", module, ".", name, "'"))));
  }
}

TEST(TorchPickle, RefusesOpcodesOutsideTheStateDictSubset) {
  // INST, OBJ, NEWOBJ, STACK_GLOBAL, EXT1, APPEND, LIST, POP, DUP, PERSID (text).
  for (int op : std::vector<int>{'i', 'o', 0x81, 0x93, 0x82, 'a', 'l', '0', '2', 'P'}) {
    SCOPED_TRACE(static_cast<int>(op));
    Pickle p;
    p.Op('}').Op(static_cast<uint8_t>(op)).Stop();
    EXPECT_THAT(Check(p),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is not allowed")));
  }
}

TEST(TorchPickle, RefusesOtherProtocolsTrailingBytesAndTruncation) {
  std::string four = OneTensor().bytes();
  four[1] = 4;
  EXPECT_THAT(CheckTorchPickle(four, "f.bin"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("pickle protocol 4")));
  EXPECT_THAT(CheckTorchPickle(OneTensor().bytes() + "x", "f.bin"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("after the pickle's STOP")));
  const std::string whole = OneTensor().bytes();
  for (size_t n = 0; n + 1 < whole.size(); ++n) {
    EXPECT_THAT(CheckTorchPickle(whole.substr(0, n), "f.bin"),
                StatusIs(absl::StatusCode::kInvalidArgument))
        << n;
  }
}

TEST(TorchPickle, RefusesViewsPastTheirStorage) {
  struct Case {
    int32_t numel, offset;
    std::vector<int32_t> size, stride;
  };
  for (const Case& c : std::vector<Case>{{5, 0, {2, 3}, {3, 1}},  // one short
                                         {6, 1, {2, 3}, {3, 1}},  // offset
                                         {6, 0, {2, 3}, {4, 1}},  // stride
                                         {0, 0, {1}, {1}}}) {     // empty storage
    Pickle p;
    p.Op('}').Mark().Str("w").Tensor("0", c.numel, c.offset, c.size, c.stride).Op('u').Stop();
    EXPECT_THAT(Check(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("a tensor view reaches element")));
  }
  Pickle dims;
  dims.Op('}').Mark().Str("w").Tensor("0", 6, 0, {2, 3}, {3}).Op('u').Stop();
  EXPECT_THAT(Check(dims), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("2 dimensions with 1 strides")));
  // An empty view still starts inside its storage (fuzzing found one past it).
  Pickle far;
  far.Op('}').Mark().Str("w").Tensor("0", 6, 1000, {0}, {1}).Op('u').Stop();
  EXPECT_THAT(Check(far),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("starts at element 1000")));
  // An empty view of an empty storage is fine.
  Pickle empty;
  empty.Op('}').Mark().Str("w").Tensor("0", 0, 0, {0, 4}, {4, 1}).Op('u').Stop();
  EXPECT_THAT(Check(empty), IsOk());
}

TEST(TorchPickle, RefusesAStorageKeyWithTwoDtypes) {
  Pickle p;
  p.Op('}').Mark();
  p.Str("a").Tensor("0", 6, 0, {6}, {1});
  p.Str("b").Tensor("0", 6, 0, {6}, {1}, "HalfStorage");
  p.Op('u').Stop();
  EXPECT_THAT(Check(p), StatusIs(absl::StatusCode::kInvalidArgument,
                                 HasSubstr("storage '0' is named as 6 F32 and as 6 F16")));
}

TEST(TorchPickle, RefusesWhatWouldBreakLibtorchsUnpickler) {
  struct Case {
    const char* what;
    Pickle pickle;
    const char* error;
  };
  std::vector<Case> cases;
  cases.push_back({"REDUCE on an empty stack", Pickle().Op('R'), "stack is empty"});
  cases.push_back({"odd SETITEMS", Pickle().Op('}').Mark().Str("k").Op('u'), "key but no value"});
  cases.push_back({"SETITEM without a dict", Pickle().Str("k").Str("v").Op('s'), "SETITEM"});
  cases.push_back({"memo index skipping ahead", Pickle().Op('}').Op('r').Raw("\xff\xff\xff\x7f"),
                   "skips past"});
  cases.push_back({"GET of nothing", Pickle().Get(3), "never PUT"});
  cases.push_back({"unclosed MARK", Pickle().Op('}').Mark().Stop(), "never closed"});
  cases.push_back({"TUPLE without MARK", Pickle().Op('t'), "no MARK"});
  cases.push_back({"LONG1 beyond 64 bits", Pickle().Long1(std::string(9, '\1')), "beyond 64 bits"});
  cases.push_back({"a list at the top", Pickle().Op(')').Stop(), "not a dict of tensors"});
  cases.push_back(
      {"not a tensor", Pickle().Op('}').Mark().Str("epoch").Int(3).Op('u').Stop(), "'epoch'"});
  cases.push_back({"a name twice",
                   Pickle()
                       .Op('}')
                       .Mark()
                       .Str("w")
                       .Tensor("0", 1, 0, {1}, {1})
                       .Str("w")
                       .Tensor("0", 1, 0, {1}, {1})
                       .Op('u')
                       .Stop(),
                   "appears twice"});
  cases.push_back({"a name not UTF-8", Pickle().Op('}').Mark().Str("\xff").Op('u'), "not UTF-8"});
  cases.push_back({"a storage key with a slash",
                   Pickle().Op('}').Mark().Str("w").Tensor("../x", 1, 0, {1}, {1}),
                   "letters, digits or underscores"});
  cases.push_back({"BUILD of a tensor's state",
                   Pickle().Tensor("0", 1, 0, {1}, {1}).Op('}').Op('b'), "BUILD of a tensor"});
  Pickle self;
  self.Op('}').Put(0).Mark().Str("me").Get(0).Op('u');
  cases.push_back({"a dict holding itself", self, "holds itself"});
  Pickle deep;
  deep.Int(1);
  for (int i = 0; i < 40; ++i) deep.Op(0x85);
  cases.push_back({"40 nested tuples", deep, "deeper than 32"});
  Pickle location;
  location.Op('}').Mark().Str("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  location.Storage("FloatStorage", "0", 1, "cuda:0:evil");
  cases.push_back({"a strange location", location, "has location"});
  for (const Case& c : cases) {
    EXPECT_THAT(Check(c.pickle), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(c.error)))
        << c.what;
  }
}

// The canonical stream: SETITEM becomes MARK + SETITEMS (libtorch 1.13 has no
// SETITEM), OrderedDict() an empty dict, BUILD a pop, LONG1 eight bytes.
TEST(TorchPickle, RewritesWhatLibtorchCannotRead) {
  Pickle p;
  p.OrderedDict().Put(0);
  p.Str("w").Tensor("0", 6, 0, {6}, {1}).Op('s');          // one item: SETITEM
  p.Op('}').Mark().Str("version").Int(1).Op('u').Op('b');  // _metadata as BUILD state
  p.Stop();
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckedPickle checked, Check(p));
  ASSERT_EQ(checked.tensors.size(), 1u);
  const std::string& c = checked.canonical;
  const std::vector<uint8_t> ops = Opcodes(c);
  EXPECT_EQ(std::count(ops.begin(), ops.end(), 's'), 0) << "no SETITEM left";
  EXPECT_EQ(std::count(ops.begin(), ops.end(), 'b'), 0) << "no BUILD left";
  EXPECT_EQ(std::count(ops.begin(), ops.end(), 'u'), 2) << "two SETITEMS";
  // OrderedDict(): the global and its arguments popped (NEWOBJ pops in
  // libtorch's unpickler), then an empty dict.
  EXPECT_THAT(c, HasSubstr("collections\nOrderedDict\n)\x81\x81}"));
  // The MARK before the key "w", closed by SETITEMS.
  EXPECT_THAT(c, HasSubstr(std::string("(X\x01\x00\x00\x00w", 7)));
  // BUILD dropped: its state popped.
  EXPECT_EQ(c.substr(c.size() - 3), "u\x81.");

  Pickle big;
  // A storage of 2^31 elements: Python writes LONG1 of 5 bytes.
  big.Op('}').Mark().Str("w").Global("torch._utils", "_rebuild_tensor_v2").Mark();
  big.Mark().Str("storage").Global("torch", "ByteStorage").Str("0").Str("cpu");
  big.Long1(std::string("\x00\x00\x00\x80\x00", 5)).Op('t').Op('Q');
  big.Int(0).IntTuple({1}).IntTuple({1}).Op(0x89).OrderedDict().Op('t').Op('R').Op('u').Stop();
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckedPickle large, Check(big));
  EXPECT_EQ(large.storages.at("0").numel, int64_t{1} << 31);
  EXPECT_THAT(large.canonical,
              HasSubstr(std::string("\x8a\x08\x00\x00\x00\x80\x00\x00\x00\x00", 10)));
}

TEST(TorchPickle, ReadsWhatLibtorchsPicklerWrites) {
  // torch::pickle_save of a Dict[str, Tensor]: the dict inside restore_type_tag.
  Pickle p;
  p.Global("torch.jit._pickle", "restore_type_tag").Put(0).Op('}').Mark();
  p.Str("w").Tensor("0", 2, 0, {2}, {1}).Op('u').Str("Dict[str, Tensor]").Op(0x86).Op('R').Stop();
  ACCEL_ASSERT_OK_AND_ASSIGN(CheckedPickle checked, Check(p));
  EXPECT_EQ(checked.tensors.size(), 1u);
  Pickle other;
  other.Global("torch.jit._pickle", "restore_type_tag").Op('}').Str("List[int]").Op(0x86).Op('R');
  EXPECT_THAT(Check(other), StatusIs(absl::StatusCode::kInvalidArgument,
                                     HasSubstr("only for a Dict[str, Tensor]")));
}

TEST(TorchPickle, TellsTheLegacyFormatApart) {
  const std::string legacy("\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.", 15);
  EXPECT_TRUE(IsLegacyTorchSave(legacy));
  EXPECT_FALSE(IsLegacyTorchSave(OneTensor().bytes()));
  EXPECT_THAT(ParseTorchArchive(legacy, "old.bin"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("legacy format")));
}

// ---- The zip archive -------------------------------------------------------

struct Record {
  std::string name;
  std::string bytes;
  bool deflate = false;
};

// A zip of `records`, written by minizip into a file and read back.
std::string Zip(const TempDir& dir, const std::vector<Record>& records) {
  const std::string path = dir.File("archive.zip");
  zipFile zip = zipOpen64(path.c_str(), APPEND_STATUS_CREATE);
  EXPECT_NE(zip, nullptr);
  for (const Record& r : records) {
    zip_fileinfo info{};
    EXPECT_EQ(zipOpenNewFileInZip64(zip, r.name.c_str(), &info, nullptr, 0, nullptr, 0, nullptr,
                                    r.deflate ? Z_DEFLATED : 0, r.deflate ? 9 : 0, 0),
              ZIP_OK);
    EXPECT_EQ(zipWriteInFileInZip(zip, r.bytes.data(), static_cast<unsigned>(r.bytes.size())),
              ZIP_OK);
    EXPECT_EQ(zipCloseFileInZip(zip), ZIP_OK);
  }
  EXPECT_EQ(zipClose(zip, nullptr), ZIP_OK);
  return test::ReadAll(path);
}

TEST(TorchArchive, FindsEachStoragesBytesInTheFile) {
  TempDir dir;
  const std::string data(24, '\x07');
  const std::string zip = Zip(dir, {{"m/data.pkl", OneTensor().bytes()},
                                    {"m/byteorder", "little"},
                                    {"m/data/0", data},
                                    {"m/version", "3\n"}});
  ACCEL_ASSERT_OK_AND_ASSIGN(ParsedTorchArchive archive, ParseTorchArchive(zip, "m.bin"));
  EXPECT_EQ(archive.archive, "m");
  const ZipRecord& record = archive.records.at("0");
  EXPECT_EQ(record.size, 24u);
  EXPECT_EQ(zip.substr(record.offset, record.size), data);
}

TEST(TorchArchive, RefusesArchivesItCannotUseInPlace) {
  TempDir dir;
  const std::string pkl = OneTensor().bytes();
  struct Case {
    const char* what;
    std::vector<Record> records;
    absl::StatusCode code;
    const char* error;
  };
  const std::vector<Case> cases = {
      {"a compressed storage",
       {{"m/data.pkl", pkl}, {"m/data/0", std::string(24, '\0'), true}},
       absl::StatusCode::kInvalidArgument,
       "'m/data/0' is compressed"},
      {"a missing storage", {{"m/data.pkl", pkl}}, absl::StatusCode::kDataLoss, "no record"},
      {"a short storage",
       {{"m/data.pkl", pkl}, {"m/data/0", std::string(20, '\0')}},
       absl::StatusCode::kDataLoss,
       "holds 20 bytes, not the 24"},
      {"no data.pkl", {{"m/other", "x"}}, absl::StatusCode::kInvalidArgument, "without"},
      {"an entry outside the folder",
       {{"m/data.pkl", pkl}, {"m/data/0", std::string(24, '\0')}, {"evil", ""}},
       absl::StatusCode::kInvalidArgument,
       "outside the archive folder"},
      {"big-endian",
       {{"m/data.pkl", pkl}, {"m/byteorder", "big"}, {"m/data/0", std::string(24, '\0')}},
       absl::StatusCode::kInvalidArgument,
       "little-endian only"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ParseTorchArchive(Zip(dir, c.records), "m.bin"),
                StatusIs(c.code, HasSubstr(c.error)))
        << c.what;
  }
  const std::string good = Zip(dir, {{"m/data.pkl", pkl}, {"m/data/0", std::string(24, '\0')}});
  EXPECT_THAT(ParseTorchArchive(good, "m.bin"), IsOk());
  // Cut anywhere, it is refused, never read past its end.
  for (size_t n = 0; n < good.size(); ++n) {
    EXPECT_FALSE(ParseTorchArchive(good.substr(0, n), "m.bin").ok()) << n;
  }
  EXPECT_THAT(ParseTorchArchive("not a zip", "m.bin"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a torch.save file")));
}

}  // namespace
}  // namespace accel::loader::internal
