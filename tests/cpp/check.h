// The checks of the C++ unit tests: Check() records a failure and goes on;
// Finish() prints "<NAME>_OK checks=<n>" or the failures and gives the exit
// code (tests/test_cpp_units.py looks for the line).
#ifndef HERRING_TESTS_CPP_CHECK_H_
#define HERRING_TESTS_CPP_CHECK_H_

#include <atomic>
#include <cstdio>
#include <string>

namespace herring::test {

inline std::atomic<int> checks{0};
inline std::atomic<int> failures{0};

inline void Check(bool ok, const std::string& what) {
  ++checks;
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

inline int Finish(const char* name) {
  if (failures > 0) {
    std::fprintf(stderr, "%s_FAILED failures=%d checks=%d\n", name, failures.load(),
                 checks.load());
    return 1;
  }
  std::printf("%s_OK checks=%d\n", name, checks.load());
  return 0;
}

}  // namespace herring::test

#endif  // HERRING_TESTS_CPP_CHECK_H_
