// chunkloss::Error and the throwing check macros used at every API boundary.
// Messages are built with operator<< from the macro arguments, so call sites read
// CHUNKLOSS_CHECK(a == b, "hidden ", shape_str(h), " does not match weight ", shape_str(w)).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace chunkloss {

/// The one exception type the library throws. Thrown before any output is written when the
/// problem is in the caller's arguments, so a failed call corrupts nothing.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

/// The message of an Error thrown at file:line: the streamed arguments and the place.
template <typename... Args>
std::string error_message(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  os << " [" << file << ":" << line << "]";
  return os.str();
}

template <typename... Args>
[[noreturn]] void throw_error(const char* file, int line, const Args&... args) {
  throw Error(error_message(file, line, args...));
}

}  // namespace detail
}  // namespace chunkloss

/// Throws chunkloss::Error with the streamed arguments when `cond` is false.
#define CHUNKLOSS_CHECK(cond, ...)                                       \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ::chunkloss::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__); \
    }                                                                    \
  } while (0)

/// Throws chunkloss::Error unconditionally.
#define CHUNKLOSS_FAIL(...) ::chunkloss::detail::throw_error(__FILE__, __LINE__, __VA_ARGS__)
