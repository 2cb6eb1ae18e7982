// The progress line of long runs, on stderr. On a terminal it is one line rewritten in place; otherwise
// a line per stage, but only once the run has taken a few seconds (short runs stay quiet), and then a line
// per update at most every few seconds (a percentage that moves often). line() always prints a line.
#pragma once

#include <chrono>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>

namespace pounce::cli {

class Progress {
 public:
  explicit Progress(bool enabled);
  // Where the lines go, whether that is a terminal, and the clock (seconds since the start): for tests.
  Progress(bool enabled, std::FILE* out, bool tty, std::function<double()> seconds);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void stage(const std::string& what);   // thread-safe
  void update(const std::string& what);  // thread-safe; a stage that repeats often, e.g. "inputs 40 %"
  void line(const std::string& what);    // thread-safe; printed whatever the time, as a line of its own
  void finish();                         // clears the line

  static constexpr double kQuietSeconds = 3.0;   // off a terminal, stages before this are not printed
  static constexpr double kUpdateSeconds = 5.0;  // off a terminal, at most one update line per this

 private:
  void print(const std::string& what, double seconds, bool own_line);

  bool enabled_;
  std::FILE* out_;
  bool tty_;
  std::function<double()> seconds_;
  bool line_open_ = false;
  double last_update_s_ = -kUpdateSeconds;
  std::mutex mutex_;
};

}  // namespace pounce::cli
