#include "engine/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "common/fp8.h"
#include "common/status_macros.h"
#include "engine/model/config.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference implementation
constexpr int64_t kParallelMinElements = int64_t{1} << 16;
constexpr char kIndexName[] = "model.safetensors.index.json";
constexpr char kSingleName[] = "model.safetensors";

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

absl::Status Invalid(const std::string& file, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", what));
}

// Validates one header entry and appends its view (data pointer filled in later).
absl::Status ParseEntry(const std::string& path, const std::string& name, const json& entry,
                        uint64_t data_size, TensorView* view, uint64_t* begin, uint64_t* end) {
  auto bad = [&](const std::string& what) {
    return Invalid(path, absl::StrCat("tensor '", name, "': ", what));
  };
  if (name.empty()) return Invalid(path, "header has a tensor with an empty name");
  if (!entry.is_object()) return bad("header entry is not a JSON object");
  auto dt = entry.find("dtype");
  auto sh = entry.find("shape");
  auto off = entry.find("data_offsets");
  if (dt == entry.end() || !dt->is_string()) return bad("missing or non-string 'dtype'");
  if (sh == entry.end() || !sh->is_array()) return bad("missing or non-array 'shape'");
  if (off == entry.end() || !off->is_array() || off->size() != 2) {
    return bad("'data_offsets' must be an array [begin, end]");
  }
  auto dtype = ParseDType(dt->get<std::string>());
  if (!dtype.ok()) return bad(std::string(dtype.status().message()));
  view->name = name;
  view->dtype = *dtype;
  view->file = path;
  int64_t numel = 1;
  for (const json& d : *sh) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      return bad(absl::StrCat("shape entries must be non-negative integers, got ", sh->dump()));
    }
    view->shape.push_back(d.get<int64_t>());
    if (MulOverflows(numel, d.get<int64_t>(), &numel)) return bad("shape overflows int64");
  }
  for (const json& o : *off) {
    if (!o.is_number_integer() || o.get<int64_t>() < 0) {
      return bad(absl::StrCat("data_offsets must be non-negative integers, got ", off->dump()));
    }
  }
  *begin = (*off)[0].get<uint64_t>();
  *end = (*off)[1].get<uint64_t>();
  int64_t nbytes;
  if (MulOverflows(numel, static_cast<int64_t>(DTypeSize(*dtype)), &nbytes)) {
    return bad("byte size overflows int64");
  }
  if (*end < *begin) return bad(absl::StrCat("data_offsets [", *begin, ", ", *end, "] decrease"));
  if (*end - *begin != static_cast<uint64_t>(nbytes)) {
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end, "] span ", *end - *begin,
                            " bytes but shape ", ShapeToString(view->shape), " × ",
                            DTypeName(*dtype), " needs ", nbytes));
  }
  if (*end > data_size) {
    return bad(absl::StrCat("data_offsets [", *begin, ", ", *end,
                            "] run past the end of the data region (", data_size,
                            " bytes): file truncated or header corrupt"));
  }
  view->nbytes = static_cast<size_t>(nbytes);
  return absl::OkStatus();
}

// numel · itemsize of a tensor to write; INVALID_ARGUMENT on a negative dim or overflow.
absl::StatusOr<uint64_t> CheckedBytes(const TensorSource& t) {
  int64_t n = static_cast<int64_t>(DTypeSize(t.dtype));
  for (int64_t d : t.shape) {
    if (d < 0 || MulOverflows(n, d, &n) || n > (int64_t{1} << 50)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' has a negative or too large shape ", ShapeToString(t.shape)));
    }
  }
  return static_cast<uint64_t>(n);
}

absl::Status WriteAll(std::FILE* f, const void* data, size_t n, const std::string& path) {
  if (n != 0 && std::fwrite(data, 1, n, f) != n) {
    return absl::InternalError(absl::StrCat("write to ", path, " failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF32:
      return "F32";
    case DType::kF8E4M3:
      return "F8_E4M3";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kU8: return "U8";
  }
  return "?";
}

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF8E4M3:
    case DType::kU8: return 1;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
  }
  return 4;
}

bool IsFloatDType(DType dtype) {
  return dtype != DType::kI32 && dtype != DType::kI64 && dtype != DType::kU8;
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F32") return DType::kF32;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "I32") return DType::kI32;
  if (name == "I64") return DType::kI64;
  if (name == "U8") return DType::kU8;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(name),
                   "' (supported: BF16, F16, F32, F8_E4M3, I32, I64, U8)"));
}

std::string ShapeToString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t TensorSource::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

