// Runs the dgserve-loadgen binary (DGSERVE_LOADGEN_BIN, defined by the test target) for the
// tests that drive it against loopback servers, and collects its exit status and stdout.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace dgserve::loadgen::testing {

struct LoadgenRun {
  int exit_status = -1;
  std::string out;  // stdout
};

// Runs `DGSERVE_LOADGEN_BIN --progress=false ARGS` and waits for it to exit.
inline LoadgenRun RunLoadgen(const std::string& args) {
  const std::string cmd = absl::StrCat(DGSERVE_LOADGEN_BIN, " --progress=false ", args);
  LoadgenRun r;
  FILE* p = popen(cmd.c_str(), "r");
  EXPECT_NE(p, nullptr) << cmd;
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace dgserve::loadgen::testing
