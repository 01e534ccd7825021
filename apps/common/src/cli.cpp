// Command-line helpers shared by the apps (see cli.h).
#include "chunkloss/apps/cli.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <sstream>

#include "chunkloss/core/error.h"
#include "chunkloss/losses/cross_entropy.h"
#include "chunkloss/losses/plan.h"
#include "chunkloss/losses/preference.h"
#include "chunkloss/model/checkpoint.h"

namespace chunkloss::apps {

namespace {

// `text` with its control characters escaped (one_line without the cut).
std::string escape_controls(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char ch : text) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7F) {
      char escape[8];
      std::snprintf(escape, sizeof escape, "\\x%02x", byte);
      out += escape;
    } else {
      out += ch;
    }
  }
  return out;
}

}  // namespace

std::string one_line(std::string_view text) {
  constexpr std::size_t kHead = 1024, kTail = 512;
  if (text.size() <= kHead + kTail + 64) return escape_controls(text);
  // A cut moves back over at most 3 UTF-8 continuation bytes, to the start of their character
  // (invalid UTF-8, a long run of them, is cut where it falls).
  const auto start_of = [&](std::size_t i) {
    for (std::size_t k = 0; k < 3 && i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80;
         ++k)
      --i;
    return i;
  };
  const std::size_t head = start_of(kHead), tail = start_of(text.size() - kTail);
  return escape_controls(text.substr(0, head)) + " ... (" + std::to_string(tail - head) +
         " bytes left out) ... " + escape_controls(text.substr(tail));
}

std::vector<std::string> split_list(std::string_view option, std::string_view text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (item.empty())
      throw UsageError("--" + std::string(option) + ": empty item in '" + std::string(text) + "'");
    out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

std::string number(double v) {
  char buf[32];  // the longest shortest form of a double is 24 characters
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return ec == std::errc() ? std::string(buf, end) : std::string("?");
}

std::vector<std::int64_t> parse_int_list(std::string_view option, std::string_view text,
                                         std::int64_t lo, std::int64_t hi) {
  std::vector<std::int64_t> out;
  for (const std::string& item : split_list(option, text)) {
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (ec != std::errc() || end != item.data() + item.size() || v < lo || v > hi) {
      std::ostringstream os;
      os << "--" << option << ": '" << item << "' is not an integer in [" << lo << ", " << hi
         << "]";
      throw UsageError(os.str());
    }
    out.push_back(v);
  }
  return out;
}

std::vector<double> parse_number_list(std::string_view option, std::string_view text, double lo,
                                      double hi) {
  std::vector<double> out;
  for (const std::string& item : split_list(option, text)) {
    errno = 0;
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (errno != 0 || end != item.c_str() + item.size() || !std::isfinite(v) || v < lo || v > hi) {
      std::ostringstream os;
      os << "--" << option << ": '" << item << "' is not a number in [" << number(lo) << ", "
         << number(hi) << "]";
      throw UsageError(os.str());
    }
    out.push_back(v);
  }
  return out;
}

bool parse_bool(std::string_view option, std::string_view text) {
  for (const std::string_view yes : {"true", "1", "yes", "on"})
    if (text == yes) return true;
  for (const std::string_view no : {"false", "0", "no", "off"})
    if (text == no) return false;
  throw UsageError("--" + std::string(option) + ": '" + one_line(text) +
                   "' is not a boolean (true, false, 1, 0, yes, no, on or off)");
}

std::string shell_quote(std::string_view word) {
  constexpr std::string_view kSafe =
      "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-+./=:,@%";
  if (!word.empty() && word.find_first_not_of(kSafe) == std::string_view::npos)
    return std::string(word);
  std::string q = "'";
  for (const char ch : word) {
    if (ch == '\'')
      q += "'\\''";
    else
      q += ch;
  }
  return q + "'";
}

std::string shell_join(const std::vector<std::string>& words) {
  std::string out;
  for (const std::string& w : words) {
    if (!out.empty()) out += ' ';
    out += shell_quote(w);
  }
  return out;
}

namespace {

std::string utc_format(const char* fmt) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, fmt, &tm);
  return buf;
}

}  // namespace

std::string utc_now_iso() { return utc_format("%Y-%m-%dT%H:%M:%SZ"); }
std::string utc_today() { return utc_format("%Y-%m-%d"); }

