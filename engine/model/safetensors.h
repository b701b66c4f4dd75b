// safetensors reading (memory-mapped, single file or sharded via model.safetensors.index.json)
// and writing (single file, or HF-style shards + index above a size threshold).
//
// File format: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"k": "v"}}, then the data region; offsets are relative to the data region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve {

// Element types this reader accepts. Every other safetensors dtype is rejected. F8_E4M3
// (float8_e4m3fn: bias 7, no infinities, 0x7f/0xff NaN, max 448), I32, I64 and U8 appear only in
// quantized checkpoints (issue 37: FP8 weights, packed int4 weights and their shapes, NVFP4
// weights packed two e2m1 codes per byte).
enum class DType { kBF16, kF16, kF32, kF8E4M3, kI32, kI64, kU8 };

// "BF16" / "F16" / "F32" / "F8_E4M3" / "I32" / "I64" / "U8".
const char* DTypeName(DType dtype);
// Bytes per element: 2, 2, 4, 1, 4, 8, 1.
size_t DTypeSize(DType dtype);
// True for the float dtypes ToFloat32 converts (BF16, F16, F32, F8_E4M3).
bool IsFloatDType(DType dtype);
// Parses a safetensors dtype string. INVALID_ARGUMENT for anything but the types above.
absl::StatusOr<DType> ParseDType(std::string_view name);
// "[a, b, c]" for error messages.
std::string ShapeToString(const std::vector<int64_t>& shape);

// A tensor inside a mapped safetensors file. `data` points into the read-only mapping owned by the
// SafetensorsFile / SafetensorsReader that produced the view and is valid as long as that object
// lives; it is not necessarily aligned to the element size.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // row-major; [] is a scalar (numel 1)
  const uint8_t* data = nullptr;
  size_t nbytes = 0;  // numel · DTypeSize(dtype)
  std::string file;   // path of the file holding the tensor

  int64_t numel() const;
};

// Converts `view` to float32 (exact for every float dtype; integer dtypes are INVALID_ARGUMENT) into out[0 .. numel). Large tensors are
// converted in parallel (OpenMP). INVALID_ARGUMENT (naming file and tensor) if the view is
// inconsistent (nbytes ≠ numel · itemsize, or null data for a non-empty tensor).
absl::Status ToFloat32(const TensorView& view, float* out);
// As above, returning a new vector of numel floats.
absl::StatusOr<std::vector<float>> ToFloat32(const TensorView& view);

// One memory-mapped, fully validated safetensors file. Movable, not copyable.
class SafetensorsFile {
 public:
  // Maps `path` read-only and validates the header: 8-byte LE length within the file, JSON
  // object, every entry with a supported dtype, non-negative shape, data_offsets [begin, end]
  // with end − begin = numel·itemsize, inside the data region, no two tensors overlapping;
  // `__metadata__` (string → string) is allowed. NOT_FOUND if the file cannot be opened;
  // INVALID_ARGUMENT (naming the file, and the tensor where one is at fault) otherwise —
  // including a truncated file.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&&) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensors sorted by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // The tensor called `name`, or nullptr.
  const TensorView* Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void Unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::vector<TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All tensors of a checkpoint: one safetensors file, or the shards of an index. Movable.
class SafetensorsReader {
 public:
  // Opens a checkpoint directory: `model.safetensors` if present (as HF does), else
  // `model.safetensors.index.json`. NOT_FOUND (naming the directory) if neither exists.
  static absl::StatusOr<SafetensorsReader> OpenDir(const std::string& dir);
  // Opens a single safetensors file (see SafetensorsFile::Open for the errors).
  static absl::StatusOr<SafetensorsReader> OpenFile(const std::string& path);
  // Opens a sharded checkpoint from its index (`weight_map`: tensor name → shard file relative to
  // the index's directory). Errors: malformed index → INVALID_ARGUMENT naming the index; a shard
  // that does not exist → NOT_FOUND naming the index, the shard and a tensor mapped to it; a
  // tensor listed in the index but missing from its shard, present in a shard the index does not
  // map it to, or duplicated across shards → INVALID_ARGUMENT naming the files and the tensor.
  static absl::StatusOr<SafetensorsReader> OpenIndex(const std::string& index_path);

  // Tensors of all files, sorted by name.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // The tensor called `name`, or nullptr.
  const TensorView* Find(const std::string& name) const;
  // What was opened: the single file or the index (for error messages).
  const std::string& source() const { return source_; }
  // Paths of the mapped files.
  std::vector<std::string> files() const;

 private:
  void Finish();  // sorts tensors_ and builds the name index

  std::string source_;
  std::vector<SafetensorsFile> files_;
  std::vector<TensorView> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
};

// A tensor to write. `fill` receives a buffer of NumBytes() bytes to fill with the little-endian
// element data; it is called once, in name order, so producers need not keep everything in memory.
struct TensorSource {
  std::string name;
  DType dtype = DType::kBF16;
  std::vector<int64_t> shape;
  std::function<absl::Status(uint8_t* dst)> fill;

  int64_t numel() const;
  size_t NumBytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
};

// A TensorSource copying NumBytes() bytes from `data`, which must outlive the write.
TensorSource TensorFromBuffer(std::string name, DType dtype, std::vector<int64_t> shape,
                              const void* data);

// The 5 GB default shard size of HF `save_pretrained` (max_shard_size="5GB" = 5·10^9 bytes).
inline constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;

struct SafetensorsWriteOptions {
  // Tensor bytes per shard; a checkpoint whose tensors total more is sharded (a single tensor
  // larger than this gets a shard of its own).
  int64_t max_shard_bytes = kDefaultMaxShardBytes;
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
};

// Builds the header bytes of a safetensors file holding `tensors` in the given order (JSON with
// keys sorted by name, `__metadata__` if non-empty, padded with spaces to a multiple of 8), and
// the 8-byte length prefix. INVALID_ARGUMENT on an empty/duplicate name or a negative dimension.
absl::StatusOr<std::string> BuildSafetensorsHeader(const std::vector<const TensorSource*>& tensors,
                                                   const std::map<std::string, std::string>& meta);

// Writes one safetensors file at `path` (via a temporary file renamed into place): data in name
// order. Errors: INVALID_ARGUMENT for bad tensors (see BuildSafetensorsHeader), a fill error is
// returned as is, INTERNAL (naming the path) on I/O failure.
absl::Status WriteSafetensorsFile(const std::string& path, std::vector<TensorSource> tensors,
                                  const std::map<std::string, std::string>& metadata = {
                                      {"format", "pt"}});

// Writes a checkpoint into directory `dir` (created if needed): `model.safetensors` when the total
// tensor bytes ≤ max_shard_bytes, else `model-0000i-of-0000N.safetensors` (tensors in name order,
// greedily packed) + `model.safetensors.index.json` with metadata.total_size and weight_map.
// Stale model.safetensors / index / shard files in `dir` are removed first. Errors as
// WriteSafetensorsFile; INVALID_ARGUMENT if max_shard_bytes ≤ 0.
absl::Status WriteSafetensors(const std::string& dir, std::vector<TensorSource> tensors,
                              const SafetensorsWriteOptions& options = {});

}  // namespace dgserve
