// NcclWatchdog and DebugStall (nccl_watchdog.h); [Note: NCCL watchdog] in nccl_transport.cu.
#include "communicator.h"
#include "nccl_watchdog.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdlib>

namespace zerofuse::comm {

CudaEvent::CudaEvent() { C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming)); }

CudaEvent::~CudaEvent() {
  if (event) cudaEventDestroy(event);
}

namespace {

// How often the watchdog looks: detection comes at most this late after the timeout, and an
// idle watchdog (nothing in flight) does not poll at all.
constexpr std::chrono::milliseconds kMaxPoll{100};

// cudaSuccess / cudaErrorNotReady, or the error (then cleared from this thread's last error)
cudaError_t query(const CudaEvent& e) {
  const cudaError_t r = cudaEventQuery(e.event);
  if (r != cudaSuccess) (void)cudaGetLastError();
  return r;
}

}  // namespace

NcclWatchdog::NcclWatchdog(std::chrono::milliseconds timeout, c10::DeviceIndex device,
                           std::function<std::string()> async_error, std::function<void(const std::string&)> expire)
    : timeout_(timeout),
      poll_(std::clamp(timeout / 10, std::chrono::milliseconds(1), kMaxPoll)),
      device_(device),
      async_error_(std::move(async_error)),
      expire_(std::move(expire)),
      thread_([this] { run(); }) {}

NcclWatchdog::~NcclWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void NcclWatchdog::watch(std::shared_ptr<CudaEvent> started, std::shared_ptr<CudaEvent> done, std::string what) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    watched_.push_back({std::move(started), std::move(done), std::move(what), std::nullopt});
  }
  cv_.notify_all();
}

void NcclWatchdog::run() {
  c10::cuda::CUDAGuard guard(device_);  // the events (and the communicator) belong to this device
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [this] { return stop_ || !watched_.empty(); });
    if (stop_) return;
    const std::string failure = poll_locked();
    if (!failure.empty()) {
      watched_.clear();
      lock.unlock();  // expire_ takes the transport's lock, which launches hold while calling watch()
      expire_(failure);
      return;  // the communicator is aborted: nothing it runs can be watched any more
    }
    cv_.wait_for(lock, poll_, [this] { return stop_; });
  }
}

std::string NcclWatchdog::poll_locked() {
  const auto now = std::chrono::steady_clock::now();
  for (auto it = watched_.begin(); it != watched_.end();) {
    const cudaError_t done = query(*it->done);
    if (done == cudaSuccess) {
      it = watched_.erase(it);
      continue;
    }
    if (done != cudaErrorNotReady) {
      return it->what + " failed on the device: " + cudaGetErrorString(done) + "; the NCCL communicator was aborted";
    }
    if (!it->since && query(*it->started) == cudaSuccess) it->since = now;
    if (it->since && now - *it->since > timeout_) {
      return it->what + " did not complete within the timeout (" + seconds(timeout_) +
             ") of the NCCL transport; the NCCL communicator was aborted";
    }
    ++it;
  }
  if (watched_.empty()) return "";
  const std::string async = async_error_();
  if (async.empty()) return "";
  return "asynchronous NCCL error while " + watched_.front().what + " was in flight: " + async +
         "; the NCCL communicator was aborted";
}

namespace {

__global__ void spin_until_released(const volatile int* flag) {
  while (*flag == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(1000);  // fewer reads over the bus
#endif
  }
}

}  // namespace

DebugStall::DebugStall() {
  if (const char* v = std::getenv("ZEROFUSE_COMM_DEBUG_STALL")) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    TORCH_CHECK_VALUE(*v != '\0' && *end == '\0' && n >= 0,
                      "zerofuse.comm (NCCL): expected ZEROFUSE_COMM_DEBUG_STALL to be a launch index >= 0, got '", v,
                      "'");
    at_ = n;
  }
}

DebugStall::~DebugStall() {
  if (flag_) {
    release();
    cudaFreeHost(flag_);
  }
}

bool DebugStall::next_launch() { return launches_++ == at_; }

void DebugStall::hold(cudaStream_t stream) {
  if (!flag_) {
    C10_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&flag_), sizeof(int), cudaHostAllocMapped));
  }
  __atomic_store_n(flag_, 0, __ATOMIC_SEQ_CST);
  int* device_flag = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_flag), flag_, 0));
  spin_until_released<<<1, 1, 0, stream>>>(device_flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void DebugStall::release() {
  if (flag_) __atomic_store_n(flag_, 1, __ATOMIC_SEQ_CST);
}

}  // namespace zerofuse::comm
