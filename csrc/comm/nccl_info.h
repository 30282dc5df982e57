// NCCL versions of a CUDA build: the headers compiled against and the library loaded at run time.
#pragma once

namespace zerofuse {
long nccl_compiled_version();  // NCCL_VERSION_CODE of nccl.h
long nccl_runtime_version();   // ncclGetVersion() of the libnccl that was loaded (0 on error)
}  // namespace zerofuse
