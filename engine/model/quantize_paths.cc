// dgserve-quantize's default ignore list and its --in / --out checks (quantize_checkpoint.h),
// apart from the checkpoint writer: they read no tensor.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/model/quantize_checkpoint.h"

namespace dgserve {

namespace fs = std::filesystem;

std::vector<std::string> DefaultQuantizeIgnore() {
  return {"lm_head", "re:.*embed_tokens.*", "re:.*router.*", "re:.*norm.*",
          "re:.*self_conditioning.*"};
}

absl::Status CheckQuantizePaths(const std::string& in, const std::string& out) {
  if (in.empty() || out.empty())
    return absl::InvalidArgumentError("--in DIR and --out DIR are required");
  std::error_code ec;
  if (fs::exists(out, ec) && fs::equivalent(in, out, ec)) {
    return absl::InvalidArgumentError("--out must differ from --in");
  }
  // --out inside --in, by any path: out's symlinks and ".." resolved (weakly_canonical: its
  // missing tail lexically), then each existing directory above it compared with --in as a file
  // (fs::equivalent: the same device and inode, whatever path or mount reaches it).
  const fs::path resolved = fs::weakly_canonical(fs::absolute(out, ec), ec);
  if (ec) {  // e.g. a symlink loop (ELOOP) or an unreadable directory on the way
    return absl::InvalidArgumentError(
        absl::StrCat("--out ", out, ": cannot resolve the path: ", ec.message()));
  }
  for (fs::path p = resolved; !p.empty(); p = p.parent_path()) {
    if (fs::exists(p, ec) && fs::equivalent(p, in, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--out ", out, " is inside --in ", in, " (", resolved.string(),
                       "): the quantized checkpoint would be written into its source"));
    }
    if (p == p.parent_path()) break;
  }
  // What fs::create_directories(out) and the writes into it would find only at the end: the
  // nearest existing path of out and its parents must be a directory we can write to (the
  // missing ones below it are created).
  fs::path p(out);
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  if (!fs::exists(p, ec)) p = ".";  // a relative path none of whose components exist
  if (!fs::is_directory(p, ec)) {
    return absl::InvalidArgumentError(
        p == fs::path(out)
            ? absl::StrCat("--out ", out, " exists and is not a directory")
            : absl::StrCat("--out ", out, ": ", p.string(), " exists and is not a directory"));
  }
  if (access(p.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--out ", out, ": ",
                                                   p == fs::path(out) ? "" : p.string() + " ",
                                                   "is not writable: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace dgserve
