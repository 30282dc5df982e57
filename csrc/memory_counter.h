// A counting wrapper around torch's CPU allocator, for zerofuse.zero.peak_memory on CPU: exact live
// bytes and their peak, whichever thread allocates or frees (torch.profiler's memory events are
// recorded per thread, so a buffer freed on a gloo worker thread stayed "live" there).
#pragma once

#include <cstdint>

namespace zerofuse {

// on: wrap the current CPU allocator (blocks allocated while installed are counted until freed,
// even after uninstall); off: restore the wrapped one. Idempotent.
void cpu_memory_counter_install(bool on);
bool cpu_memory_counter_installed();
int64_t cpu_memory_counter_current();  // bytes allocated through the counter and not yet freed
int64_t cpu_memory_counter_peak();     // the most of them at once since the last reset
void cpu_memory_counter_reset_peak();  // peak := current
// a region starts: blocks allocated before it are not subtracted when freed (current only errs
// high); returns the enclosing region's start, which cpu_memory_counter_end restores at its end,
// subtracting then the enclosing region's blocks freed inside this one (the peak is left alone:
// peak_memory closes the enclosing regions' figures first, then resets it)
int64_t cpu_memory_counter_begin();
void cpu_memory_counter_end(int64_t previous);

}  // namespace zerofuse
