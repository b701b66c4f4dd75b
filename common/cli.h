// Command-line set-up shared by dgserve's programs: `--help` lists the program's own flags
// (Abseil's default only lists flags defined in a file named like the binary), and `--version`
// names the project.
#pragma once

#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace dgserve {

// Sets the usage text and makes --help/--helpshort list the flags defined in files whose path
// contains `flags_file` (e.g. "tools/dgserve_main.cc"), and the backend's own (--cpu_gemm_input,
// --cuda_gemm_input: worker/backend_flags.cc) where the program links them. Call before
// absl::ParseCommandLine.
inline void InitCommandLine(const std::string& usage, const std::string& flags_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [flags_file](absl::string_view f) {
    return absl::StrContains(f, flags_file) || absl::StrContains(f, "worker/backend_flags.cc");
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  config.version_string = [] { return std::string("dgserve (DiffusionGemma serving) 0.1\n"); };
  absl::SetFlagsUsageConfig(config);
}

// The whole main() of a flags-only tool: InitCommandLine, parse, refuse positional arguments,
// run `run` (an exception becomes INTERNAL rather than a crash) and print a failure as
// "PROGRAM: STATUS" on stderr. Returns the process exit status: 0, or 1 on any error.
inline int RunFlagsOnlyTool(int argc, char** argv, const char* program, const std::string& usage,
                            const std::string& flags_file,
                            const std::function<absl::Status()>& run) {
  InitCommandLine(usage, flags_file);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (flags only; see --help)\n", program,
                 positional[1]);
    return 1;
  }
  absl::Status status;
  try {
    status = run();
  } catch (const std::exception& e) {
    status = absl::InternalError(e.what());
  }
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, status.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace dgserve
