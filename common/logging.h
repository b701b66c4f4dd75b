// The project's one logging choice: a tiny stderr logger (Debian's Abseil has no absl/log).
#pragma once

#include <cstdio>

#include "absl/strings/str_format.h"

namespace dgserve {
enum class LogLevel { kInfo, kWarning, kError };

template <typename... Args>
void Log(LogLevel level, const absl::FormatSpec<Args...>& format, const Args&... args) {
  static const char* const kNames[] = {"I", "W", "E"};
  std::fprintf(stderr, "[%s] %s\n", kNames[static_cast<int>(level)],
               absl::StrFormat(format, args...).c_str());
}
}  // namespace dgserve

#define DGSERVE_LOG_INFO(...) ::dgserve::Log(::dgserve::LogLevel::kInfo, __VA_ARGS__)
#define DGSERVE_LOG_WARNING(...) ::dgserve::Log(::dgserve::LogLevel::kWarning, __VA_ARGS__)
#define DGSERVE_LOG_ERROR(...) ::dgserve::Log(::dgserve::LogLevel::kError, __VA_ARGS__)
