// Command-line set-up shared by dgserve's programs: `--help` lists the program's own flags
// (Abseil's default only lists flags defined in a file named like the binary), and `--version`
// names the project.
#pragma once

#include <string>

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace dgserve {

// Sets the usage text and makes --help/--helpshort list the flags defined in files whose path
// contains `flags_file` (e.g. "tools/dgserve_main.cc"). Call before absl::ParseCommandLine.
inline void InitCommandLine(const std::string& usage, const std::string& flags_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [flags_file](absl::string_view f) {
    return absl::StrContains(f, flags_file);
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  config.version_string = [] { return std::string("dgserve (DiffusionGemma serving) 0.1\n"); };
  absl::SetFlagsUsageConfig(config);
}

}  // namespace dgserve
