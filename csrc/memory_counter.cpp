// See memory_counter.h.
#include "memory_counter.h"

#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>

namespace zerofuse {
namespace {

struct Counting;

// what a counted block's deleter needs: the wrapped allocator's DataPtr (freeing it frees the
// block) and the size to subtract
struct Block {
  c10::DataPtr inner;
  int64_t bytes;
  Counting* counter;
};

struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};

  static void release(void* ctx) {
    auto* block = static_cast<Block*>(ctx);
    block->counter->current.fetch_sub(block->bytes);
    delete block;
  }

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    auto* block = new Block{std::move(inner), static_cast<int64_t>(n), this};
    const int64_t now = current.fetch_add(block->bytes) + block->bytes;
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, block, &Counting::release, device};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dst, const void* src, std::size_t n) const override { default_copy_data(dst, src, n); }
};

Counting counter;
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

}  // namespace zerofuse
