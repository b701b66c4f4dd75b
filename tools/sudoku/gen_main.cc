// dgserve-sudoku-gen: writes seeded unique-solution Sudoku puzzles as JSONL, one object a line:
//   {"id": "<seed>-<i>", "puzzle": "<81 chars, '.' blanks>", "solution": "<81 digits>",
//    "givens": n}
//
//   dgserve-sudoku-gen --out valid.jsonl --count 300 --seed 2 --min_givens 24 --max_givens 45
//
// Puzzle i depends only on (seed, i): its generator seed is SplitMix64(seed * 1000003 + i) and
// its target givens min_givens + (SplitMix64(that seed) mod (max_givens - min_givens + 1)).
// A puzzle that cannot be cleared down to its target keeps more givens (see sudoku::Generate).
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/cli.h"
#include "tools/sudoku/sudoku.h"

ABSL_FLAG(std::string, out, "", "output JSONL file (required; written via FILE.tmp + rename)");
ABSL_FLAG(int64_t, count, 1, "number of puzzles (>= 1)");
ABSL_FLAG(uint64_t, seed, 0, "base seed; puzzle i depends only on (seed, i)");
ABSL_FLAG(int32_t, min_givens, 24, "smallest target number of givens (>= 17)");
ABSL_FLAG(int32_t, max_givens, 45, "largest target number of givens (<= 81)");

namespace dgserve::sudoku {
namespace {

// SplitMix64's output function applied to one value: a stateless 64-bit mix.
uint64_t Mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

absl::Status Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  const int64_t count = absl::GetFlag(FLAGS_count);
  const uint64_t seed = absl::GetFlag(FLAGS_seed);
  const int min_givens = absl::GetFlag(FLAGS_min_givens);
  const int max_givens = absl::GetFlag(FLAGS_max_givens);
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  if (count < 1) return absl::InvalidArgumentError(absl::StrCat("--count must be >= 1, got ", count));
  if (min_givens < 17 || max_givens > 81 || min_givens > max_givens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "need 17 <= --min_givens <= --max_givens <= 81, got --min_givens=%d --max_givens=%d",
        min_givens, max_givens));
  }

  const auto start = std::chrono::steady_clock::now();
  const std::string tmp = out + ".tmp";
  std::ofstream file(tmp, std::ios::out | std::ios::trunc);
  if (!file) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out: cannot open ", tmp, " for writing: ", std::strerror(errno)));
  }

  const uint64_t span = static_cast<uint64_t>(max_givens - min_givens + 1);
  std::vector<int64_t> histogram(82, 0);
  int64_t above_target = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t puzzle_seed = Mix(seed * 1000003ULL + static_cast<uint64_t>(i));
    const int target = min_givens + static_cast<int>(Mix(puzzle_seed) % span);
    const Puzzle p = Generate(puzzle_seed, target);
    if (p.givens > target) ++above_target;
    ++histogram[p.givens];
    const nlohmann::ordered_json line = {{"id", absl::StrCat(seed, "-", i)},
                                         {"puzzle", ToLine(p.puzzle)},
                                         {"solution", ToLine(p.solution)},
                                         {"givens", p.givens}};
    file << line.dump() << '\n';
  }
  file.close();
  std::error_code ec;
  if (!file) {
    std::filesystem::remove(tmp, ec);
    return absl::DataLossError(absl::StrCat("error writing ", tmp));
  }
  std::filesystem::rename(tmp, out, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    return absl::InvalidArgumentError(
        absl::StrCat("--out: cannot rename ", tmp, " to ", out, ": ", ec.message()));
  }

  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  int lo = 81, hi = 0;
  double sum = 0;
  for (int g = 0; g <= 81; ++g) {
    if (histogram[g] == 0) continue;
    lo = std::min(lo, g);
    hi = std::max(hi, g);
    sum += static_cast<double>(g) * static_cast<double>(histogram[g]);
  }
  std::fprintf(stderr,
               "dgserve-sudoku-gen: %lld puzzles -> %s | givens min %d max %d mean %.2f | %lld "
               "above target | %.2f s\n",
               static_cast<long long>(count), out.c_str(), lo, hi,
               sum / static_cast<double>(count), static_cast<long long>(above_target), seconds);
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve::sudoku

int main(int argc, char** argv) {
  return dgserve::RunFlagsOnlyTool(
      argc, argv, "dgserve-sudoku-gen",
      "Writes seeded unique-solution Sudoku puzzles as JSONL.\n"
      "  dgserve-sudoku-gen --out FILE --count N --seed S --min_givens A --max_givens B",
      "tools/sudoku/gen_main.cc", dgserve::sudoku::Run);
}
