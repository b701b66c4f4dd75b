// What the machine can still give: memory and disk, for refusing work up front with a clear
// status instead of running out half way (a 50 GB checkpoint on a 24 GB machine).
#pragma once

#include <sys/statvfs.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace dgserve {

// MemAvailable from /proc/meminfo in bytes; nullopt where it cannot be read.
inline std::optional<uint64_t> AvailableMemoryBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return std::nullopt;
}

// This process's resident memory (VmRSS) and its peak (VmHWM) from /proc/self/status, in bytes;
// nullopt where they cannot be read.
inline std::optional<uint64_t> ProcStatusBytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) != 0) continue;
    return std::stoull(line.substr(field.size() + 1)) * 1024;
  }
  return std::nullopt;
}
inline std::optional<uint64_t> ResidentBytes() { return ProcStatusBytes("VmRSS"); }
inline std::optional<uint64_t> PeakResidentBytes() { return ProcStatusBytes("VmHWM"); }

// Free bytes (for an unprivileged writer) on the file system holding `path`, or its nearest
// existing ancestor; nullopt where it cannot be read.
inline std::optional<uint64_t> FreeDiskBytes(const std::string& path) {
  std::filesystem::path p = std::filesystem::absolute(path);
  std::error_code ec;
  while (!p.empty() && !std::filesystem::exists(p, ec)) {
    if (p == p.parent_path()) break;
    p = p.parent_path();
  }
  struct statvfs s;
  if (::statvfs(p.c_str(), &s) != 0) return std::nullopt;
  return uint64_t(s.f_bavail) * s.f_frsize;
}

}  // namespace dgserve
