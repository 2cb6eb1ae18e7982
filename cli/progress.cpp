#include "cli/progress.h"

#include <unistd.h>

#include <cstdio>

namespace pounce::cli {

namespace {
constexpr double kQuietSeconds = 3.0;  // off a terminal, stages of runs shorter than this are not printed
}

Progress::Progress(bool enabled) : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0) {}

Progress::~Progress() {
  finish();
}

void Progress::stage(const std::string& what) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const double seconds = std::chrono::duration<double>(Clock::now() - start_).count();
  if (tty_) {
    std::fprintf(stderr, "\r\033[K[pounce %6.1f s] %s", seconds, what.c_str());
    line_open_ = true;
  } else if (seconds >= kQuietSeconds) {
    std::fprintf(stderr, "[pounce %6.1f s] %s\n", seconds, what.c_str());
  }
  std::fflush(stderr);
}

void Progress::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (line_open_) std::fprintf(stderr, "\r\033[K");
  line_open_ = false;
  std::fflush(stderr);
}

}  // namespace pounce::cli
