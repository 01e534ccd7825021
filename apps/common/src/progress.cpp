// Progress lines for the training loop (see progress.h).
#include "chunkloss/apps/progress.h"

#include <unistd.h>

#include <cmath>

namespace chunkloss::apps {

namespace {

std::string clock_text(double seconds) {
  const long s = std::lround(std::max(0.0, seconds));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

}  // namespace

Progress::Progress(std::int64_t first_step, std::int64_t total_steps, std::int64_t every,
                   bool interactive, std::FILE* out)
    : first_(first_step),
      total_(total_steps),
      every_(every < 1 ? 1 : every),
      interactive_(interactive),
      out_(out),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

bool Progress::is_terminal(std::FILE* f) { return ::isatty(::fileno(f)) == 1; }

double Progress::elapsed_seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::string Progress::line(const ProgressFields& f) const {
  const double elapsed = elapsed_seconds();
  const double done = static_cast<double>(f.step - first_);
  const double rate = elapsed > 0 ? tokens_ / elapsed : 0;
  const double eta = done > 0 ? elapsed / done * static_cast<double>(total_ - f.step) : 0;
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "step %lld/%lld | loss %.4f",
                        static_cast<long long>(f.step), static_cast<long long>(total_), f.loss);
  if (!std::isnan(f.accuracy))
    n += std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n), " | %s %.3f",
                       f.accuracy_name, f.accuracy);
  std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n),
                " | %.0f tok/s | elapsed %s | ETA %s", rate, clock_text(elapsed).c_str(),
                clock_text(eta).c_str());
  return buf;
}

void Progress::update(const ProgressFields& f) {
  tokens_ += f.tokens;
  const bool last = f.step >= total_;
  if (interactive_) {
    const auto now = std::chrono::steady_clock::now();
    if (!last && drawn_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
    last_draw_ = now;
    std::fprintf(out_, "\r\033[K%s", line(f).c_str());
    drawn_ = true;
  } else if (last || f.step % every_ == 0) {
    std::fprintf(out_, "%s\n", line(f).c_str());
  }
  std::fflush(out_);
}

void Progress::finish() {
  if (interactive_ && drawn_) std::fputc('\n', out_);
  drawn_ = false;
  std::fflush(out_);
}

}  // namespace chunkloss::apps