absl::Status ToFloat32(const TensorView& view, float* out) {
  const int64_t n = view.numel();
  if (static_cast<size_t>(n) * DTypeSize(view.dtype) != view.nbytes ||
      (n > 0 && view.data == nullptr)) {
    return Invalid(view.file, absl::StrCat("tensor '", view.name, "': view holds ", view.nbytes,
                                           " bytes for shape ", ShapeToString(view.shape)));
  }
  const uint8_t* p = view.data;
  switch (view.dtype) {
    case DType::kI32:
    case DType::kI64:
    case DType::kU8:
      return Invalid(view.file, absl::StrCat("tensor '", view.name, "' has integer dtype ",
                                             DTypeName(view.dtype), " where a float is expected"));
    case DType::kF8E4M3:
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
      for (int64_t i = 0; i < n; ++i) out[i] = E4m3ToFloat(p[i]);
      break;
    case DType::kBF16:
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = Bf16ToFloat(h);
      }
      break;
    case DType::kF16:
#pragma omp parallel for schedule(static) if (n >= kParallelMinElements)
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = HalfToFloat(h);
      }
      break;
    case DType::kF32: {
      constexpr int64_t kChunk = int64_t{1} << 20;
      const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (chunks > 1)
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t b = c * kChunk, e = std::min(n, b + kChunk);
        std::memcpy(out + b, p + 4 * b, static_cast<size_t>(e - b) * 4);
      }
      break;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ToFloat32(const TensorView& view) {
  std::vector<float> out(static_cast<size_t>(std::max<int64_t>(view.numel(), 0)));
  DGSERVE_RETURN_IF_ERROR(ToFloat32(view, out.data()));
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept { *this = std::move(o); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    Unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_size_ = std::exchange(o.map_size_, 0);
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Unmap(); }

void SafetensorsFile::Unmap() {
  if (map_ != nullptr) munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
}

const TensorView* SafetensorsFile::Find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const TensorView& v, const std::string& n) { return v.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::NotFoundError(absl::StrCat(path, " is not a regular file"));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Invalid(path, absl::StrCat("file of ", size,
                                      " bytes is too short for a safetensors header (truncated)"));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap of ", path, " failed: ", std::strerror(errno)));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.map_ = map;
  file.map_size_ = size;
  const uint8_t* base = static_cast<const uint8_t*>(map);

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len == 0 || header_len > kMaxHeaderBytes || header_len > size - 8) {
    return Invalid(path, absl::StrCat("bad header length ", header_len, " (file has ", size,
                                      " bytes): not a safetensors file, or truncated"));
  }
  const std::string_view text(reinterpret_cast<const char*>(base + 8), header_len);
  if (text.front() != '{') return Invalid(path, "header does not start with '{'");
  // Reject duplicate top-level keys (nlohmann would silently keep the last one).
  std::string duplicate;
  std::set<std::string> keys;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && parsed.is_string() &&
        !keys.insert(parsed.get<std::string>()).second && duplicate.empty()) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  json header = json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return Invalid(path, "header is not valid JSON (corrupt header)");
  }
  if (!duplicate.empty()) {
    return Invalid(path, absl::StrCat("tensor '", duplicate, "' appears twice in the header"));
  }
  const uint64_t data_size = size - 8 - header_len;
  const uint8_t* data = base + 8 + header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // (begin, end), parallel to tensors_
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it->is_object()) return Invalid(path, "__metadata__ must be a JSON object");
      for (auto m = it->begin(); m != it->end(); ++m) {
        if (!m->is_string()) {
          return Invalid(path, absl::StrCat("__metadata__ value '", m.key(), "' is not a string"));
        }
        file.metadata_[m.key()] = m->get<std::string>();
      }
      continue;
    }
    TensorView view;
    uint64_t begin = 0, end = 0;
    DGSERVE_RETURN_IF_ERROR(ParseEntry(path, it.key(), *it, data_size, &view, &begin, &end));
    view.data = data + begin;
    file.tensors_.push_back(std::move(view));
    ranges.emplace_back(begin, end);
  }
  // Overlaps: sort the non-empty ranges by start.
  std::vector<size_t> order;
  for (size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].second > ranges[i].first) order.push_back(i);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t prev = order[k - 1], cur = order[k];
    if (ranges[cur].first < ranges[prev].second) {
      return Invalid(path, absl::StrCat("tensor '", file.tensors_[cur].name, "' data_offsets [",
                                        ranges[cur].first, ", ", ranges[cur].second,
                                        "] overlap tensor '", file.tensors_[prev].name, "' [",
                                        ranges[prev].first, ", ", ranges[prev].second, "]"));
    }
  }
  std::sort(file.tensors_.begin(), file.tensors_.end(),
            [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  return file;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsReader

void SafetensorsReader::Finish() {
  std::sort(tensors_.begin(), tensors_.end(),
            [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  by_name_.clear();
  for (size_t i = 0; i < tensors_.size(); ++i) by_name_.emplace(tensors_[i].name, i);
}

const TensorView* SafetensorsReader::Find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::vector<std::string> SafetensorsReader::files() const {
  std::vector<std::string> out;
  for (const SafetensorsFile& f : files_) out.push_back(f.path());
  return out;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::OpenDir(const std::string& dir) {
  const fs::path single = fs::path(dir) / kSingleName;
  const fs::path index = fs::path(dir) / kIndexName;
  std::error_code ec;
  if (fs::exists(single, ec)) return OpenFile(single.string());
  if (fs::exists(index, ec)) return OpenIndex(index.string());
  return absl::NotFoundError(
      absl::StrCat(dir, ": neither ", kSingleName, " nor ", kIndexName, " exists"));
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::OpenFile(const std::string& path) {
  DGSERVE_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
  SafetensorsReader r;
  r.source_ = path;
  r.tensors_ = file.tensors();
  r.files_.push_back(std::move(file));
  r.Finish();
  return r;
}

absl::StatusOr<SafetensorsReader> SafetensorsReader::OpenIndex(const std::string& index_path) {
  DGSERVE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(index_path));
  json index = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.is_object()) {
    return Invalid(index_path, "index is not a valid JSON object");
  }
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) {
    return Invalid(index_path, "index has no 'weight_map' object");
  }
  std::map<std::string, std::vector<std::string>> by_shard;  // shard → tensor names
  std::map<std::string, std::string> shard_of;               // tensor → shard
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it->is_string()) {
      return Invalid(index_path, absl::StrCat("weight_map entry for tensor '", it.key(),
                                              "' is not a file name"));
    }
    const std::string shard = it->get<std::string>();
    const fs::path sp(shard);
    bool bad = shard.empty() || sp.is_absolute();
    for (const auto& part : sp) bad |= part == "..";
    if (bad) {
      return Invalid(index_path, absl::StrCat("tensor '", it.key(), "' maps to invalid shard '",
                                              shard, "' (must be a relative path)"));
    }
    by_shard[shard].push_back(it.key());
    shard_of[it.key()] = shard;
  }
  const fs::path base = fs::path(index_path).parent_path();
  SafetensorsReader r;
  r.source_ = index_path;
  std::map<std::string, std::string> seen_in;  // tensor → shard path it was found in
  for (const auto& [shard, names] : by_shard) {
    const std::string path = (base / shard).string();
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      return absl::NotFoundError(absl::StrCat(index_path, ": shard ", path, " (holding tensor '",
                                              names.front(), "' and ", names.size() - 1,
                                              " more) does not exist"));
    }
    auto file = SafetensorsFile::Open(path);
    if (!file.ok()) {
      return absl::Status(
          file.status().code(),
          absl::StrCat(file.status().message(), " [shard of ", index_path, " holding tensor '",
                       names.front(), "' and ", names.size() - 1, " more]"));
    }
    for (const TensorView& v : file->tensors()) {
      if (auto prev = seen_in.find(v.name); prev != seen_in.end()) {
        return Invalid(path,
                       absl::StrCat("tensor '", v.name, "' is duplicated: also in ", prev->second));
      }
      seen_in[v.name] = path;
      auto mapped = shard_of.find(v.name);
      if (mapped == shard_of.end()) {
        return Invalid(path, absl::StrCat("tensor '", v.name, "' is not listed in ", index_path));
      }
      if (mapped->second != shard) {
        return Invalid(path, absl::StrCat("tensor '", v.name, "' is duplicated: ", index_path,
                                          " maps it to ", mapped->second));
      }
      r.tensors_.push_back(v);
    }
    for (const std::string& name : names) {
      if (file->Find(name) == nullptr) {
        return Invalid(path, absl::StrCat("tensor '", name, "' listed in ", index_path,
                                          " is missing from this shard"));
      }
    }
    r.files_.push_back(*std::move(file));
  }
  r.Finish();
  return r;
}

