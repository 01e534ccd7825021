// POSIX atomic file replacement: open/write/fsync/close a temporary, rename, fsync the directory;
// a file's type without std::filesystem's exceptions; reading a regular file whole.
#include "atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "chunkloss/core/error.h"

namespace chunkloss::model::detail {

std::string temp_path(const std::string& path) { return path + ".tmp"; }

void remove_file_quietly(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) ::unlink(path.c_str());
}

std::filesystem::file_type file_type_of(const std::string& path) {
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  CHUNKLOSS_CHECK(!ec || st.type() == std::filesystem::file_type::not_found, "cannot read ", path,
                  ": ", ec.message());
  return st.type();
}

void write_temp_file(const std::string& tmp, std::string_view bytes) {
  // (not through a symbolic link at the temporary's path, whose target the save would replace)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  CHUNKLOSS_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  const char* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      remove_file_quietly(tmp);
      CHUNKLOSS_FAIL("cannot write ", tmp, ": ", std::strerror(err));
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    remove_file_quietly(tmp);
    CHUNKLOSS_FAIL("cannot fsync ", tmp, ": ", std::strerror(err));
  }
  if (::close(fd) != 0) {
    const int err = errno;
    remove_file_quietly(tmp);
    CHUNKLOSS_FAIL("cannot close ", tmp, ": ", std::strerror(err));
  }
}

void rename_file(const std::string& tmp, const std::string& path) {
  CHUNKLOSS_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename ", tmp, " to ", path,
                  ": ", std::strerror(errno));
}

void sync_parent_dir(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  CHUNKLOSS_CHECK(fd >= 0, "cannot open directory ", dir.string(), ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  CHUNKLOSS_CHECK(rc == 0, "cannot fsync directory ", dir.string(), ": ", std::strerror(err));
}

std::string read_regular_file(const std::string& path, std::size_t start_bytes,
                              const StartCheck& check) {
  // Only a regular file is opened (opening a device may act on it). O_NONBLOCK in case that
  // changed since (a pipe without a writer would block the open); cleared once it is checked.
  struct stat st;
  CHUNKLOSS_CHECK(::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode), path,
                  " is not a regular file");  // (a failed stat: open names the reason below)
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  CHUNKLOSS_CHECK(fd >= 0, "cannot open ", path, ": ", std::strerror(errno));
  std::string bytes;
  try {
    CHUNKLOSS_CHECK(::fstat(fd, &st) == 0, "cannot read ", path, ": fstat: ", std::strerror(errno));
    CHUNKLOSS_CHECK(S_ISREG(st.st_mode), path, " is not a regular file");
    const int flags = ::fcntl(fd, F_GETFL);
    CHUNKLOSS_CHECK(flags >= 0 && ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0, "cannot read ",
                    path, ": fcntl: ", std::strerror(errno));
    const auto size = static_cast<std::uint64_t>(st.st_size);
    // Reads until `want` bytes are held or the file ends.
    const auto read_to = [&](std::uint64_t want) {
      char buf[1 << 16];
      while (bytes.size() < want) {
        const std::size_t n = std::min<std::uint64_t>(sizeof buf, want - bytes.size());
        const ssize_t got = ::read(fd, buf, n);
        if (got < 0 && errno == EINTR) continue;
        CHUNKLOSS_CHECK(got >= 0, "error while reading ", path, ": ", std::strerror(errno));
        if (got == 0) return;
        bytes.append(buf, static_cast<std::size_t>(got));
      }
    };
    if (check) {
      const std::uint64_t first = std::min<std::uint64_t>(size, start_bytes);
      read_to(first);
      CHUNKLOSS_CHECK(bytes.size() == first, path, " changed while it was read (", size,
                      " bytes by fstat, ", bytes.size(), " read)");
      check(bytes, size);
    }
    read_to(size);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return bytes;
}

}  // namespace chunkloss::model::detail
