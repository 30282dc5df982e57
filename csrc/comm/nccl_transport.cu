// The NCCL transport of the Communicator (CUDA builds): zerofuse's own ncclComm_t, dedicated
// high-priority streams, CUDA events for ordering, buffer lifetimes held by in-flight Works.
//
// [Note: stream ordering] A collective is launched on a comm stream (one for reduce-scatter /
// all-reduce, one for all-gather, so the two directions overlap each other and compute). The comm
// stream first waits on an event recorded on the caller's current stream, so the copy-in queued
// there has finished; the collective then records a done event, and Work::wait() makes the
// caller's current stream wait on it (no host block) before the copy-out is queued there.
// Buffers are allocated on the caller's stream: the caching allocator reuses a freed block only
// for that stream, which waits on the done event once wait() was called (wait() on another stream
// makes both streams wait); a Work dropped
// without wait() stays in the in-flight list (keeping its buffers) until its done event fires
// ([Note: Work lifetimes] in communicator.h).
//
// The communicator is created non-blocking (ncclConfig_t.blocking = 0) so that an init, or the
// enqueueing of a collective, that does not finish within the timeout is aborted (ncclCommAbort)
// and reported instead of hanging the process. Completion itself is not watched: a peer that never
// joins shows as a hang at the caller's next host synchronisation.
//
// Every CUDA and NCCL call runs under a guard for the communicator's device, and the transport
// takes tensors of that device only. Nothing throws between ncclGroupStart and ncclGroupEnd (an
// open group would hold back every later NCCL call of the thread, torch's too); a group that
// fails is dropped from the in-flight list, which would otherwise wait forever on its done event.
#include "communicator.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

namespace zerofuse::comm {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kHalf:
      return ncclFloat16;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kDouble:
      return ncclFloat64;
    case at::kInt:
      return ncclInt32;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    case at::kChar:
      return ncclInt8;
    default:
      TORCH_CHECK(false, "zerofuse.comm (NCCL): unsupported dtype ", t);
  }
}

ncclRedOp_t nccl_op(Reduce op) {
  switch (op) {
    case Reduce::kAvg:
      return ncclAvg;
    case Reduce::kMax:
      return ncclMax;
    case Reduce::kMin:
      return ncclMin;
    default:
      return ncclSum;
  }
}

// One done event, shared by the Works of collectives launched in one NCCL group.
struct DoneEvent {
  cudaEvent_t event = nullptr;
  ~DoneEvent() {
    if (event) cudaEventDestroy(event);
  }
};

class NcclWork : public Work {
 public:
  // launch_stream: the caller's current stream at launch, on which the buffers were allocated
  NcclWork(std::string what, std::chrono::milliseconds timeout, c10::DeviceIndex device,
           c10::cuda::CUDAStream launch_stream)
      : Work(std::move(what), timeout), device_(device), launch_stream_(launch_stream) {}
  void set_done(std::shared_ptr<DoneEvent> done) { done_ = std::move(done); }
  bool launched() const { return done_ != nullptr; }
  bool done() { return launched() && transport_done(); }
  // For the destructor: true once the done event fired, can no longer be queried, or there is
  // none (a group that never launched). Never throws.
  bool finished_nothrow() {
    if (!launched()) return true;
    const cudaError_t r = cudaEventQuery(done_->event);
    if (r != cudaSuccess) (void)cudaGetLastError();
    return r != cudaErrorNotReady;
  }

 protected:
  void wait_transport() override {
    TORCH_CHECK(launched(), "wait() on a collective of a group that is still open: end the group first");
    const auto stream = c10::cuda::getCurrentCUDAStream(device_);
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), done_->event, 0));
    // wait() drops the buffers, and the caching allocator hands their blocks out again on the
    // stream they were allocated on: when that is not the waiting stream, it too is ordered after
    // the collective, so no later allocation there can overwrite memory NCCL still uses.
    if (launch_stream_ != stream) C10_CUDA_CHECK(cudaStreamWaitEvent(launch_stream_.stream(), done_->event, 0));
  }
  bool transport_done() override {
    if (!launched()) return false;
    const cudaError_t r = cudaEventQuery(done_->event);
    if (r == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    C10_CUDA_CHECK(r);
    return true;
  }

 private:
  std::shared_ptr<DoneEvent> done_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream launch_stream_;
};

