// Errors: every failure is a pounce::Error whose message names the argument, the value it had and the fix.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pounce {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error("pounce: " + message) {}
};

namespace detail {
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  throw Error(out.str());
}
}  // namespace detail

}  // namespace pounce

// POUNCE_CHECK(cond, "argument 'x' ...", value, "; fix: ...") throws pounce::Error with the joined parts.
#define POUNCE_CHECK(cond, ...)                       \
  do {                                                \
    if (!(cond)) ::pounce::detail::fail(__VA_ARGS__); \
  } while (0)