// ---------------------------------------------------------------------------------------------
// Writer

TensorSource TensorFromBuffer(std::string name, DType dtype, std::vector<int64_t> shape,
                              const void* data) {
  TensorSource t{std::move(name), dtype, std::move(shape), nullptr};
  const size_t n = t.NumBytes();
  t.fill = [data, n](uint8_t* dst) {
    if (n != 0) std::memcpy(dst, data, n);
    return absl::OkStatus();
  };
  return t;
}

absl::StatusOr<std::string> BuildSafetensorsHeader(const std::vector<const TensorSource*>& tensors,
                                                   const std::map<std::string, std::string>& meta) {
  json header = json::object();
  if (!meta.empty()) header["__metadata__"] = meta;
  uint64_t offset = 0;
  for (const TensorSource* t : tensors) {
    if (t->name.empty() || t->name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat("invalid tensor name '", t->name, "'"));
    }
    if (header.contains(t->name)) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t->name, "' given twice"));
    }
    DGSERVE_ASSIGN_OR_RETURN(const uint64_t n, CheckedBytes(*t));
    header[t->name] = {{"dtype", DTypeName(t->dtype)},
                       {"shape", t->shape},
                       {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const uint64_t len = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xFF);
  return out + text;
}

namespace {

absl::Status WriteFileImpl(const std::string& path, const std::vector<const TensorSource*>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  DGSERVE_ASSIGN_OR_RETURN(std::string header, BuildSafetensorsHeader(tensors, metadata));
  size_t max_bytes = 0;
  for (const TensorSource* t : tensors) max_bytes = std::max(max_bytes, t->NumBytes());
  std::unique_ptr<uint8_t[]> buffer(new (std::nothrow) uint8_t[std::max<size_t>(max_bytes, 1)]);
  if (buffer == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", max_bytes, " bytes to write ", path));
  }
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("cannot create ", tmp, ": ", std::strerror(errno)));
  }
  absl::Status status = WriteAll(f, header.data(), header.size(), path);
  for (const TensorSource* t : tensors) {
    if (!status.ok()) break;
    if (!t->fill) {
      status = absl::InvalidArgumentError(absl::StrCat("tensor '", t->name, "' has no data"));
      break;
    }
    status = t->fill(buffer.get());
    if (status.ok()) status = WriteAll(f, buffer.get(), t->NumBytes(), path);
  }
  if (std::fclose(f) != 0 && status.ok()) {
    status = absl::InternalError(absl::StrCat("closing ", path, " failed: ", std::strerror(errno)));
  }
  std::error_code ec;
  if (status.ok()) {
    fs::rename(tmp, path, ec);
    if (ec) status = absl::InternalError(absl::StrCat("rename to ", path, ": ", ec.message()));
  }
  if (!status.ok()) fs::remove(tmp, ec);
  return status;
}

