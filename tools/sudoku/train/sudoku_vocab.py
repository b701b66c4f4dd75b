"""The Sudoku model's vocabulary and HF tokenizer files.

128 ids. The control tokens sit at their Gemma 4 ids (spec §1.4: <pad> 0, <eos> 1, <bos> 2,
<unk> 3, <mask> 4, <|tool_response> 50, <|think|> 98, <|channel> 100, <channel|> 101,
<|turn> 105, <turn|> 106, "\\n" 107), because the serving side renders the chat template and the
stop set by id. The characters a grid uses are ordinary vocabulary: "\\n" 107, "▁" (space) 108,
"." 109, "1".."9" 110..118, "0" 119. Everything else is <unusedN>. No merges: one character, one
token; other characters map to <unk>.
"""
import json

VOCAB_SIZE = 128
PAD, EOS, BOS, UNK = 0, 1, 2, 3
NEWLINE = 107
CHARS = {"\n": 107, "▁": 108, ".": 109, **{str(d): 109 + d for d in range(1, 10)}, "0": 119}
CONTROL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>", 50: "<|tool_response>",
           98: "<|think|>", 100: "<|channel>", 101: "<channel|>", 105: "<|turn>", 106: "<turn|>"}


def id_to_piece() -> dict:
    pieces = {}
    unused = 0
    for i in range(VOCAB_SIZE):
        if i in CONTROL:
            pieces[i] = CONTROL[i]
        elif i in CHARS.values():
            pieces[i] = next(c for c, j in CHARS.items() if j == i)
        else:
            pieces[i] = f"<unused{unused}>"
            unused += 1
    return pieces


def encode_rows(rows: str) -> list:
    """Text of the grid layout → ids (no <bos>); raises on characters outside the grid set."""
    return [CHARS[c] for c in rows]


def tokenizer_json() -> dict:
    pieces = id_to_piece()
    added = [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, p in pieces.items() if i not in CHARS.values()]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                          "behavior": "MergedWithPrevious", "invert": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<bos>", "type_id": 1}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [BOS], "tokens": ["<bos>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": True, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {p: i for i, p in pieces.items()}, "merges": []},
    }


def tokenizer_config_json() -> dict:
    pieces = id_to_piece()
    return {
        "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": 1024, "tokenizer_class": "GemmaTokenizer",
        "added_tokens_decoder": {str(i): {"content": p, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, p in pieces.items() if i not in CHARS.values()},
    }


def write(dirname: str) -> None:
    import os
    with open(os.path.join(dirname, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(), f, ensure_ascii=False, indent=1)
    with open(os.path.join(dirname, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config_json(), f, ensure_ascii=False, indent=1)