using Collective = std::function<ncclResult_t(cudaStream_t)>;

struct Pending {
  Collective run;
  std::shared_ptr<NcclWork> work;
  std::string what;
};

class NcclTransport : public Transport {
 public:
  NcclTransport(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const c10::intrusive_ptr<c10d::Store>& store,
                const std::string& key, std::chrono::milliseconds timeout, c10::DeviceIndex device)
      : timeout_(timeout),
        device_(device >= 0 ? device : c10::cuda::current_device()),
        rs_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        ag_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)) {
    c10::cuda::CUDAGuard guard(device_);  // NCCL binds the communicator to the current device
    const int rank = pg->getRank(), ws = pg->getSize();
    ncclUniqueId id;
    if (rank == 0) {
      check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      const auto* bytes = reinterpret_cast<const uint8_t*>(&id);
      store->set(key, std::vector<uint8_t>(bytes, bytes + sizeof(id)));
    } else {
      store->wait({key}, timeout_);
      const std::vector<uint8_t> bytes = store->get(key);
      TORCH_CHECK(bytes.size() == sizeof(id), "zerofuse.comm (NCCL): the id under '", key, "' has ", bytes.size(),
                  " bytes, expected ", sizeof(id));
      std::memcpy(&id, bytes.data(), sizeof(id));
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    check(ncclCommInitRankConfig(&comm_, ws, id, rank, &config), "ncclCommInitRankConfig");
    settle("ncclCommInitRankConfig");
  }

  // Work::wait() does not block the host, so collectives may still run here: they are waited for
  // (up to the timeout) rather than cut short by an abort, whose done events would fire all the
  // same and hand the caller's stream partial results. Then the communicator is finalized and
  // destroyed; abort only when that times out or fails.
  ~NcclTransport() override {
    if (comm_) {
      c10::cuda::CUDAGuard guard(device_);
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      auto before_deadline = [&] {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
        return true;
      };
      bool clean = true;
      for (auto& w : inflight_) {
        while (clean && !w->finished_nothrow()) clean = before_deadline();
      }
      ncclResult_t state = clean ? ncclCommFinalize(comm_) : ncclInternalError;
      while (clean && state == ncclInProgress) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        if (state == ncclInProgress) clean = before_deadline();
      }
      if (clean && state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    }
    inflight_.clear();
  }

  std::string name() const override { return "nccl"; }
  bool native_avg() const override { return true; }

  std::shared_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, Reduce op,
                                       const std::string& what) override {
    const ncclDataType_t type = nccl_type(out.scalar_type());  // may throw: not inside the group
    return launch(rs_stream_, what, {in, out}, [this, in, out, type, rop = nccl_op(op)](cudaStream_t s) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), out.numel(), type, rop, comm_, s);
    });
  }

  std::shared_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) override {
    const ncclDataType_t type = nccl_type(in.scalar_type());
    return launch(ag_stream_, what, {in, out}, [this, in, out, type](cudaStream_t s) {
      return ncclAllGather(in.data_ptr(), out.data_ptr(), in.numel(), type, comm_, s);
    });
  }

  std::shared_ptr<Work> all_reduce(const at::Tensor& buf, Reduce op, const std::string& what) override {
    const ncclDataType_t type = nccl_type(buf.scalar_type());
    return launch(rs_stream_, what, {buf}, [this, buf, type, rop = nccl_op(op)](cudaStream_t s) {
      return ncclAllReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), type, rop, comm_, s);
    });
  }

 private:
  void check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    const std::string msg = ncclGetErrorString(r);
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    TORCH_CHECK(false, "zerofuse.comm (NCCL): ", what, " failed: ", msg);
  }

  // Waits (up to the timeout) until the non-blocking communicator has no operation in progress.
  void settle(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (true) {
      TORCH_CHECK(comm_, "zerofuse.comm (NCCL): the communicator was aborted after an earlier error");
      check(ncclCommGetAsyncError(comm_, &state), what);
      if (state != ncclInProgress) break;
      if (std::chrono::steady_clock::now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        TORCH_CHECK(false, "zerofuse.comm (NCCL): ", what, " did not complete within ", timeout_.count(),
                    " ms; the communicator was aborted");
      }
      std::this_thread::yield();
    }
    check(state, what);
  }

  std::shared_ptr<Work> launch(const c10::cuda::CUDAStream& comm_stream, const std::string& what,
                               std::vector<at::Tensor> buffers, Collective collective) {
    TORCH_CHECK(comm_, "zerofuse.comm (NCCL): the communicator was aborted after an earlier error");
    for (const auto& b : buffers) {
      TORCH_CHECK_VALUE(b.is_cuda() && b.device().index() == device_, "zerofuse.comm (NCCL): ", what,
                        ": expected tensors on cuda:", static_cast<int>(device_),
                        " (the device the communicator was created on), got a tensor on ", b.device());
    }
    auto work = std::make_shared<NcclWork>(what, timeout_, device_, c10::cuda::getCurrentCUDAStream(device_));
    work->keep_alive(std::move(buffers));
    // kept (with its buffers) until its done event fires, waited for or not ([Note: Work lifetimes])
    inflight_.push_back(work);
    if (grouping_) {
      pending_.push_back({std::move(collective), work, what});
    } else {
      run_group(comm_stream, {{std::move(collective), work, what}});
    }
    return work;
  }

  void run_group(const c10::cuda::CUDAStream& comm_stream, const std::vector<Pending>& group) {
    c10::cuda::CUDAGuard guard(device_);
    while (!inflight_.empty() && inflight_.front()->done()) inflight_.pop_front();
    try {
      // [Note: stream ordering]
      cudaEvent_t ready;
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      C10_CUDA_CHECK(cudaEventRecord(ready, c10::cuda::getCurrentCUDAStream(device_).stream()));
      C10_CUDA_CHECK(cudaStreamWaitEvent(comm_stream.stream(), ready, 0));
      C10_CUDA_CHECK(cudaEventDestroy(ready));
      check(ncclGroupStart(), "ncclGroupStart");
      ncclResult_t failed = ncclSuccess;  // the first error, raised once the group is closed
      const char* failed_what = nullptr;
      for (const auto& p : group) {
        const ncclResult_t r = p.run(comm_stream.stream());
        if (r != ncclSuccess && r != ncclInProgress && failed == ncclSuccess) {
          failed = r;
          failed_what = p.what.c_str();
        }
      }
      const ncclResult_t end = ncclGroupEnd();
      if (failed != ncclSuccess) check(failed, failed_what);
      check(end, "ncclGroupEnd");
      settle(group.size() == 1 ? group[0].what.c_str() : "a group of collectives");
      auto done = std::make_shared<DoneEvent>();
      C10_CUDA_CHECK(cudaEventCreateWithFlags(&done->event, cudaEventDisableTiming));
      C10_CUDA_CHECK(cudaEventRecord(done->event, comm_stream.stream()));
      for (const auto& p : group) p.work->set_done(done);
    } catch (...) {
      // never launched: out of the in-flight list, whose clean-up would stop at it for good
      for (const auto& p : group) inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), p.work), inflight_.end());
      throw;
    }
  }

 public:
  void group_start() override { grouping_ = true; }
  void group_end() override {
    grouping_ = false;
    if (pending_.empty()) return;
    std::vector<Pending> group;
    group.swap(pending_);
    // one launch on one stream: the whole group is ordered after the caller's copy-ins
    run_group(rs_stream_, group);
  }

 private:
  bool grouping_ = false;
  std::vector<Pending> pending_;
  std::chrono::milliseconds timeout_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream rs_stream_, ag_stream_;
  ncclComm_t comm_ = nullptr;
  std::deque<std::shared_ptr<NcclWork>> inflight_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                               const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                               std::chrono::milliseconds timeout, c10::DeviceIndex device) {
  return std::make_unique<NcclTransport>(pg, store, key, timeout, device);
}

}  // namespace zerofuse::comm
