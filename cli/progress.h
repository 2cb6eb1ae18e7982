// The progress line of long runs, on stderr. On a terminal it is one line rewritten in place; otherwise
// a line per stage, but only once the run has taken a few seconds (short runs stay quiet).
#pragma once

#include <chrono>
#include <mutex>
#include <string>

namespace pounce::cli {

class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void stage(const std::string& what);  // thread-safe
  void finish();                        // clears the line

 private:
  using Clock = std::chrono::steady_clock;
  bool enabled_;
  bool tty_;
  bool line_open_ = false;
  Clock::time_point start_ = Clock::now();
  std::mutex mutex_;
};

}  // namespace pounce::cli
