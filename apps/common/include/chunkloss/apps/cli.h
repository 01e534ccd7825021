// Command-line helpers shared by the apps: a usage error that maps to exit code 2, strict
// parsing of comma-separated option lists, shell quoting to print a reproducing command,
// UTC timestamps, and the --budget-mib option.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace chunkloss::apps {

/// Exit codes of every app: 0 success, 1 runtime failure, 2 bad command line.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

/// A bad option or option value; apps print its message on one line and exit with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& what) : std::runtime_error(what) {}
};

/// `text` with every control character (a byte below 0x20, line breaks included, or 0x7F)
/// written as a visible escape such as "\x1b": error messages print on one line, and a name
/// they quote from a file (a tensor's, a path) cannot drive the terminal. A text of more than
/// about 1.6 KB keeps its first 1 KB and its last 512 bytes (where the source location is), so
/// that a name or value quoted from a hostile file cannot make the line megabytes long.
std::string one_line(std::string_view text);

/// The shortest decimal text that reads back as `v` ("0.99999999999", "1e-06", "10.000000001"),
/// for option values in messages and reproducing commands, where printf's 6 significant digits
/// would turn 0.99999999999 into "1".
std::string number(double v);

/// Splits "a,b,c" on commas. Throws UsageError naming `option` on an empty item.
std::vector<std::string> split_list(std::string_view option, std::string_view text);

/// Parses every item of a comma list as an integer in [lo, hi]. Throws UsageError.
std::vector<std::int64_t> parse_int_list(std::string_view option, std::string_view text,
                                         std::int64_t lo, std::int64_t hi);

/// Parses every item of a comma list as a finite number in [lo, hi]. Throws UsageError.
std::vector<double> parse_number_list(std::string_view option, std::string_view text, double lo,
                                      double hi);

/// Parses a boolean option value: true, 1, yes or on; false, 0, no or off. Throws UsageError
/// naming `option` for anything else, the empty value included (which Boost's bool reads as
/// true, so `--tie-embeddings ''` or `tie-embeddings =` in a config file would tie).
bool parse_bool(std::string_view option, std::string_view text);

/// Quotes one word for a POSIX shell (unchanged when it needs no quoting).
std::string shell_quote(std::string_view word);

/// The words joined by spaces, each shell-quoted.
std::string shell_join(const std::vector<std::string>& words);

/// Now in UTC: "2026-12-02T14:25:14Z" (iso) or "2026-12-02" (date only).
std::string utc_now_iso();
std::string utc_today();

/// Throws UsageError naming `option` (e.g. "--save") and the first bad byte when `value` is not
/// valid UTF-8 (RFC 3629: no overlong forms, surrogates or code points past U+10FFFF). The apps
/// record their options and paths as JSON text (trainer_state.json, --json), which must be
/// UTF-8, so such a value is refused before any work rather than when its record is written.
void check_utf8(std::string_view option, std::string_view value);

/// The status of input `path` of option `option` (e.g. "config"; file_type::not_found when it
/// does not exist, left to the reader to report). Throws UsageError "--OPTION: cannot open PATH:
/// REASON" when the file system refuses the path (a symlink loop, a name too long, a parent that
/// is a file, no permission, ...), rather than letting a std::filesystem error escape later, and
/// "--OPTION: the path is empty" for an empty path (which would name the working directory).
std::filesystem::file_status input_status(std::string_view option, const std::string& path);

/// input_status for a data file the run reads (--train-file, --sft-file, --pref-file), which
/// must exist and not be a directory: UsageError "--OPTION: PATH does not exist" or "... is a
/// directory, not a file" otherwise.
void check_input_file(std::string_view option, const std::string& path);

/// Creates directory `dir` of option `option` (e.g. "save") when missing and checks that files
/// can be created in it, so that a run fails before its work rather than at its end. Throws
/// std::runtime_error naming the option, the directory and the reason.
void prepare_output_dir(std::string_view option, const std::string& dir);

/// What is wrong with --label-smoothing `eps` for `loss` ("" when nothing): what the loss object
/// refuses (for dpo of loss type `dpo_loss`, the value of --dpo-loss-type), or any value but 0
/// for orpo and kto, which have none. The message names --label-smoothing and the loss.
std::string label_smoothing_error(std::string_view loss, std::string_view dpo_loss, double eps);

/// Takes an exclusive advisory lock (flock) on directory `dir` for the rest of the process, so
/// that two runs cannot write one checkpoint directory at once (their files would mix). Throws
/// std::runtime_error naming `option` when another process holds it. Where no lock can be taken
/// (a file system without flock, a directory it cannot read) it returns a warning to print, and
/// the run goes on unlocked; "" when locked.
std::string lock_directory(std::string_view option, const std::string& dir);

/// Whether `a` and `b` name the same file: the same existing file (hard links, symlinks and
/// relative spellings included), or the same path once made absolute and normalised.
bool same_file(const std::string& a, const std::string& b);

/// Whether `inner` is `outer` (same_file) or lies inside directory `outer`, both made absolute
/// and normalised, with the symlinks of their existing parts resolved.
bool path_within(const std::string& inner, const std::string& outer);

/// Throws UsageError naming `option` when output file `path` would be a file of one of the
/// checkpoint directories `dirs` (a name model::is_checkpoint_file_name gives, in the directory
/// itself), which a save would overwrite or a load read. With `save` (chunkloss-train's --save),
/// its DIR/checkpoint-N directories count too; so does any directory holding a checkpoint's
/// weights file (model::kModelFile), whose checkpoint the write would damage.
void check_not_checkpoint_file(std::string_view option, const std::string& path,
                               const std::vector<std::string>& dirs, const std::string& save = "");

/// Checks output file `path` of option `option` before the run's work, and creates its parent
/// directory when missing (prepare_output_dir), so that a bad output fails at once rather than at
/// the end. Throws UsageError naming the option when `path` is a directory or another
/// non-regular file (outputs are replaced by rename), or when it or one of `path + suffix` (the
/// other files the option writes, e.g. ".tmp") is the same file as one of `inputs` (each a
/// description, e.g. "--train-file", and a path; empty paths are skipped); throws
/// std::runtime_error naming the option when the parent directory cannot be made or written.
void prepare_output_file(std::string_view option, const std::string& path,
                         const std::vector<std::pair<std::string, std::string>>& inputs = {},
                         const std::vector<std::string>& suffixes = {".tmp"});

/// Starts the threads a run will have besides the main thread side by side, then ends them, to
/// learn before the run's work whether the system lets this process have them: OpenMP (libgomp)
/// ends the process with its own message when it cannot start a thread of a team.
/// `openmp_threads` get the stack size OpenMP's threads get (OMP_STACKSIZE, else
/// GOMP_STACKSIZE, else the system's default), `other_threads` (std::thread) the system's
/// default. Throws std::runtime_error naming `what` (e.g. "--threads 64"), how many started, the
/// stack sizes and the system's reason when one cannot start. Passing is no guarantee: as teams
/// change size, libgomp ends and starts threads, and a run near the limit may still fail there.
void check_threads_start(const std::string& what, int openmp_threads, int other_threads = 0);

/// The bytes of a --budget-mib value in [0, 2^20] MiB; 0 gives the library's default for
/// `device` ("cpu" or "cuda", default_memory_budget), so that both spellings of a budget are one.
/// Throws UsageError when it is out of range, or positive but less than a byte.
std::size_t budget_bytes(double mib, const std::string& device);

}  // namespace chunkloss::apps
