#!/usr/bin/env python3
"""Writes the seed corpora of the tokenizer fuzzers (checked in; rerun after editing).

corpus/tokenizer_json/: small tokenizer.json files, one or more per component
kind tokenizer/tokenizer.h supports, and a few broken ones.
corpus/tokenizer_encode/: inputs of tokenizer_encode_fuzz: one byte (low bits:
which built-in tokenizer; 0x80: decode the rest as ids; 0x40: skip special
tokens), then the text.

    python3 tests/fuzz/make_tokenizer_corpus.py
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
U2581 = "\u2581"


def bpe(vocab, merges=(), **model):
    m = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
         "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
         "vocab": {t: i for i, t in enumerate(vocab)}, "merges": list(merges)}
    m.update(model)
    return m


def tokenizer(model, **parts):
    t = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
         "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
         "model": model}
    t.update(parts)
    return t


def added(i, content, special=True, normalized=False, single_word=False, lstrip=False, rstrip=False):
    return {"id": i, "content": content, "single_word": single_word, "lstrip": lstrip,
            "rstrip": rstrip, "normalized": normalized, "special": special}


CHARS = list("abcdefghijklmnopqrstuvwxyz ") + ["ab", "abc", "he", "hel", "hell", "hello"]
MERGES = ["a b", "ab c", "h e", "he l", "hel l", "hell o"]
BYTES = ["<0x%02X>" % b for b in range(256)]
SP_VOCAB = ["<unk>", "<s>", "</s>"] + BYTES + [U2581, U2581 + "a", "a", "b", U2581 + "ab", "ab"]
SP_MERGES = [U2581 + " a", "a b", U2581 + "a b"]
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                  r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA2_DECODER = {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": U2581}, "content": " "}, {"type": "ByteFallback"},
    {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
TEMPLATE = {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def byte_level_vocab():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


BL = byte_level_vocab()

TOKENIZER_JSON = {
    "char_merges.json": tokenizer(bpe(CHARS, MERGES)),
    "merge_pairs.json": tokenizer(bpe(CHARS, [m.split(" ") for m in MERGES])),
    "prefix_suffix.json": tokenizer(bpe(["a", "##b", "##b</w>", "b</w>", "a##b</w>", "ab</w>"], ["a ##b</w>"],
                                        continuing_subword_prefix="##", end_of_word_suffix="</w>")),
    "unk_fuse.json": tokenizer(bpe(["<unk>", "a"], unk_token="<unk>", fuse_unk=True)),
    "llama2_like.json": tokenizer(
        bpe(SP_VOCAB, SP_MERGES, unk_token="<unk>", fuse_unk=True, byte_fallback=True),
        added_tokens=[added(0, "<unk>"), added(1, "<s>"), added(2, "</s>")],
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": U2581},
            {"type": "Replace", "pattern": {"String": " "}, "content": U2581}]},
        post_processor=TEMPLATE, decoder=LLAMA2_DECODER),
    "metaspace.json": tokenizer(
        bpe(SP_VOCAB, SP_MERGES, byte_fallback=True),
        added_tokens=[added(1, "<s>")],
        pre_tokenizer={"type": "Metaspace", "replacement": U2581, "prepend_scheme": "first", "split": False},
        decoder={"type": "Metaspace", "replacement": U2581, "prepend_scheme": "first", "split": False}),
    "metaspace_legacy.json": tokenizer(
        bpe(SP_VOCAB, SP_MERGES),
        pre_tokenizer={"type": "Metaspace", "replacement": U2581, "add_prefix_space": True},
        decoder={"type": "Metaspace", "replacement": U2581, "add_prefix_space": True}),
    "gpt2_like.json": tokenizer(
        bpe(BL + ["<|endoftext|>"]),
        added_tokens=[added(256, "<|endoftext|>", normalized=True)],
        pre_tokenizer=BYTE_LEVEL, post_processor=BYTE_LEVEL, decoder=BYTE_LEVEL),
    "llama3_like.json": tokenizer(
        bpe(BL, ignore_merges=True),
        added_tokens=[added(256, "<|begin_of_text|>")],
        pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
            dict(BYTE_LEVEL, use_regex=False)]},
        post_processor={"type": "Sequence", "processors": [BYTE_LEVEL, {
            "type": "RobertaProcessing", "sep": ["<|begin_of_text|>", 256],
            "cls": ["<|begin_of_text|>", 256], "trim_offsets": True, "add_prefix_space": False}]},
        decoder=BYTE_LEVEL),
    "normalizers.json": tokenizer(
        bpe(CHARS),
        normalizer={"type": "Sequence", "normalizers": [
            {"type": "NFC"}, {"type": "NFD"}, {"type": "NFKC"}, {"type": "NFKD"}, {"type": "Lowercase"},
            {"type": "Strip", "strip_left": True, "strip_right": False},
            {"type": "Replace", "pattern": {"Regex": r"\s+"}, "content": " "}]},
        added_tokens=[added(40, "hello", special=False, normalized=True, single_word=True, lstrip=True,
                            rstrip=True)]),
    "pre_tokenizers.json": tokenizer(
        bpe(CHARS),
        pre_tokenizer={"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"}, {"type": "WhitespaceSplit"}, {"type": "Digits", "individual_digits": True},
            {"type": "Split", "pattern": {"String": "-"}, "behavior": "MergedWithNext", "invert": True},
            {"type": "Split", "pattern": {"Regex": "[a-c]+"}, "behavior": "Contiguous", "invert": False},
            {"type": "Split", "pattern": {"Regex": "x*"}, "behavior": "MergedWithPrevious", "invert": False}]},
        decoder={"type": "Sequence", "decoders": [{"type": "Fuse"},
                                                  {"type": "Strip", "content": "a", "start": 2, "stop": 2}]}),
    # Broken ones.
    "bad_merge.json": tokenizer(bpe(["a", "b"], ["a c"])),
    "bad_regex.json": tokenizer(bpe(CHARS), pre_tokenizer={
        "type": "Split", "pattern": {"Regex": "(?<=a)b"}, "behavior": "Isolated", "invert": False}),
    "bad_type.json": tokenizer(bpe(CHARS), decoder={"type": "WordPiece", "prefix": "##"}),
    "deep.json": "{\"model\":" + "[" * 80 + "]" * 80 + "}",
}

ENCODE = {
    "gpt2_text": b"\x00Hello world, it's  2024!\n\n\tcode  \xc3\xa9\xe4\xbd\xa0\xf0\x9f\x99\x82",
    "llama3_text": b"\x01I'M here   \r\n  12345 <|begin_of_text|>x<tool_call>hello hellox",
    "qwen2_text": b"\x02e\xcc\x81 \xe3\x80\x80\xc2\xa0 a\x0bb 99 <|end_of_text|>",
    "invalid_utf8": b"\x00ab\xc3(\xed\xa0\x80",
    "decode_ids": b"\x80\x00\x41\x00\xe2\x01\x02\x02\x58\x00\x20",
    "decode_skip": b"\xc1\x02\x58\x00\x41\x02\x59\x00\xc3",
    "empty": b"\x00",
}


def main():
    out = os.path.join(HERE, "corpus", "tokenizer_json")
    os.makedirs(out, exist_ok=True)
    for name, value in TOKENIZER_JSON.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            f.write(text)
    out = os.path.join(HERE, "corpus", "tokenizer_encode")
    os.makedirs(out, exist_ok=True)
    for name, value in ENCODE.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(value)


if __name__ == "__main__":
    main()
