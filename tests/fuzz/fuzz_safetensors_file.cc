// Fuzzes the safetensors reader (SafetensorsFile::Open through SafetensorsReader::OpenFile):
// the 8-byte header length, the JSON header (dtypes, shapes, data_offsets, __metadata__) and the
// data region. Any bytes give a validated file or INVALID_ARGUMENT naming the file; a file that
// opens has every tensor inside the mapping, and each converts to float32.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model/safetensors.h"
#include "tests/fuzz/temp_dir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  const std::string path = dgserve::fuzz::ScratchDir() + "/model.safetensors";
  dgserve::fuzz::WriteFile(path, std::string_view(reinterpret_cast<const char*>(data), size));
  absl::StatusOr<dgserve::SafetensorsReader> r = dgserve::SafetensorsReader::OpenFile(path);
  if (!r.ok()) {
    dgserve::fuzz::CheckInvalidArgument(r.status());
    Check(r.status().message().find(path) != std::string::npos,
          "error does not name the file: " + r.status().ToString());
    return 0;
  }
  for (const dgserve::TensorView& t : r->tensors()) {
    Check(t.numel() >= 0, "negative numel");
    Check(t.nbytes == static_cast<size_t>(t.numel()) * dgserve::DTypeSize(t.dtype),
          "nbytes != numel * itemsize");
    Check(t.nbytes <= size, "tensor larger than the file");
    if (t.numel() > (1 << 16)) continue;
    absl::StatusOr<std::vector<float>> f = dgserve::ToFloat32(t);
    if (!dgserve::IsFloatDType(t.dtype)) {  // I32 / I64 (quantized checkpoints): refused
      Check(!f.ok(), "ToFloat32 converted an integer tensor");
      if (!f.ok()) dgserve::fuzz::CheckInvalidArgument(f.status());
      Check(r->Find(t.name) != nullptr, "Find misses a listed tensor");
      continue;
    }
    Check(f.ok(), "ToFloat32 failed on a validated tensor: " + f.status().ToString());
    Check(f->size() == static_cast<size_t>(t.numel()), "ToFloat32 size");
    Check(r->Find(t.name) != nullptr, "Find misses a listed tensor");
  }
  return 0;
}
