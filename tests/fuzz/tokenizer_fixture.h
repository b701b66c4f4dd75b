// The tokenizer the encode / chat-template / gateway harnesses share: the real Gemma
// tokenizer.json when it is installed (npm, tools/setup.sh), else the tiny test tokenizer.
#pragma once

#include <cstdio>
#include <string>

#include "engine/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

namespace dgserve::fuzz {

inline const Tokenizer& SharedTokenizer() {
  static const Tokenizer* tokenizer = [] {
    std::string path = GemmaTokenizerPath();
    if (std::FILE* f = std::fopen(path.c_str(), "rb")) {
      std::fclose(f);
    } else {
      path = SourceDir() + "/engine/tokenizer/testdata/tiny_v512_tokenizer.json";
    }
    absl::StatusOr<Tokenizer> t = Tokenizer::Load(path);
    if (!t.ok()) Fail("cannot load the fixture tokenizer: " + t.status().ToString());
    std::fprintf(stderr, "fuzz: tokenizer %s (%d ids)\n", path.c_str(), t->vocab_size());
    return new Tokenizer(*std::move(t));
  }();
  return *tokenizer;
}

}  // namespace dgserve::fuzz
