// Training progress on stderr: one line rewritten in place on a terminal (step, loss, accuracy,
// tokens/s, ETA), or plain lines every `every` steps when stderr is a file or a pipe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace chunkloss::apps {

/// What one progress line shows. `accuracy` is NaN when the run has none to show.
struct ProgressFields {
  std::int64_t step = 0;  ///< optimizer steps done (1-based after the first)
  double loss = 0;
  double accuracy = 0;
  const char* accuracy_name = "acc";
  double tokens = 0;  ///< tokens processed by this step (for tokens/s)
};

class Progress {
 public:
  /// `first_step` is where this run starts (> 0 after --resume); `total_steps` where it ends.
  /// `interactive`: rewrite one line (a terminal); otherwise print every `every` steps.
  Progress(std::int64_t first_step, std::int64_t total_steps, std::int64_t every, bool interactive,
           std::FILE* out = stderr);
  /// Ends the line (finish()), so that an error unwinding the run prints on a line of its own.
  ~Progress() { finish(); }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  /// Shows a step (rate limited to 10 lines per second on a terminal).
  void update(const ProgressFields& f);
  /// Ends the in-place line (a terminal) so later output starts on a fresh line.
  void finish();

  /// True when `f` is a terminal.
  static bool is_terminal(std::FILE* f);
  double elapsed_seconds() const;

 private:
  std::string line(const ProgressFields& f) const;

  std::int64_t first_, total_, every_;
  bool interactive_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_, last_draw_;
  double tokens_ = 0;
  bool drawn_ = false;
};

}  // namespace chunkloss::apps
