// Ranks as threads for the distributed tests: every rank's call on its own thread, the first
// error rethrown once all have ended (a rank that throws early would leave the others waiting
// in a collective, so the tests make every rank reach the same calls).
#pragma once

#include <cstddef>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

namespace chunkloss::test {

/// fn(i) for i in [0, n), each on its own thread; their results in order. Rethrows the first
/// rank's exception after every thread has joined.
template <typename Fn>
auto on_threads(std::size_t n, Fn&& fn) -> std::vector<decltype(fn(std::size_t{0}))> {
  using T = decltype(fn(std::size_t{0}));
  std::vector<std::optional<T>> out(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        out[i].emplace(fn(i));
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
  std::vector<T> res;
  for (auto& r : out) res.push_back(std::move(*r));
  return res;
}

}  // namespace chunkloss::test
