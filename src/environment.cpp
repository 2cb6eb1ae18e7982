#include "src/environment.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "pounce/error.h"

namespace pounce {

Environment Environment::read() {
  Environment environment;
  if (const char* value = std::getenv("POUNCE_PEER_TIMEOUT_S")) {
    char* end = nullptr;
    const double seconds = std::strtod(value, &end);
    POUNCE_CHECK(end != value && *end == '\0' && std::isfinite(seconds) && seconds > 0,
                 "environment POUNCE_PEER_TIMEOUT_S = '", value,
                 "' must be a positive number of seconds (or unset for 120)");
    // Beyond ~115 days a bound is as good as none; the cap keeps the conversion to nanoseconds in range.
    constexpr double kMaxSeconds = 1e7;
    environment.peer_timeout =
        std::chrono::milliseconds(static_cast<int64_t>(std::ceil(std::min(seconds, kMaxSeconds) * 1000)));
  }
  environment.profile_stages = std::getenv("POUNCE_PROFILE_STAGES") != nullptr;
  return environment;
}

}  // namespace pounce
