#include "vector_isa.h"

#include <ATen/Version.h>

#include <algorithm>
#include <string>

namespace zerofuse {

int vector_isa() {
  static const int level = [] {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    const int machine = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    // torch's capability after ATEN_CPU_CAPABILITY: "DEFAULT", "AVX2" or "AVX512" on x86
    const std::string cap = at::get_cpu_capability();
    const int torch_cap = cap == "AVX512" ? 2 : cap == "AVX2" ? 1 : 0;
    return std::min(machine, torch_cap);
#else
    return 0;
#endif
  }();
  return level;
}

}  // namespace zerofuse
