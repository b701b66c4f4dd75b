// Fuzzes encoding arbitrary bytes with the real Gemma tokenizer (as a prompt's text reaches
// Tokenizer::Encode), and decoding the result, whole and streamed in chunks: every id inside the
// vocabulary, decoded text valid UTF-8, streamed decode equal to the whole decode (where no
// byte-fallback run is invalid UTF-8: see below).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer/utf8.h"
#include "tests/fuzz/tokenizer_fixture.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)dgserve::fuzz::SharedTokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  const dgserve::Tokenizer& t = dgserve::fuzz::SharedTokenizer();
  if (size > 4096) return 0;  // long inputs only slow the search down
  const bool bos = size > 0 && (data[0] & 1);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = t.Encode(text, bos);
  for (int32_t id : ids) Check(id >= 0 && id < t.vocab_size(), "Encode gave an id outside vocab");
  Check(!text.empty() || ids.size() <= 1, "empty text encoded to several ids");
  for (bool skip : {false, true}) {
    const std::string whole = t.Decode(ids, skip);
    Check(dgserve::tokenizer_internal::IsValidUtf8(whole), "Decode gave invalid UTF-8");
    dgserve::StreamDecoder stream(t, skip);
    std::string streamed;
    const size_t chunk = size > 1 ? 1 + data[1] % 7 : 1;
    for (size_t i = 0; i < ids.size(); i += chunk) {
      const size_t n = std::min(chunk, ids.size() - i);
      streamed += stream.Push(std::span<const int32_t>(ids.data() + i, n));
    }
    streamed += stream.Finish();
    Check(dgserve::tokenizer_internal::IsValidUtf8(streamed), "streamed decode gave invalid UTF-8");
    // A byte-fallback run that is not valid UTF-8 decodes (as in HF) to one U+FFFD per byte of
    // the whole run, valid characters inside it included; a stream cannot wait for the end of
    // the run, so it has already sent those characters. Equal whenever no run is invalid.
    if (whole.find("\xEF\xBF\xBD") == std::string::npos) {
      Check(streamed == whole, "streamed decode differs from whole decode");
    }
  }
  return 0;
}
