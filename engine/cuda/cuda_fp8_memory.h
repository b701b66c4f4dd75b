// FP8 weights on the device for the CUDA backend (issue 37 item 4): the codes stay 8 bits, in the
// row-major layout of cuda_fp8.h's Fp8Weights. Host code; errors as cuda_memory.h.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/cuda/cuda_fp8.h"
#include "engine/cuda/cuda_memory.h"

namespace dgserve::cuda {

// E matrices [rows, cols] of e4m3 codes and their row scales on the device: codes [E, rows,
// cols] (1 byte a weight), scales [E, rows] float32; rows 0 while nothing is uploaded.
struct DeviceFp8 {
  DeviceArray<uint8_t> codes;
  DeviceArray<float> scales;
  int rows = 0, cols = 0;
  Fp8Weights view() const { return Fp8Weights{codes.get(), scales.get()}; }
  // Bytes held on the device.
  size_t bytes() const { return codes.size() + scales.size() * sizeof(float); }
};

// Uploads E × [rows, cols] FP8 matrices held as QuantMatrix (cpu::PackedMatrix::quant(), from
// FromFp8) into `out` when every one is FP8 with one shape; returns false, uploading nothing,
// when they are not (the caller then uploads them another way). The codes are the checkpoint's,
// unchanged, and the scales its weight_scale: the device computes what cpu::QuantLinear computes.
absl::StatusOr<bool> UploadFp8(const std::vector<cpu::PackedMatrix>& matrices, DeviceFp8* out);
// One matrix (a dense layer: E = 1).
absl::StatusOr<bool> UploadFp8(const cpu::PackedMatrix& matrix, DeviceFp8* out);

}  // namespace dgserve::cuda