void check_utf8(std::string_view option, std::string_view value) {
  for (std::size_t i = 0; i < value.size();) {
    const auto lead = static_cast<unsigned char>(value[i]);
    std::size_t n = 0;              // continuation bytes
    unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
    if (lead >= 0xC2 && lead <= 0xDF) {
      n = 1;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      n = 2;
      if (lead == 0xE0) lo = 0xA0;  // (overlong)
      if (lead == 0xED) hi = 0x9F;  // (surrogates)
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      n = 3;
      if (lead == 0xF0) lo = 0x90;  // (overlong)
      if (lead == 0xF4) hi = 0x8F;  // (past U+10FFFF)
    }
    bool ok = lead < 0x80 || n > 0;
    for (std::size_t k = 1; ok && k <= n; ++k) {
      const auto b = i + k < value.size() ? static_cast<unsigned char>(value[i + k]) : 0u;
      ok = b >= (k == 1 ? lo : 0x80u) && b <= (k == 1 ? hi : 0xBFu);
    }
    if (!ok) {
      char byte[8];
      std::snprintf(byte, sizeof byte, "0x%02X", lead);
      throw UsageError(std::string(option) + ": not valid UTF-8 (byte " + byte + " at offset " +
                       std::to_string(i) +
                       "): the run's options and paths are recorded as JSON text, which is UTF-8");
    }
    i += n + 1;
  }
}

std::filesystem::file_status input_status(std::string_view option, const std::string& path) {
  if (path.empty()) throw UsageError("--" + std::string(option) + ": the path is empty");
  std::error_code ec;
  const std::filesystem::file_status st = std::filesystem::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory)
    throw UsageError("--" + std::string(option) + ": cannot open " + path + ": " + ec.message());
  return st;
}

void check_input_file(std::string_view option, const std::string& path) {
  const std::filesystem::file_type t = input_status(option, path).type();
  if (t == std::filesystem::file_type::not_found)
    throw UsageError("--" + std::string(option) + ": " + path + " does not exist");
  if (t == std::filesystem::file_type::directory)
    throw UsageError("--" + std::string(option) + ": " + path + " is a directory, not a file");
}

