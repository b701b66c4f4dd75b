#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz harnesses (tests/fuzz/corpus/<harness>/).

The seeds are committed; rerun this after changing a harness's input format:
    python3 tests/fuzz/make_seeds.py
Protobuf inputs are encoded by hand (proto3 wire format) so that no protobuf Python package is
needed.
"""
import json
import os
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "tests", "fuzz", "corpus")


def write(harness, name, data):
    d = os.path.join(CORPUS, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- protobuf wire format -------------------------------------------------------------------
def varint(n):
    n &= (1 << 64) - 1
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def f_varint(field, n):
    return varint(field << 3) + varint(n)


def f_bytes(field, data):
    if isinstance(data, str):
        data = data.encode("utf-8")
    return varint(field << 3 | 2) + varint(len(data)) + data


def f_float(field, x):
    return varint(field << 3 | 5) + struct.pack("<f", x)


def f_fixed64(field, n):
    return varint(field << 3 | 1) + struct.pack("<Q", n)


def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & ((1 << 64) - 1)
    return h


# --- OpenAI bodies --------------------------------------------------------------------------
completions = {
    "basic": {"prompt": "Write a haiku about Lisbon.", "max_tokens": 64},
    "full": {"model": "tiny-g3", "prompt": ["Hello"], "max_tokens": 32, "stream": True,
             "stream_options": {"include_usage": True}, "stop": ["\n\n", "END"], "seed": 7,
             "temperature": 1, "top_p": None, "n": 1, "user": "u", "max_denoising_steps": 16,
             "entropy_bound": 0.2, "t_min": 0.3, "t_max": 0.9, "confidence_threshold": 0.01,
             "stability_threshold": 2, "self_conditioning": False, "canvas_step_interval": 2,
             "canvas_text": True, "logprobs": False, "echo": False, "best_of": 1,
             "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}},
    "token_ids": {"prompt": [2, 105, 2364, 107], "max_completion_tokens": 8},
    "nested_ids": {"prompt": [[2, 9259]], "stop": "x"},
    "bad_seed": {"prompt": "x", "seed": 1e400},
}
for name, body in completions.items():
    text = json.dumps(body)
    if name == "bad_seed":
        text = '{"prompt":"x","seed":1e400}'
    write("fuzz_openai_completions", name + ".json", text)
write("fuzz_openai_completions", "unicode.json", '{"prompt":"caf\\u00e9 \\ud83d\\ude00 \u00fc","max_tokens":1}')

chats = {
    "basic": {"messages": [{"role": "user", "content": "Why is the sky blue?"}]},
    "full": {"model": "tiny-g3", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "text", "text": "again"}]}],
        "chat_template_kwargs": {"enable_thinking": True}, "stream": True,
        "stream_options": {"include_usage": False}, "max_tokens": 40, "seed": 18446744073709551615,
        "stop": ["<turn|>"], "canvas_step_interval": 1},
    "image_part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    "big_numbers": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e308, "t_min": -1e39},
}
for name, body in chats.items():
    write("fuzz_openai_chat", name + ".json", json.dumps(body))
write("fuzz_openai_chat", "overflow.json", '{"messages":[{"role":"user","content":"x"}],"seed":1e400}')

# --- tokenizer.json -------------------------------------------------------------------------
tiny = json.load(open(os.path.join(ROOT, "engine", "tokenizer", "testdata", "tiny_v512_tokenizer.json")))
small = dict(tiny)
small_model = dict(tiny["model"])
small_model["vocab"] = {k: v for k, v in tiny["model"]["vocab"].items() if v < 300}
pieces = set(small_model["vocab"])
small_model["merges"] = [m for m in tiny["model"]["merges"]
                         if m[0] in pieces and m[1] in pieces and (m[0] + m[1]) in pieces][:40]
small["model"] = small_model
small["added_tokens"] = [t for t in tiny["added_tokens"] if t["id"] < 8]
write("fuzz_tokenizer_json", "small.json", json.dumps(small, ensure_ascii=False, separators=(",", ":")))
minimal = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "<0x41>": 3}, "merges": ["a b"],
                     "byte_fallback": True},
           "added_tokens": [{"id": 4, "content": "<bos>", "special": True}],
           "post_processor": {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<bos>"}}, {"Sequence": {"id": "A"}}],
                              "special_tokens": {"<bos>": {"id": "<bos>", "ids": [4]}}},
           "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"},
                                                        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
           "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "_"},
                                                              {"type": "Replace", "pattern": {"String": " "}, "content": "_"}]},
           "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
               {"type": "Split", "pattern": {"String": "_"}, "behavior": "MergedWithNext", "invert": False}]}}
write("fuzz_tokenizer_json", "minimal.json", json.dumps(minimal))
bad_special = json.loads(json.dumps(minimal))
bad_special["post_processor"]["special_tokens"]["<bos>"] = "<bos>"
write("fuzz_tokenizer_json", "special_not_object.json", json.dumps(bad_special))
no_ids = json.loads(json.dumps(minimal))
del no_ids["post_processor"]["special_tokens"]["<bos>"]["ids"]
write("fuzz_tokenizer_json", "special_without_ids.json", json.dumps(no_ids))

for i, text in enumerate(["Hello, world!", "  leading spaces and\ttabs\n\nnewlines",
                          "<start_of_turn>user\nhi<end_of_turn>\n<bos><eos>",
                          "caf\u00e9 \U0001F600 \u4e2d\u6587 \u0645\u0631\u062d\u0628\u0627",
                          "\u2581\u2581x", "<|turn>model\n<|channel>thought\n<channel|>"]):
    write("fuzz_tokenizer_encode", "text%d.txt" % i, text)
write("fuzz_tokenizer_encode", "bytes.bin", bytes(range(256)))

def chat_input(flags, messages):
    out = bytes([flags])
    parts = []
    for role, content in messages:
        parts.append(bytes([role]) + content.encode("utf-8"))
    return out + b"\0".join(parts)

write("fuzz_chat_template", "user.bin", chat_input(0, [(2, "Why is the sky blue?")]))
write("fuzz_chat_template", "system_thinking.bin",
      chat_input(1, [(0, "Be brief."), (2, "hi"), (3, "hello"), (2, "  again  ")]))
write("fuzz_chat_template", "developer_model.bin", chat_input(2, [(1, "rules"), (4, "<turn|>x")]))

# --- safetensors ----------------------------------------------------------------------------
def safetensors(tensors, metadata=None, pad=True):
    header = {}
    data = b""
    for name, dtype, shape, payload in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data

write("fuzz_safetensors_file", "f32.safetensors",
      safetensors([("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))], {"format": "pt"}))
write("fuzz_safetensors_file", "mixed.safetensors",
      safetensors([("a", "BF16", [3], b"\x80\x3f\x00\x40\x40\x40"),
                   ("b", "F16", [1, 2], b"\x00\x3c\x00\xc0"),
                   ("s", "F32", [], struct.pack("<f", 0.5)),
                   ("e", "F32", [0, 4], b"")]))
write("fuzz_safetensors_file", "empty.safetensors", safetensors([]))

index = {"metadata": {"total_size": 36},
         "weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00001-of-00002.safetensors",
                        "c": "model-00002-of-00002.safetensors"}}
write("fuzz_safetensors_index", "index.json", json.dumps(index, indent=2))
write("fuzz_safetensors_index", "traversal.json",
      json.dumps({"weight_map": {"a": "../model-00001-of-00002.safetensors"}}))
write("fuzz_safetensors_index", "missing.json",
      json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "nope.safetensors"}}))

# --- config.json / generation_config.json ---------------------------------------------------
for name, path in [("tiny_g3", "tests/testdata/golden/tiny-g3"), ("sudoku", "models/sudoku")]:
    d = os.path.join(ROOT, path)
    if os.path.exists(os.path.join(d, "config.json")):
        write("fuzz_model_config", name + "_config", b"\0" + open(os.path.join(d, "config.json"), "rb").read())
    if os.path.exists(os.path.join(d, "generation_config.json")):
        write("fuzz_model_config", name + "_generation",
              b"\1" + open(os.path.join(d, "generation_config.json"), "rb").read())
write("fuzz_model_config", "generation_overflow", b'\1{"t_max": 1e300, "eos_token_id": [1, 4294967297]}')

# --- GenerateRequest (dgserve.v1, generation.proto) -----------------------------------------
def chat_msg(role, content):
    return f_bytes(1, role) + f_bytes(2, content)

diffusion = (f_varint(1, 16) + f_float(2, 0.2) + f_float(3, 0.3) + f_float(4, 0.9) +
             f_float(5, 0.01) + f_varint(6, 2) + f_varint(7, 0))
requests = {
    "text": f_bytes(2, "Write a long essay about Portugal.") + f_varint(5, 64) + f_varint(7, 7),
    "chat": (f_bytes(1, "tiny-g3") +
             f_bytes(3, f_bytes(1, chat_msg("system", "Be brief.")) +
                     f_bytes(1, chat_msg("user", "Why is the sky blue?")) + f_varint(2, 1)) +
             f_varint(5, 32) + f_bytes(6, "\n\n") + f_bytes(8, diffusion) +
             f_bytes(9, f_varint(1, 2) + f_varint(2, 1))),
    "token_ids": f_bytes(4, f_bytes(1, b"".join(varint(i) for i in [2, 105, 2364, 107]))) +
                 f_varint(5, 1),
    "max_tokens_huge": f_bytes(2, "x") + f_varint(5, 2147483647),
    "negative_ids": f_bytes(4, f_bytes(1, varint(-1) + varint(262144))),
}
for name, data in requests.items():
    write("fuzz_gateway_request", name + ".pb", data)

# --- KV transfer frames (fuzz_kv_receiver.cc) -----------------------------------------------
# Layout of the harness: layers S F, one KV head of 2, window 6, blocks of 4 positions.
def frame(tag, payload):
    return bytes([tag]) + struct.pack("<H", len(payload)) + payload

def descriptor(tokens, first_sliding, sliding_count, full_count, model="fuzz-model"):
    layers = f_bytes(2, f_varint(1, 1) + f_varint(2, 1) + f_varint(3, 2)) + \
             f_bytes(2, f_varint(2, 1) + f_varint(3, 2))
    return (f_bytes(1, model) + layers + f_bytes(3, "f32") + f_varint(4, 4) +
            f_varint(5, tokens) + f_varint(6, 6) + f_varint(7, first_sliding) +
            f_varint(8, sliding_count) + f_varint(9, full_count))

def header(rid, desc, lease_ms=30000):
    return f_bytes(1, rid) + f_bytes(2, desc) + f_varint(3, lease_ms)

def block(sliding, logical, data=None):
    data = data if data is not None else bytes(range(64))
    msg = (f_varint(1, 1) if sliding else b"") + f_varint(2, logical) + f_bytes(3, data) + \
          f_fixed64(4, fnv1a64(data))
    return msg

def transfer(rid, tokens):
    blocks = (tokens + 3) // 4
    first = max(0, tokens - 5) // 4
    out = frame(0, header(rid, descriptor(tokens, first, blocks - first, blocks)))
    n = 0
    for i in range(blocks):
        out += frame(1, block(False, i)); n += 1
    for i in range(first, blocks):
        out += frame(1, block(True, i)); n += 1
    out += frame(2, f_varint(1, n))
    return out

write("fuzz_kv_receiver", "one_transfer", transfer("req-1", 10) + frame(4, b"") + frame(5, b"req-1"))
write("fuzz_kv_receiver", "expect_first", frame(5, b"r2") + transfer("r2", 13) + frame(4, b"") +
      frame(6, b"r2") + transfer("r2", 3))
write("fuzz_kv_receiver", "cut_stream", frame(0, header("r3", descriptor(8, 0, 2, 2))) +
      frame(1, block(False, 0)) + frame(4, b"") + frame(7, b"x" * 40))
write("fuzz_kv_receiver", "token_count_max",
      frame(0, header("r4", descriptor(2147483647, 0, 0, 0))) + frame(2, f_varint(1, 0)))
write("fuzz_kv_receiver", "lease_huge", transfer("r5", 4).replace(varint(30000), varint(10**12), 1) +
      frame(0xC1, block(True, 0, b"")) + frame(3, f_bytes(2, block(False, 0))))
print("seeds written to", CORPUS)
