// Calls into a user's objective (sequence and token objectives): what it throws comes back as a
// chunkloss::Error naming the objective and the call.
#pragma once

#include <exception>
#include <string>

#include "chunkloss/core/error.h"

namespace chunkloss::detail {

// f(), a call into the objective (a user's code): whatever it throws comes back as a
// chunkloss::Error "WHO: the objective threw WHAT: ..." ending in `written`, with the exception
// nested (std::rethrow_if_nested gives it back). `what()` names the call, built on failure only.
template <typename F, typename What>
auto call_objective(const std::string& who, const What& what, const char* written, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    std::throw_with_nested(Error(error_message(__FILE__, __LINE__, who, ": the objective threw ",
                                               what(), ": ", e.what(), written)));
  } catch (...) {
    std::throw_with_nested(Error(error_message(__FILE__, __LINE__, who, ": the objective threw ",
                                               what(), " (not a std::exception)", written)));
  }
}

}  // namespace chunkloss::detail
