#include "pounce/version.h"

#ifdef POUNCE_HAS_CUDA
#include <nccl.h>
#endif

#define POUNCE_STRINGIFY2(x) #x
#define POUNCE_STRINGIFY(x) POUNCE_STRINGIFY2(x)

namespace pounce {

const BuildInfo& build_info() {
  static const BuildInfo kInfo = {
      POUNCE_VERSION,
      POUNCE_GIT_COMMIT,
#ifdef POUNCE_HAS_CUDA
      true,
      POUNCE_CUDA_VERSION,
      POUNCE_STRINGIFY(NCCL_MAJOR) "." POUNCE_STRINGIFY(NCCL_MINOR) "." POUNCE_STRINGIFY(NCCL_PATCH),
#else
      false,          "none",
      "none",
#endif
  };
  return kInfo;
}

}  // namespace pounce
