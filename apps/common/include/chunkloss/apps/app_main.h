// The error handling every app's main() shares: a bad command line prints one line and exits
// with kExitUsage, a runtime failure prints one line and exits with kExitFailure.
#pragma once

#include <boost/program_options/errors.hpp>
#include <cstdio>
#include <exception>
#include <new>

#include "chunkloss/apps/cli.h"

namespace chunkloss::apps {

/// Runs an app: `parse()` returns its settings as a std::optional (empty: --help was printed,
/// exit 0), then `run(settings)` returns the exit code. A boost::program_options error or a
/// UsageError (from either step) prints "PROG: MESSAGE (see --help)" and gives kExitUsage; any
/// other std::exception from run prints "PROG: error: MESSAGE" ("out of memory" for
/// std::bad_alloc) and gives kExitFailure. Messages print on one line.
template <typename Parse, typename Run>
int guarded_main(const char* prog, Parse&& parse, Run&& run) {
  auto usage = [prog](const std::exception& e) {
    std::fprintf(stderr, "%s: %s (see --help)\n", prog, one_line(e.what()).c_str());
    return kExitUsage;
  };
  decltype(parse()) settings;
  try {
    settings = parse();
  } catch (const boost::program_options::error& e) {
    return usage(e);
  } catch (const UsageError& e) {
    return usage(e);
  }
  if (!settings) return 0;
  try {
    return run(*settings);
  } catch (const UsageError& e) {
    return usage(e);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: error: out of memory (std::bad_alloc)\n", prog);
    return kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", prog, one_line(e.what()).c_str());
    return kExitFailure;
  }
}

}  // namespace chunkloss::apps
