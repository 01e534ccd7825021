// error_message(f): runs f and returns the what() of the chunkloss::Error it throws ("" if it
// returns normally), so a test can CHECK that the message names the file, line or tensor.
#pragma once

#include <chunkloss/core/error.h>

#include <string>
#include <string_view>

namespace chunkloss::test {

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

inline bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace chunkloss::test