std::vector<const TensorSource*> SortedByName(const std::vector<TensorSource>& tensors) {
  std::vector<const TensorSource*> out;
  for (const TensorSource& t : tensors) out.push_back(&t);
  std::sort(out.begin(), out.end(),
            [](const TensorSource* a, const TensorSource* b) { return a->name < b->name; });
  return out;
}

}  // namespace

absl::Status WriteSafetensorsFile(const std::string& path, std::vector<TensorSource> tensors,
                                  const std::map<std::string, std::string>& metadata) {
  return WriteFileImpl(path, SortedByName(tensors), metadata);
}

absl::Status WriteSafetensors(const std::string& dir, std::vector<TensorSource> tensors,
                              const SafetensorsWriteOptions& options) {
  if (options.max_shard_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_shard_bytes must be > 0, got ", options.max_shard_bytes));
  }
  const std::vector<const TensorSource*> sorted = SortedByName(tensors);
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->name == sorted[i - 1]->name) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", sorted[i]->name, "' given twice"));
    }
  }
  uint64_t total = 0;
  for (const TensorSource* t : sorted) {
    DGSERVE_ASSIGN_OR_RETURN(const uint64_t n, CheckedBytes(*t));
    total += n;
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create directory ", dir, ": ", ec.message()));
  // Remove a previous checkpoint's files so the loader cannot pick up a stale one.
  static const std::regex kShard(R"(model-\d{5}-of-\d{5}\.safetensors)");
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == kSingleName || name == kIndexName || std::regex_match(name, kShard)) {
      fs::remove(entry.path(), ec);
    }
  }
  const uint64_t max_bytes = static_cast<uint64_t>(options.max_shard_bytes);
  if (total <= max_bytes) {
    return WriteFileImpl((fs::path(dir) / kSingleName).string(), sorted, options.metadata);
  }
  std::vector<std::vector<const TensorSource*>> shards(1);
  uint64_t current = 0;
  for (const TensorSource* t : sorted) {
    if (!shards.back().empty() && current + t->NumBytes() > max_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(t);
    current += t->NumBytes();
  }
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    DGSERVE_RETURN_IF_ERROR(
        WriteFileImpl((fs::path(dir) / name).string(), shards[s], options.metadata));
    for (const TensorSource* t : shards[s]) weight_map[t->name] = name;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string index_path = (fs::path(dir) / kIndexName).string();
  std::FILE* f = std::fopen(index_path.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat("cannot create ", index_path, ": ", std::strerror(errno)));
  }
  const std::string text = index.dump(2) + "\n";
  absl::Status status = WriteAll(f, text.data(), text.size(), index_path);
  if (std::fclose(f) != 0 && status.ok()) {
    status = absl::InternalError(absl::StrCat("closing ", index_path, " failed"));
  }
  return status;
}

}  // namespace dgserve
