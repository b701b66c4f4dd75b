// OpenMP wait policy for our binaries.
//
// libgomp's worker threads spin before sleeping. When the machine has other work (a build, a
// second service, ctest running tests side by side), a spinning thread holds a core that the
// thread it waits for needs, and every parallel region can cost a whole scheduler time slice:
// a tiny model's step goes from ~1 ms to ~700 ms. Passive waiting costs a few microseconds per
// region. libgomp reads OMP_WAIT_POLICY once, while the library loads, so main() cannot just set
// it: this re-executes the program with OMP_WAIT_POLICY=passive unless the user chose a policy.
#pragma once

#include <unistd.h>

#include <cstdlib>

namespace dgserve {

// Call first thing in main(). Returns only if no re-exec was needed or the re-exec failed.
inline void UsePassiveOpenMpWaitUnlessSet(char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  ::setenv("OMP_WAIT_POLICY", "passive", 1);
  ::execv("/proc/self/exe", argv);  // on failure, carry on with the current policy
}

}  // namespace dgserve
