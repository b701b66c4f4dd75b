// Command-line set-up shared by dgserve's programs: `--help` lists the program's own flags
// (Abseil's default only lists flags defined in a file named like the binary) and exits 0, and
// `--version` names the project.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace dgserve {

// What --version prints for every program (Abseil's default, from a libabsl built without
// NDEBUG, said "Debug build (NDEBUG not #defined)" of a release build).
inline std::string VersionString() { return "dgserve (DiffusionGemma serving) 0.1\n"; }

// Sets the usage text and makes --help/--helpshort list the flags defined in files whose path
// contains `flags_file` (e.g. "tools/dgserve_main.cc"), and the backend's own (--cpu_gemm_input,
// --cuda_gemm_input: worker/backend_flags.cc) where the program links them. Call before
// ParseCommandLine (below).
inline void InitCommandLine(const std::string& usage, const std::string& flags_file) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = [flags_file](absl::string_view f) {
    return absl::StrContains(f, flags_file) || absl::StrContains(f, "worker/backend_flags.cc");
  };
  config.contains_help_flags = config.contains_helpshort_flags;
  config.version_string = VersionString;
  absl::SetFlagsUsageConfig(config);
}

// Abseil's help flags (--help, --help=SUBSTRING, --helpfull, --helpshort, --helppackage,
// --helpon=FILE, --helpmatch=SUBSTRING) in argv[1..argc) before "--", as Abseil reads them: one
// or two dashes, "=VALUE" or not; an argument that is the value of the flag before it (a flag
// other than a bool one, given without "=") is not a flag. Tells Abseil the help mode of each.
inline bool DeduceHelpFlags(int argc, char** argv) {
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') continue;
    arg.remove_prefix(arg[1] == '-' ? 2 : 1);
    const size_t eq = arg.find('=');
    const absl::string_view name = arg.substr(0, eq);
    const absl::string_view value =
        eq == absl::string_view::npos ? absl::string_view() : arg.substr(eq + 1);
    if (name == "help" || name == "helpfull" || name == "helpshort" || name == "helppackage" ||
        name == "helpon" || name == "helpmatch") {
      absl::flags_internal::DeduceUsageFlags(name, value);
      help = true;
    } else if (eq == absl::string_view::npos) {
      const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
      if (flag != nullptr && !flag->IsOfType<bool>()) ++i;  // argv[i + 1] is its value
    }
  }
  return help;
}

// absl::ParseCommandLine, except that a help flag (DeduceHelpFlags) prints Abseil's usage text
// of the program (as InitCommandLine set it up) on stdout and exits 0, before any other flag is
// parsed. Abseil's own handling exits 1 after --help in the version Debian 12 ships
// (20220623), 0 in later ones; a user expects 0, as from every other program's --help.
inline std::vector<char*> ParseCommandLine(int argc, char** argv) {
  if (DeduceHelpFlags(argc, argv)) {
    if (argc > 0) absl::flags_internal::SetProgramInvocationName(argv[0]);  // the text's first word
    absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage());
    std::cout.flush();
    std::exit(0);
  }
  return absl::ParseCommandLine(argc, argv);
}

// The whole main() of a flags-only tool: InitCommandLine, parse, refuse positional arguments,
// run `run` (an exception becomes INTERNAL rather than a crash) and print a failure as
// "PROGRAM: STATUS" on stderr. Returns the process exit status: 0, or 1 on any error.
inline int RunFlagsOnlyTool(int argc, char** argv, const char* program, const std::string& usage,
                            const std::string& flags_file,
                            const std::function<absl::Status()>& run) {
  InitCommandLine(usage, flags_file);
  std::vector<char*> positional = ParseCommandLine(argc, argv);
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
