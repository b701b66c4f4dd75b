// Temporary directories for tests that are removed, with their contents, when the test process
// exits normally (a crashed test leaves its directory for inspection). Tests made directories
// with mkdtemp and never removed them: about 330 MB a run of engine/model/quant_test alone.
#pragma once

#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>
#include <vector>

namespace dgserve::testing {
namespace temp_dir_internal {

struct Registry {
  std::mutex mu;
  std::vector<std::string> dirs;
  pid_t pid = getpid();  // a forked child that calls exit() removes nothing of its parent's
};
// Never destroyed: the removal runs from std::atexit, after or between static destructors.
inline Registry& Dirs() {
  static auto* r = new Registry;
  return *r;
}
inline void RemoveAll() {
  Registry& r = Dirs();
  std::lock_guard<std::mutex> lock(r.mu);
  if (getpid() != r.pid) return;
  for (const std::string& d : r.dirs) {
    std::error_code ignored;
    std::filesystem::remove_all(d, ignored);
  }
  r.dirs.clear();
}

}  // namespace temp_dir_internal

// A new directory "<base>/<prefix>_XXXXXX" (mkdtemp), removed with its contents when the process
// exits normally; "" when it cannot be made.
inline std::string MakeTempDirRemovedAtExit(const std::string& prefix,
                                            const std::string& base = "/tmp") {
  std::string tmpl = base + "/" + prefix + "_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  temp_dir_internal::Registry& r = temp_dir_internal::Dirs();
  static const bool registered = std::atexit(temp_dir_internal::RemoveAll) == 0;
  (void)registered;
  std::lock_guard<std::mutex> lock(r.mu);
  r.dirs.push_back(tmpl);
  return tmpl;
}

}  // namespace dgserve::testing
