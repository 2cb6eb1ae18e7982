#pragma once

namespace pounce {

struct BuildInfo {
  const char* version;
  const char* commit;
  bool cuda;  // device code compiled in
  const char* cuda_version;
  const char* nccl_version;  // headers the device code was compiled against
};

const BuildInfo& build_info();

}  // namespace pounce
