// Built in CUDA builds only (every NCCL-using source is a .cu file; see tools/buildenv.py).
#include "nccl_info.h"

#include <nccl.h>

namespace zerofuse {

long nccl_compiled_version() { return NCCL_VERSION_CODE; }

long nccl_runtime_version() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

}  // namespace zerofuse
