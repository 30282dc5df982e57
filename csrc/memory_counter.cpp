// See memory_counter.h.
#include "memory_counter.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zerofuse {
namespace {

// Counted blocks by data pointer: the DataPtr handed out has its data as its context (torch's
// raw_allocate, which oneDNN's bf16/fp16 matmuls use for scratch, asserts that and frees through
// raw_deleter() with the data pointer alone: a Block* context failed that assert, 2026-11-27).
struct Block {
  c10::DataPtr inner;  // the wrapped allocator's: destroying it frees the memory
  int64_t bytes = 0;
  int64_t seq = 0;  // allocation order: a block older than the region's start is not subtracted when freed
};

struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> next_seq{0};
  std::atomic<int64_t> region_seq{0};  // blocks allocated before it are freed uncounted (cpu_memory_counter_begin)
  std::mutex blocks_mutex;
  std::unordered_map<void*, Block> blocks;
  // (seq, bytes) of blocks freed unsubtracted inside a region: the region that made them subtracts
  // them when the one inside it ends (they stayed counted: an outer peak_memory block's figure grew
  // by each one, without bound over a loop of inner blocks; a review's reproduction, 2026-12-07)
  std::vector<std::pair<int64_t, int64_t>> skipped;

  static void release(void* data);

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    if (data == nullptr) return inner;  // (0 bytes: nothing to count or free)
    const int64_t bytes = static_cast<int64_t>(n);
    {
      std::lock_guard<std::mutex> lock(blocks_mutex);
      blocks.emplace(data, Block{std::move(inner), bytes, next_seq.fetch_add(1)});
    }
    const int64_t now = current.fetch_add(bytes) + bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, data, &Counting::release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &Counting::release; }

  void copy_data(void* dst, const void* src, std::size_t n) const override { default_copy_data(dst, src, n); }
};

Counting counter;

void Counting::release(void* data) {
  Block block;
  {
    std::lock_guard<std::mutex> lock(counter.blocks_mutex);
    auto it = counter.blocks.find(data);
    if (it == counter.blocks.end()) return;
    block = std::move(it->second);
    counter.blocks.erase(it);
    // a block from before the open region (an earlier region's, a cycle the collector frees now) is
    // not subtracted: the region's figure errs high, never low (it read 0 for a 16 MiB tensor made
    // inside a region that freed an earlier region's block; a review's reproduction, 2026-12-06)
    if (block.seq < counter.region_seq.load()) {
      counter.skipped.emplace_back(block.seq, block.bytes);
      block.bytes = 0;
    }
  }
  if (block.bytes) counter.current.fetch_sub(block.bytes);
}  // block.inner frees the memory here, outside the lock

std::mutex install_mutex;
constexpr uint8_t kPriority = 127;  // SetCPUAllocator ignores lower priorities than the current one

}  // namespace

void cpu_memory_counter_install(bool on) {
  std::lock_guard<std::mutex> lock(install_mutex);
  c10::Allocator* now = c10::GetCPUAllocator();
  if (on && now != &counter) {
    counter.base = now;
    c10::SetCPUAllocator(&counter, kPriority);
    TORCH_CHECK(c10::GetCPUAllocator() == &counter, "zerofuse: the counting CPU allocator could not be installed");
  } else if (!on && now == &counter) {
    c10::SetCPUAllocator(counter.base, kPriority);
  }
}

bool cpu_memory_counter_installed() { return c10::GetCPUAllocator() == &counter; }

int64_t cpu_memory_counter_current() { return counter.current.load(); }

int64_t cpu_memory_counter_peak() { return counter.peak.load(); }

void cpu_memory_counter_reset_peak() { counter.peak.store(counter.current.load()); }

int64_t cpu_memory_counter_begin() { return counter.region_seq.exchange(counter.next_seq.load()); }

void cpu_memory_counter_end(int64_t previous) {
  std::lock_guard<std::mutex> lock(counter.blocks_mutex);
  counter.region_seq.store(previous);
  int64_t bytes = 0;  // the enclosing region's own blocks freed inside this one: subtracted now
  auto& skipped = counter.skipped;
  skipped.erase(std::remove_if(skipped.begin(), skipped.end(), [&](const std::pair<int64_t, int64_t>& b) {
                  if (b.first < previous) return false;
                  bytes += b.second;
                  return true;
                }), skipped.end());
  counter.current.fetch_sub(bytes);
}

}  // namespace zerofuse