namespace {

// The stack size libgomp gives its threads when the environment sets one, read as libgomp 12
// reads it (checked against it): OMP_STACKSIZE, else GOMP_STACKSIZE, each a number as strtoul
// takes it (spaces and a sign before it) in KiB, or followed by B, K, M or G in either case,
// spaces around. None when neither is set and valid; `source` is then left as it is, else the
// variable's name.
std::optional<std::size_t> openmp_stack_size(std::string& source) {
  for (const char* name : {"OMP_STACKSIZE", "GOMP_STACKSIZE"}) {
    const char* text = std::getenv(name);
    if (!text) continue;
    const auto space = [](const char* c) { return std::isspace(static_cast<unsigned char>(*c)); };
    while (space(text)) ++text;
    char* end = nullptr;
    errno = 0;
    const unsigned long long n = std::strtoull(text, &end, 10);
    if (*text == '\0' || errno != 0 || end == text) continue;
    while (space(end)) ++end;
    int shift = 10;
    if (*end != '\0') {
      const std::size_t unit = std::string_view("bkmg").find(
          static_cast<char>(std::tolower(static_cast<unsigned char>(*end))));
      if (unit == std::string_view::npos) continue;
      shift = 10 * static_cast<int>(unit);
      for (++end; space(end);) ++end;
      if (*end != '\0') continue;
    }
    if (n > (std::numeric_limits<std::size_t>::max() >> shift)) continue;
    source = name;
    return static_cast<std::size_t>(n) << shift;
  }
  return std::nullopt;
}

// "8 MiB", "16 KiB" or "5000 bytes": a stack size as exactly as it is.
std::string size_text(std::size_t bytes) {
  if (bytes != 0 && bytes % (std::size_t{1} << 20) == 0)
    return std::to_string(bytes >> 20) + " MiB";
  if (bytes != 0 && bytes % 1024 == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " bytes";
}

// The threads of check_threads_start wait here until all have been started.
struct StartGate {
  std::mutex mutex;
  std::condition_variable opened;
  bool open = false;
};

void* wait_at_gate(void* gate) {
  auto& g = *static_cast<StartGate*>(gate);
  std::unique_lock lock(g.mutex);
  g.opened.wait(lock, [&g] { return g.open; });
  return nullptr;
}

}  // namespace

void check_threads_start(const std::string& what, int openmp_threads, int other_threads) {
  // Two kinds of threads: [0] the others (std::thread: the system's default stack), [1] OpenMP's.
  struct Kind {
    int count;
    pthread_attr_t attr;
    std::size_t stack = 0;
    std::string source = "the system's default";
  } kinds[2] = {{std::max(other_threads, 0), {}}, {std::max(openmp_threads, 0), {}}};
  for (Kind& k : kinds)
    if (int err = ::pthread_attr_init(&k.attr); err != 0)
      throw std::runtime_error(what + ": cannot make thread attributes: " + std::strerror(err));
  std::string name;
  if (const std::optional<std::size_t> size = openmp_stack_size(name))
    if (::pthread_attr_setstacksize(&kinds[1].attr, *size) == 0)  // else libgomp keeps it too
      kinds[1].source = "from " + name;
  for (Kind& k : kinds) ::pthread_attr_getstacksize(&k.attr, &k.stack);

  StartGate gate;
  std::vector<pthread_t> started;
  started.reserve(static_cast<std::size_t>(kinds[0].count + kinds[1].count));
  int err = 0;
  for (Kind& k : kinds)
    for (int i = 0; i < k.count && err == 0; ++i) {
      pthread_t t;
      err = ::pthread_create(&t, &k.attr, wait_at_gate, &gate);
      if (err == 0) started.push_back(t);
    }
  {
    const std::lock_guard lock(gate.mutex);
    gate.open = true;
  }
  gate.opened.notify_all();
  for (const pthread_t t : started) ::pthread_join(t, nullptr);
  for (Kind& k : kinds) ::pthread_attr_destroy(&k.attr);
  if (err == 0) return;
  const Kind& one = kinds[0].count > 0 ? kinds[0] : kinds[1];  // (one kind, or two of one size)
  std::string stacks = "stacks of " + size_text(one.stack) + " each, " + one.source;
  if (kinds[0].count > 0 && kinds[1].count > 0 && kinds[0].stack != kinds[1].stack)
    stacks = "stacks of " + size_text(kinds[0].stack) + " for " + std::to_string(kinds[0].count) +
             " of them, " + kinds[0].source + ", and " + size_text(kinds[1].stack) +
             " for the other " + std::to_string(kinds[1].count) + ", OpenMP's, " + kinds[1].source;
  throw std::runtime_error(
      what + ": the run needs " + std::to_string(kinds[0].count + kinds[1].count) +
      " threads besides the main thread, and the system started only " +
      std::to_string(started.size()) + " (" + stacks + "): " + std::strerror(err));
}

void prepare_output_dir(std::string_view option, const std::string& dir) {
  const std::string d = dir.empty() ? "." : dir;
  std::error_code ec;
  std::filesystem::create_directories(d, ec);
  if (ec)
    throw std::runtime_error("--" + std::string(option) + ": cannot create directory " + d + ": " +
                             ec.message());
  // A file made and removed: access() would let root pass on a read-only file system.
  std::string probe = (std::filesystem::path(d) / ".chunkloss-probe-XXXXXX").string();
  const int fd = ::mkostemp(probe.data(), O_CLOEXEC);  // a fresh name: no stale probe collides
  if (fd < 0)
    throw std::runtime_error("--" + std::string(option) + ": cannot write into " + d + ": " +
                             std::strerror(errno));
  ::close(fd);
  if (::unlink(probe.c_str()) != 0)
    throw std::runtime_error("--" + std::string(option) + ": cannot remove " + probe + ": " +
                             std::strerror(errno));
}

std::string lock_directory(std::string_view option, const std::string& dir) {
  const std::string opt = "--" + std::string(option) + " " + dir;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return opt + ": not locked (cannot open it: " + std::strerror(errno) +
           "), so a second run writing into it would not be refused";
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK)
      throw std::runtime_error(opt +
                               ": another run is writing into it (it holds the directory's lock)");
    return opt + ": not locked (" + std::strerror(err) +
           ": a file system without flock?), so a second run writing into it would not be refused";
  }
  return "";  // the descriptor stays open, and the lock held, until the process exits
}

std::string label_smoothing_error(std::string_view loss, std::string_view dpo_loss, double eps) {
  std::ostringstream os;
  os << "--label-smoothing " << number(eps) << ": --loss " << loss;
  if (loss == "dpo") os << " --dpo-loss-type " << dpo_loss;
  // The loss object's own check decides (its message gives the range); ORPO and KTO have none.
  const auto ls = static_cast<float>(eps);
  try {
    if (loss == "ce") {
      CrossEntropyOptions o;
      o.label_smoothing = ls;
      (void)LinearCrossEntropy(o);
    } else if (loss == "dpo") {
      DpoOptions o;
      o.loss_type = parse_dpo_loss(dpo_loss);
      o.label_smoothing = ls;
      (void)Dpo(o);
    } else if (loss == "simpo") {
      SimpoOptions o;
      o.label_smoothing = ls;
      (void)Simpo(o);
    } else if (loss == "cpo") {
      CpoOptions o;
      o.label_smoothing = ls;
      (void)Cpo(o);
    } else if (eps != 0) {
      return os.str() + " has no label smoothing";
    }
  } catch (const Error& e) {
    return os.str() + ": " + e.what();
  }
  return "";
}

