#include "gateway/request_ids.h"

#include <fcntl.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace dgserve {
namespace {

// /dev/urandom, for kernels without getrandom(2) (before Linux 3.17).
absl::Status ReadUrandom(uint8_t* p, size_t n) {
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("no CSPRNG: getrandom(2) is not available and ",
                                            "/dev/urandom cannot be opened: ",
                                            std::strerror(errno)));
  }
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("reading /dev/urandom failed: ",
                                              got == 0 ? "end of file" : std::strerror(err)));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  ::close(fd);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RandomHex128() {
  char bytes[16];
  if (absl::Status s = SecureRandomBytes(bytes, sizeof(bytes)); !s.ok()) return s;
  return absl::BytesToHexString(absl::string_view(bytes, sizeof(bytes)));
}

}  // namespace

absl::Status SecureRandomBytes(void* buf, size_t n) {
  auto* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    const ssize_t got = ::getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSYS) return ReadUrandom(p, n);
      return absl::InternalError(absl::StrCat("getrandom failed: ", std::strerror(errno)));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NewRequestId() { return RandomHex128(); }

absl::StatusOr<std::string> NewInternalId() {
  absl::StatusOr<std::string> hex = RandomHex128();
  if (!hex.ok()) return hex.status();
  return absl::StrCat("att-", *hex);
}

absl::StatusOr<uint64_t> NewRandomSeed() {
  uint64_t v = 0;
  if (absl::Status s = SecureRandomBytes(&v, sizeof(v)); !s.ok()) return s;
  return v >> 1;
}

}  // namespace dgserve
