// Fuzzes tokenizer.json loading (Tokenizer::FromJson): any bytes give a tokenizer or
// INVALID_ARGUMENT naming the file, never an exception or a crash. A tokenizer that loads must
// then encode and decode without breaking its own invariants (ids inside its vocabulary).
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "engine/tokenizer/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<dgserve::Tokenizer> t = dgserve::Tokenizer::FromJson(text, "fuzz/tokenizer.json");
  if (!t.ok()) {
    dgserve::fuzz::CheckInvalidArgument(t.status());
    dgserve::fuzz::Check(t.status().message().find("fuzz/tokenizer.json") != std::string::npos,
                         "error does not name the file: " + t.status().ToString());
    return 0;
  }
  for (std::string_view sample : {std::string_view("Hello, world! <b>\xc3\xa9\xe2\x96\x81 x"),
                                  std::string_view("\xff\xfe a  b\n\n\t"), text.substr(0, 64)}) {
    for (bool bos : {false, true}) {
      const std::vector<int32_t> ids = t->Encode(sample, bos);
      for (int32_t id : ids) {
        dgserve::fuzz::Check(id >= 0 && id < t->vocab_size(), "Encode gave an id outside vocab");
      }
      (void)t->Decode(ids, false);
      (void)t->Decode(ids, true);
    }
  }
  const std::vector<int32_t> probe = {0, 1, 2, t->vocab_size() - 1, t->vocab_size(), -1};
  (void)t->Decode(probe, false);
  return 0;
}