namespace {

// `p` made absolute and normalised, its existing part's symlinks resolved.
std::filesystem::path normal_path(const std::string& p) {
  std::error_code e;
  const std::filesystem::path c = std::filesystem::weakly_canonical(p, e);
  return e ? std::filesystem::absolute(p, e).lexically_normal() : c;
}

}  // namespace

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec)) return true;
  return normal_path(a) == normal_path(b);
}

bool path_within(const std::string& inner, const std::string& outer) {
  if (same_file(inner, outer)) return true;
  const std::filesystem::path in = normal_path(inner), out = normal_path(outer);
  auto i = in.begin();
  for (const std::filesystem::path& part : out) {
    if (part.empty()) continue;  // a trailing separator
    if (i == in.end() || *i != part) return false;
    ++i;
  }
  return true;
}

void check_not_checkpoint_file(std::string_view option, const std::string& path,
                               const std::vector<std::string>& dirs, const std::string& save) {
  const std::filesystem::path p(path);
  if (!model::is_checkpoint_file_name(p.filename().string())) return;
  const std::filesystem::path parent = p.parent_path().empty() ? "." : p.parent_path();
  std::vector<std::string> clashes;
  for (const std::string& dir : dirs)
    if (!dir.empty() && same_file(parent.string(), dir)) clashes.push_back(dir);
  if (!save.empty() && parent.filename().string().rfind("checkpoint-", 0) == 0 &&
      same_file(parent.parent_path().empty() ? "." : parent.parent_path().string(), save))
    clashes.push_back(parent.string());
  if (!clashes.empty())
    throw UsageError("--" + std::string(option) + " " + path + ": a file of the checkpoint in " +
                     clashes.front() + ", which saving or loading it would clash with");
  // Any other checkpoint there (its weights file marks it): an output would damage it, and an
  // input (--train-file, --config) named there is a mistake.
  std::error_code ec;
  if (std::filesystem::exists(parent / model::kModelFile, ec))
    throw UsageError("--" + std::string(option) + " " + path + ": a file of the checkpoint in " +
                     parent.string() + " (it holds " + model::kModelFile +
                     "), which an app neither writes nor takes as its data or options");
}

void prepare_output_file(std::string_view option, const std::string& path,
                         const std::vector<std::pair<std::string, std::string>>& inputs,
                         const std::vector<std::string>& suffixes) {
  namespace fs = std::filesystem;
  const std::string opt = "--" + std::string(option);
  if (path.empty()) throw UsageError(opt + ": an empty file name");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  // (A missing parent, or a file in its place: prepare_output_dir names it below.)
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
    throw std::runtime_error(opt + ": cannot use " + path + ": " + ec.message());
  if (fs::is_directory(st))
    throw UsageError(opt + ": " + path + " is a directory; give a file name");
  if (fs::exists(st) && !fs::is_regular_file(st))
    throw UsageError(opt + ": " + path +
                     " is not a regular file (an output is written beside it and renamed over it)");
  std::vector<std::string> writes = {path};
  for (const std::string& suffix : suffixes) {
    // Written in place (not renamed over), so a link or a directory there is refused now rather
    // than after the run's work.
    const std::string w = path + suffix;
    const fs::file_status ws = fs::symlink_status(w, ec);
    if (!ec && fs::exists(ws) && !fs::is_regular_file(ws))
      throw UsageError(opt + " " + path + ": its file " + w +
                       " is not a regular file (a symlink, a directory, ...); remove it");
    writes.push_back(w);
  }
  for (const std::string& w : writes)
    for (const auto& [what, in] : inputs)
      if (!in.empty() && same_file(w, in))
        throw UsageError(opt + " " + path + ": " + (w == path ? "" : "its file " + w + " ") +
                         "would overwrite " + what + " " + in + ", an input of the run");
  prepare_output_dir(option, fs::path(path).parent_path().string());
}

std::size_t budget_bytes(double mib, const std::string& device) {
  if (!(mib >= 0 && mib <= 1048576)) {
    std::ostringstream os;
    os << "--budget-mib: " << number(mib) << " is not in [0, 1048576]";
    throw UsageError(os.str());
  }
  const auto bytes = static_cast<std::size_t>(mib * 1048576.0);
  if (mib > 0 && bytes == 0) {
    std::ostringstream os;
    os << "--budget-mib: " << number(mib)
       << " MiB is less than a byte (0 gives the library's default)";
    throw UsageError(os.str());
  }
  return bytes ? bytes : default_memory_budget(device == "cuda" ? Device::kCuda : Device::kCpu);
}

}  // namespace chunkloss::apps
