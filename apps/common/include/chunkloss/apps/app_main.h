// The error handling every app's main() shares: a bad command line prints one line and exits
// with kExitUsage, a runtime failure prints one line and exits with kExitFailure.
#pragma once

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <new>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "chunkloss/apps/cli.h"

namespace chunkloss::apps {

/// The value of path option `name` ("" when not given). An empty value given on the command line
/// or in a --config file is a UsageError: it would read as not given, so that `--resume "$DIR"`
/// with DIR unset would start a new run over the checkpoint.
inline std::string path_option(const boost::program_options::variables_map& vm,
                               const std::string& name) {
  std::string value = vm[name].as<std::string>();
  if (value.empty() && !vm[name].defaulted()) throw UsageError("--" + name + ": the path is empty");
  return value;
}

/// The value of option `name`, which must lie in [lo, hi]; a UsageError shows it as given.
template <typename T>
T in_range(const boost::program_options::variables_map& vm, const char* name, T lo, T hi) {
  const T v = vm[name].as<T>();
  const auto text = [](T x) {
    if constexpr (std::is_floating_point_v<T>)
      return number(x);
    else
      return std::to_string(x);
  };
  if (!(v >= lo && v <= hi))
    throw UsageError("--" + std::string(name) + ": " + text(v) + " is not in [" + text(lo) + ", " +
                     text(hi) + "]");
  return v;
}

/// Stores the command line's options in `vm`. Names must be given in full: Boost's default of
/// taking an unambiguous prefix (`--step` for `--steps`) is off, so that a typo or an option of
/// another app is an error rather than another option, and a script keeps its meaning when a
/// later version adds an option that shares the prefix. A word that is no option's value (a
/// positional argument) is a UsageError naming it.
inline void store_command_line(int argc, const char* const argv[],
                               const boost::program_options::options_description& options,
                               boost::program_options::variables_map& vm) {
  namespace po = boost::program_options;
  static const std::string kWords = " words";  // a name no command line can give
  po::options_description with_words;
  with_words.add(options).add_options()(kWords.c_str(), po::value<std::vector<std::string>>());
  po::positional_options_description words;
  words.add(kWords.c_str(), -1);
  const po::parsed_options parsed =
      po::command_line_parser(argc, argv)
          .options(with_words)
          .positional(words)
          .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
          .run();
  for (const po::option& o : parsed.options)
    if (o.string_key == kWords)
      throw UsageError("'" + o.original_tokens.front() +
                       "' is neither an option nor an option's value (options are --NAME VALUE "
                       "or --NAME=VALUE, and a switch takes no value)");
  po::store(parsed, vm);
}

/// Adds the options of the INI file `path` (--config) to `vm`; the command line's, stored
/// first, win. Throws UsageError naming the file when it cannot be read (missing, a directory, a
/// symlink loop, a name too long, ...), holds an unknown or malformed option, or names another
/// config file (`config = FILE`: one file cannot include another), holds a NUL byte or is larger
/// than 1 MiB. A UTF-8 byte order mark is skipped. Pipes work too (--config <(...)).
inline void store_config_file(const std::string& path,
                              const boost::program_options::options_description& options,
                              boost::program_options::variables_map& vm) {
  if (std::filesystem::is_directory(input_status("config", path)))
    throw UsageError("--config: " + path + " is a directory, not a file");
  std::ifstream file(path, std::ios::binary);
  if (!file.is_open() || !file) throw UsageError("--config: cannot open " + path + " as a file");
  constexpr std::size_t kMaxBytes = std::size_t{1} << 20;  // (/dev/zero would never end)
  std::string text(kMaxBytes + 1, '\0');
  file.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (file.bad()) throw UsageError("--config: cannot read " + path + " to its end");
  text.resize(static_cast<std::size_t>(file.gcount()));
  if (text.size() > kMaxBytes)
    throw UsageError("--config " + path + ": more than 1 MiB, which no options file needs");
  if (text.rfind("\xEF\xBB\xBF", 0) == 0) text.erase(0, 3);  // a UTF-8 byte order mark
  // Boost's messages are C strings, which a NUL byte would cut short.
  if (const std::size_t nul = text.find('\0'); nul != std::string::npos)
    throw UsageError("--config " + path + ": line " +
                     std::to_string(1 + std::count(text.begin(), text.begin() + nul, '\n')) +
                     " holds a NUL byte");
  std::istringstream in(text);
  try {
    const boost::program_options::parsed_options parsed =
        boost::program_options::parse_config_file(in, options);
    for (const boost::program_options::option& o : parsed.options)
      if (o.string_key == "config")
        throw UsageError("--config " + path +
                         ": 'config = " + (o.value.empty() ? "" : o.value.front()) +
                         "': a config file cannot include another");
    boost::program_options::store(parsed, vm);
  } catch (const boost::program_options::error& e) {
    throw UsageError("--config " + path + ": " + e.what());
  }
}

/// check_utf8 on every string value of `vm` (the command line's and the --config file's).
inline void check_utf8_options(const boost::program_options::variables_map& vm) {
  for (const auto& [name, v] : vm) {
    if (const auto* one = boost::any_cast<std::string>(&v.value()))
      check_utf8("--" + name, *one);
    else if (const auto* list = boost::any_cast<std::vector<std::string>>(&v.value()))
      for (const std::string& item : *list) check_utf8("--" + name, item);
  }
}

/// Flushes standard output and returns `code`, or kExitFailure after one line on stderr when a
/// write to it failed (a full disk, /dev/full, ...): an app whose results did not reach its
/// output has not succeeded.
inline int check_stdout(const char* prog, int code) {
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout) && !std::cout.bad()) return code;
  std::fprintf(stderr, "%s: error: cannot write to standard output: %s\n", prog,
               err ? std::strerror(err) : "a write failed");
  return kExitFailure;
}

/// Runs an app: `parse()` returns its settings as a std::optional (empty: --help was printed,
/// exit 0), then `run(settings)` returns the exit code. A boost::program_options error or a
/// UsageError (from either step) prints "PROG: MESSAGE (see --help)" and gives kExitUsage; any
/// other std::exception from run prints "PROG: error: MESSAGE" ("out of memory" for
/// std::bad_alloc) and gives kExitFailure. Messages print on one line. Either way, a failed write
/// to standard output gives kExitFailure (check_stdout).
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
  if (!settings) return check_stdout(prog, 0);
  try {
    return check_stdout(prog, run(*settings));
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
