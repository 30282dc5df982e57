// The watchdog of the NCCL transport ([Note: NCCL watchdog] in nccl_transport.cu) and the debug
// stall that tests it on one GPU. CUDA builds only (included from .cu files).
#pragma once

#include <c10/core/Device.h>
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace zerofuse::comm {

// One CUDA event (timing disabled), destroyed with its last owner.
struct CudaEvent {
  CudaEvent();
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t event = nullptr;
};

// A thread that watches the launched collectives of one NCCL communicator until they complete.
class NcclWatchdog {
 public:
  // async_error: "" or the communicator's asynchronous NCCL error; called from the watchdog's
  // thread, it must not block. expire: called once, from the watchdog's thread, with the message
  // of the first failure seen; the watchdog stops after it.
  NcclWatchdog(std::chrono::milliseconds timeout, c10::DeviceIndex device, std::function<std::string()> async_error,
               std::function<void(const std::string&)> expire);
  ~NcclWatchdog();  // stops the thread and joins it
  // started: recorded on the comm stream once it is past the caller's work; done: after the
  // collective(s). what: the collective(s), as messages name them.
  void watch(std::shared_ptr<CudaEvent> started, std::shared_ptr<CudaEvent> done, std::string what);

 private:
  struct Watched {
    std::shared_ptr<CudaEvent> started, done;
    std::string what;
    std::optional<std::chrono::steady_clock::time_point> since;  // when `started` was first seen complete
  };
  void run();
  std::string poll_locked();  // "" or the failure's message

  std::chrono::milliseconds timeout_, poll_;
  c10::DeviceIndex device_;
  std::function<std::string()> async_error_;
  std::function<void(const std::string&)> expire_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Watched> watched_;
  bool stop_ = false;
  std::thread thread_;  // last: started once every other member is ready
};

// ZEROFUSE_COMM_DEBUG_STALL=N (tests): the N-th launch (0-based) of an NCCL transport is held on its
// comm stream, after its `started` event, by a kernel spinning on a host-mapped flag: a collective
// whose peer never arrives, on one GPU. release() lets the kernel finish; the transport calls it
// where it aborts the communicator (ncclCommAbort ends NCCL's own waiting kernels the same way)
// and when it is destroyed.
class DebugStall {
 public:
  DebugStall();  // reads the variable
  ~DebugStall();
  // true when this launch is the one to hold
  bool next_launch();
  void hold(cudaStream_t stream);
  void release();

 private:
  int64_t at_ = -1, launches_ = 0;
  int* flag_ = nullptr;  // cudaHostAllocMapped
};

}  // namespace zerofuse::comm
