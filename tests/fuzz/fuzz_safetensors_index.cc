// Fuzzes the shard index reader (SafetensorsReader::OpenIndex): the input is the text of
// model.safetensors.index.json in a directory that holds two valid shards (tensors "a", "b" in
// model-00001-of-00002.safetensors, "c" in model-00002-of-00002.safetensors). Any bytes give a
// reader or INVALID_ARGUMENT / NOT_FOUND naming the index, never a crash or an escape from the
// directory.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model/safetensors.h"
#include "tests/fuzz/temp_dir.h"

namespace {

void WriteShards(const std::string& dir) {
  static const float kA[4] = {1, 2, 3, 4};
  static const float kB[2] = {5, 6};
  static const float kC[3] = {7, 8, 9};
  std::vector<dgserve::TensorSource> first;
  first.push_back(dgserve::TensorFromBuffer("a", dgserve::DType::kF32, {2, 2}, kA));
  first.push_back(dgserve::TensorFromBuffer("b", dgserve::DType::kF32, {2}, kB));
  std::vector<dgserve::TensorSource> second;
  second.push_back(dgserve::TensorFromBuffer("c", dgserve::DType::kF32, {3}, kC));
  for (auto& [name, tensors] :
       {std::pair{std::string("model-00001-of-00002.safetensors"), std::move(first)},
        std::pair{std::string("model-00002-of-00002.safetensors"), std::move(second)}}) {
    absl::Status s = dgserve::WriteSafetensorsFile(dir + "/" + name, tensors);
    if (!s.ok()) dgserve::fuzz::Fail("cannot write the shards: " + s.ToString());
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  WriteShards(dgserve::fuzz::ScratchDir());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  const std::string dir = dgserve::fuzz::ScratchDir();
  const std::string index = dir + "/model.safetensors.index.json";
  dgserve::fuzz::WriteFile(index, std::string_view(reinterpret_cast<const char*>(data), size));
  absl::StatusOr<dgserve::SafetensorsReader> r = dgserve::SafetensorsReader::OpenIndex(index);
  if (!r.ok()) {
    dgserve::fuzz::CheckInvalidArgument(r.status(), absl::StatusCode::kNotFound);
    Check(r.status().message().find(index) != std::string::npos,
          "error does not name the index: " + r.status().ToString());
    return 0;
  }
  for (const std::string& f : r->files()) {
    Check(f.rfind(dir + "/", 0) == 0 || f.find('/') == std::string::npos,
          "index opened a file outside its directory: " + f);
  }
  for (const dgserve::TensorView& t : r->tensors()) {
    Check(t.name == "a" || t.name == "b" || t.name == "c", "unknown tensor " + t.name);
    absl::StatusOr<std::vector<float>> v = dgserve::ToFloat32(t);
    Check(v.ok() && v->size() == static_cast<size_t>(t.numel()), "ToFloat32 of a shard tensor");
  }
  return 0;
}
