// NVFP4 weights uploaded in 4 bits for the CUDA backend (issue 37 item 4): the host side of
// cuda_nvfp4.h's Nvfp4Weights, from the CPU's in-memory NVFP4 matrices (cpu::QuantMatrix, as the
// checkpoint loader builds them). Host code; errors are INTERNAL with the CUDA error string.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/cuda/cuda_memory.h"
#include "engine/cuda/cuda_nvfp4.h"

namespace dgserve::cuda {

// E NVFP4 matrices [rows, cols] on the device in the layout of Nvfp4Weights: codes
// [E, rows, cols/8] words, block_scales [E, rows, cols/16] e4m3 codes, alpha [E, rows],
// input_global [E] (1 for weight-only matrices). experts = 0 while nothing is uploaded;
// weight_only: NVFP4A16 (cpu::QuantMatrix::nvfp4_weight_only(): float32 activations).
struct DeviceNvfp4 {
  DeviceArray<uint32_t> codes;
  DeviceArray<uint8_t> block_scales;
  DeviceArray<float> alpha, input_global;
  int experts = 0;
  bool weight_only = false;

  Nvfp4Weights View() const {
    return {codes.get(), block_scales.get(), alpha.get(), input_global.get(), weight_only};
  }
  // Device bytes held: 4.5 bits per weight plus 4 bytes per row and per matrix.
  size_t bytes() const {
    return codes.size() * 4 + block_scales.size() + (alpha.size() + input_global.size()) * 4;
  }
};

// Uploads E × [rows, cols] matrices held as NVFP4 QuantMatrix (cpu::PackedMatrix::quant()) into
// `out` when every one is NVFP4 with one shape and one flavour (all W4A4 or all weight-only).
// Returns false, uploading nothing, when they are not (bf16 matrices, another format, mixed
// shapes or flavours): the caller uploads them as before.
absl::StatusOr<bool> UploadNvfp4(const std::vector<cpu::PackedMatrix>& experts, DeviceNvfp4* out);
// The same for one matrix (a dense layer: E = 1).
absl::StatusOr<bool> UploadNvfp4(const cpu::PackedMatrix& w, DeviceNvfp4* out);

}  // namespace dgserve::cuda
