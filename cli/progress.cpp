#include "cli/progress.h"

#include <unistd.h>

namespace pounce::cli {

Progress::Progress(bool enabled)
    : Progress(enabled, stderr, isatty(STDERR_FILENO) != 0, [start = std::chrono::steady_clock::now()] {
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      }) {}

Progress::Progress(bool enabled, std::FILE* out, bool tty, std::function<double()> seconds)
    : enabled_(enabled), out_(out), tty_(tty), seconds_(std::move(seconds)) {}

Progress::~Progress() {
  finish();
}

void Progress::print(const std::string& what, double seconds, bool own_line) {
  if (tty_ && !own_line) {
    std::fprintf(out_, "\r\033[K[pounce %6.1f s] %s", seconds, what.c_str());
    line_open_ = true;
  } else {
    if (line_open_) std::fprintf(out_, "\r\033[K");
    line_open_ = false;
    std::fprintf(out_, "[pounce %6.1f s] %s\n", seconds, what.c_str());
  }
  std::fflush(out_);
}

void Progress::stage(const std::string& what) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const double seconds = seconds_();
  if (tty_ || seconds >= kQuietSeconds) print(what, seconds, false);
}

void Progress::update(const std::string& what) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const double seconds = seconds_();
  if (tty_) {
    print(what, seconds, false);
  } else if (seconds >= kQuietSeconds && seconds - last_update_s_ >= kUpdateSeconds) {
    last_update_s_ = seconds;
    print(what, seconds, false);
  }
}

void Progress::line(const std::string& what) {
  if (!enabled_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  print(what, seconds_(), true);
}

void Progress::finish() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (line_open_) std::fprintf(out_, "\r\033[K");
  line_open_ = false;
  std::fflush(out_);
}

}  // namespace pounce::cli
