// A loss's table of loss types and their TRL names: a type's name, and a name's type.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "chunkloss/core/error.h"

namespace chunkloss::detail {

template <typename T>
using LossTypeNames = std::span<const std::pair<T, std::string_view>>;

/// The name of `t` in `names`; "?" for a value not in the table.
template <typename T>
std::string_view loss_type_name(LossTypeNames<T> names, T t) {
  for (const auto& [k, n] : names)
    if (k == t) return n;
  return "?";
}

/// The type named `name`; throws chunkloss::Error naming `who` and the option (`what`), and
/// listing the names.
template <typename T>
T parse_loss_type(LossTypeNames<T> names, std::string_view name, const char* who,
                  const char* what = "loss_type") {
  std::string all;
  for (const auto& [k, n] : names) {
    if (n == name) return k;
    all += (all.empty() ? "" : ", ") + std::string(n);
  }
  CHUNKLOSS_FAIL(who, ": unknown ", what, " '", name, "'; expected one of ", all);
}

}  // namespace chunkloss::detail
