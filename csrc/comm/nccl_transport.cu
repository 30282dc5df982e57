// The NCCL transport of the Communicator (CUDA builds): zerofuse's own ncclComm_t, dedicated
// high-priority streams, CUDA events for ordering, buffer lifetimes held by in-flight Works, and a
// watchdog thread that bounds every collective's run by the timeout.
//
// [Note: stream ordering] A collective is launched on a comm stream (one for reduce-scatter /
// all-reduce, one for all-gather, so the two directions overlap each other and compute). The comm
// stream first waits on an event recorded on the caller's current stream, so the copy-in queued
// there has finished; the collective then records a done event, and Work::wait() makes the
// caller's current stream wait on it (no host block) before the copy-out is queued there.
// Buffers are allocated on the caller's stream: the caching allocator reuses a freed block only
// for that stream, which waits on the done event once wait() was called (wait() on another stream
// makes both streams wait, and the launch stream waits for the copy-out too: after_finish); a Work dropped
// without wait() stays in the in-flight list (keeping its buffers) until its done event fires
// ([Note: Work lifetimes] in communicator.h).
//
// [Note: NCCL watchdog] Work::wait() does not block the host, so a collective that never completes
// (a peer died or stopped) would show only as a hang at the next host synchronisation. Each launch
// also records a `started` event on the comm stream once it is past the caller's work (time queued
// behind compute does not count) and hands it, with the done event, to the transport's watchdog
// thread (nccl_watchdog.h), which polls them and ncclCommGetAsyncError while anything is in flight.
// A started collective not done within the timeout, or an asynchronous NCCL error, is recorded as
// the communicator's failure ([Note: communicator failure] in communicator.h) and the communicator
// is aborted: ncclCommAbort ends NCCL's waiting kernels, so the comm streams and the streams ordered
// after them drain instead of hanging, on garbage (a wait() that returned before the failure cannot
// be taken back), and the next launch or wait raises. comm_mu_ guards comm_: launches hold it from
// ncclGroupStart to their done event and let go once they see a failure, so the watchdog's abort
// waits at most one poll of settle_locked().
//
// The communicator is created non-blocking (ncclConfig_t.blocking = 0) so that an init, or the
// enqueueing of a collective, that does not finish within the timeout is aborted (ncclCommAbort)
// and reported instead of hanging the process.
//
// Every CUDA and NCCL call runs under a guard for the communicator's device, and the transport
// takes tensors of that device only. Nothing throws between ncclGroupStart and ncclGroupEnd (an
// open group would hold back every later NCCL call of the thread, torch's too); a group that
// fails is dropped from the in-flight list, which would otherwise wait forever on its done event.
#include "communicator.h"
#include "nccl_watchdog.h"

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
#include <mutex>
#include <thread>

namespace zerofuse::comm {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kInt: return ncclInt32;
    case at::kLong: return ncclInt64;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;  // one byte each (as gloo's): transfers exact, max / min are any / all
    default: TORCH_CHECK(false, "zerofuse.comm (NCCL): unsupported dtype ", t);
  }
}

ncclRedOp_t nccl_op(Reduce op) {
  switch (op) {
    case Reduce::kAvg: return ncclAvg;
    case Reduce::kMax: return ncclMax;
    case Reduce::kMin: return ncclMin;
    default: return ncclSum;
  }
}

class NcclWork : public Work {
 public:
  // launch_stream: the caller's current stream at launch, on which the buffers were allocated
  NcclWork(std::string what, std::chrono::milliseconds timeout, c10::DeviceIndex device,
           c10::cuda::CUDAStream launch_stream)
      : Work(std::move(what), timeout), device_(device), launch_stream_(launch_stream) {}
  // one done event, shared by the Works of collectives launched in one NCCL group
  void set_done(std::shared_ptr<CudaEvent> done) { done_ = std::move(done); }
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
  // The copy-out was queued on the waiting stream; the buffers it reads go back to the launch
  // stream's pool when wait() drops them: the launch stream is ordered after the copy-out, or a
  // later allocation there could overwrite them before it ran (a review's reading, 2026-12-07).
  void after_finish() override {
    const auto stream = c10::cuda::getCurrentCUDAStream(device_);
    if (launch_stream_ == stream) return;
    c10::cuda::CUDAGuard guard(device_);
    CudaEvent copied;
    C10_CUDA_CHECK(cudaEventRecord(copied.event, stream.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(launch_stream_.stream(), copied.event, 0));
  }

 public:
  const c10::cuda::CUDAStream& launch_stream() const { return launch_stream_; }

 private:
  std::shared_ptr<CudaEvent> done_;
  c10::DeviceIndex device_;
  c10::cuda::CUDAStream launch_stream_;
};

using Collective = std::function<ncclResult_t(cudaStream_t)>;

struct Pending {
  Collective run;
  std::shared_ptr<NcclWork> work;
  std::string what;
  // recorded on the caller's stream at the call (its copy-in): a grouped call's stream may not be
  // the one current at group_end (a stream switch inside coalesce(): NCCL read a half-written
  // buffer; a review's reading, 2026-12-07). Null: the current stream at run_group is the call's.
  std::shared_ptr<CudaEvent> ready;
};

class NcclTransport : public Transport {
 public:
  NcclTransport(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const c10::intrusive_ptr<c10d::Store>& store,
                const std::string& key, std::chrono::milliseconds timeout, c10::DeviceIndex device,
                std::shared_ptr<Failure> failure)
      : timeout_(timeout),
        device_(device >= 0 ? device : c10::cuda::current_device()),
        failure_(std::move(failure)),
        rs_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        ag_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)),
        p2p_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_)) {
    c10::cuda::CUDAGuard guard(device_);  // NCCL binds the communicator to the current device
    const int rank = pg->getRank(), ws = pg->getSize();
    const std::string what = "creating the NCCL communicator of rank " + std::to_string(rank) + " of " +
                             std::to_string(ws) + " in " + group_label(*pg);
    std::lock_guard<std::mutex> lock(comm_mu_);
    ncclUniqueId id;
    if (rank == 0) {
      check_locked(ncclGetUniqueId(&id), what, "ncclGetUniqueId");
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
    check_locked(ncclCommInitRankConfig(&comm_, ws, id, rank, &config), what, "ncclCommInitRankConfig");
    settle_locked(what);
    // [Note: NCCL watchdog]
    watchdog_ = std::make_unique<NcclWatchdog>(
        timeout_, device_, [this] { return async_error(); }, [this](const std::string& m) { fail(m); });
  }

  // Work::wait() does not block the host, so collectives may still run here: they are waited for
  // (up to the timeout) rather than cut short by an abort, whose done events would fire all the
  // same and hand the caller's stream partial results. Then the communicator is finalized and
  // destroyed; abort only when that times out or fails. After an abort (here or earlier) the
  // in-flight buffers are still held until NCCL's kernels have ended.
  ~NcclTransport() override {
    watchdog_.reset();  // joins its thread: nothing else touches comm_ now
    c10::cuda::CUDAGuard guard(device_);
    std::lock_guard<std::mutex> lock(comm_mu_);
    stall_.release();  // a stall not ended by an abort must not outlive the transport
    bool clean = drain();
    if (comm_) {
      ncclResult_t state = clean ? ncclCommFinalize(comm_) : ncclInternalError;
      const auto deadline = std::chrono::steady_clock::now() + timeout_;
      while (clean && state == ncclInProgress) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        if (state != ncclInProgress) break;
        if (std::chrono::steady_clock::now() > deadline) clean = false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      if (clean && state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
        drain();
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

  // every pair's ncclSend/ncclRecv in one group, on the collective stream (it is a collective:
  // all ranks issue it in the same order as their other collectives)
  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                                   const std::vector<int64_t>& in_splits, const std::string& what) override {
    const ncclDataType_t type = nccl_type(in.scalar_type());
    const int64_t rows = std::max<int64_t>(in.dim() ? in.size(0) : 0, out.dim() ? out.size(0) : 0);
    const int64_t row = rows ? std::max(in.numel(), out.numel()) / rows : 1;
    const int64_t bytes = row * static_cast<int64_t>(in.element_size());
    return launch(rs_stream_, what, {in, out}, [this, in, out, out_splits, in_splits, type, row, bytes](cudaStream_t s) {
      ncclResult_t first = ncclSuccess;
      int64_t at_in = 0, at_out = 0;
      for (size_t peer = 0; peer < in_splits.size(); ++peer) {
        char* src = static_cast<char*>(in.data_ptr()) + at_in * bytes;
        char* dst = static_cast<char*>(out.data_ptr()) + at_out * bytes;
        const ncclResult_t a = ncclSend(src, in_splits[peer] * row, type, static_cast<int>(peer), comm_, s);
        const ncclResult_t b = ncclRecv(dst, out_splits[peer] * row, type, static_cast<int>(peer), comm_, s);
        for (ncclResult_t r : {a, b}) {
          if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
        }
        at_in += in_splits[peer];
        at_out += out_splits[peer];
      }
      return first;
    });
  }

  // ncclSend/ncclRecv in one group on the p2p stream (NCCL matches a pair's transfers by order:
  // the two ranks must post them alike; tags are not used)
  std::shared_ptr<Work> p2p(const std::vector<P2POp>& ops, const std::string& what) override {
    std::vector<at::Tensor> buffers;
    std::vector<ncclDataType_t> types;
    for (const auto& op : ops) {
      buffers.push_back(op.tensor);
      types.push_back(nccl_type(op.tensor.scalar_type()));
    }
    return launch(p2p_stream_, what, buffers, [this, ops, types](cudaStream_t s) {
      ncclResult_t first = ncclSuccess;
      for (size_t i = 0; i < ops.size(); ++i) {
        const auto& op = ops[i];
        const ncclResult_t r = op.send ? ncclSend(op.tensor.data_ptr(), op.tensor.numel(), types[i], op.peer, comm_, s)
                                       : ncclRecv(op.tensor.data_ptr(), op.tensor.numel(), types[i], op.peer, comm_, s);
        if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
      }
      return first;
    });
  }

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
  // Records the failure, ends a debug stall (as the abort ends NCCL's kernels) and aborts.
  void abort_locked(const std::string& message) {
    failure_->set(message);
    stall_.release();
    if (comm_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
  }

  // The watchdog's expiry ([Note: NCCL watchdog]), from its thread.
  void fail(const std::string& message) {
    failure_->set(message);  // first: a launch holding comm_mu_ sees it and lets go
    std::lock_guard<std::mutex> lock(comm_mu_);
    abort_locked(message);
  }

  // From the watchdog's thread: never waits for a launch that holds comm_mu_ (it is polled again).
  // A failure recorded from Python (a timed Work.wait() that expired: Communicator::fail) counts
  // too, so the watchdog aborts NCCL: the stuck collective held the streams, and every later host
  // sync, until the watchdog's own timeout (a review's reading, 2026-12-07).
  std::string async_error() {
    if (failure_->failed()) return "the communicator failed: " + failure_->message();
    std::unique_lock<std::mutex> lock(comm_mu_, std::try_to_lock);
    if (!lock.owns_lock() || !comm_) return "";
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess) state = r;
    if (state == ncclSuccess || state == ncclInProgress) return "";
    return describe(state);
  }

  std::string describe(ncclResult_t r) const {
    std::string out = ncclGetErrorString(r);
    const char* last = comm_ ? ncclGetLastError(comm_) : nullptr;
    if (last && *last) out += std::string(" (") + last + ")";
    return out;
  }

  void check_locked(ncclResult_t r, const std::string& what, const char* call) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    const std::string message = what + ": " + call + " failed: " + describe(r) + "; the NCCL communicator was aborted";
    abort_locked(message);
    failure_->raise(message);
  }

  // Waits (up to the timeout) until the non-blocking communicator has no operation in progress.
  void settle_locked(const std::string& what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    ncclResult_t state = ncclInProgress;
    while (true) {
      if (failure_->failed()) {  // the watchdog's: let it abort at once
        abort_locked(failure_->message());
        failure_->check(what);
      }
      check_locked(ncclCommGetAsyncError(comm_, &state), what, "ncclCommGetAsyncError");
      if (state != ncclInProgress) break;
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string message = what + ": NCCL was still enqueueing it after the timeout (" + seconds(timeout_) +
                                    "); the NCCL communicator was aborted";
        abort_locked(message);
        failure_->raise(message);
      }
      std::this_thread::yield();
    }
    check_locked(state, what, "NCCL");
  }

  // Waits (up to the timeout) for every in-flight collective's done event; false if one is left.
  bool drain() {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (auto& w : inflight_) {
      while (!w->finished_nothrow()) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    return true;
  }

  std::shared_ptr<Work> launch(const c10::cuda::CUDAStream& comm_stream, const std::string& what,
                               std::vector<at::Tensor> buffers, Collective collective) {
    failure_->check(what);
    for (const auto& b : buffers) {
      TORCH_CHECK_VALUE(b.is_cuda() && b.device().index() == device_, "zerofuse.comm (NCCL): ", what,
                        ": expected tensors on cuda:", static_cast<int>(device_),
                        " (the device the communicator was created on), got a tensor on ", b.device());
    }
    c10::cuda::CUDAGuard guard(device_);  // (the ready event below is made on the device of its stream)
    const auto current = c10::cuda::getCurrentCUDAStream(device_);
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(current.stream(), &capturing));
    // (captured, its events fail the watchdog's queries: the communicator was aborted as failed)
    TORCH_CHECK(capturing == cudaStreamCaptureStatusNone, "zerofuse.comm (NCCL): ", what,
                " during CUDA graph capture: the communicator's collectives are not capturable (their events "
                "and watchdog run outside the graph); launch them outside torch.cuda.graph");
    std::shared_ptr<CudaEvent> ready;  // (made before the Work is in flight: a throw leaves nothing there)
    if (grouping_) {
      ready = std::make_shared<CudaEvent>();
      C10_CUDA_CHECK(cudaEventRecord(ready->event, current.stream()));
    }
    auto work = std::make_shared<NcclWork>(what, timeout_, device_, current);
    work->keep_alive(std::move(buffers));
    // kept (with its buffers) until its done event fires, waited for or not ([Note: Work lifetimes])
    inflight_.push_back(work);
    if (grouping_) {
      pending_.push_back({std::move(collective), work, what, std::move(ready)});
    } else {
      run_group(comm_stream, {{std::move(collective), work, what}});
    }
    return work;
  }

  void run_group(const c10::cuda::CUDAStream& comm_stream, const std::vector<Pending>& group) {
    c10::cuda::CUDAGuard guard(device_);
    while (!inflight_.empty() && inflight_.front()->done()) inflight_.pop_front();
    std::string what = group[0].what;
    for (size_t i = 1; i < group.size(); ++i) what += (i + 1 == group.size() ? " and " : ", ") + group[i].what;
    if (group.size() > 1) what = "the group of " + what;
    std::lock_guard<std::mutex> lock(comm_mu_);
    try {
      failure_->check(what);  // also covers comm_ == nullptr: only a failure clears it
      // [Note: stream ordering]
      CudaEvent ready;
      C10_CUDA_CHECK(cudaEventRecord(ready.event, c10::cuda::getCurrentCUDAStream(device_).stream()));
      C10_CUDA_CHECK(cudaStreamWaitEvent(comm_stream.stream(), ready.event, 0));
      for (const auto& p : group) {
        if (p.ready) C10_CUDA_CHECK(cudaStreamWaitEvent(comm_stream.stream(), p.ready->event, 0));
      }
      // [Note: NCCL watchdog]
      auto started = std::make_shared<CudaEvent>();
      C10_CUDA_CHECK(cudaEventRecord(started->event, comm_stream.stream()));
      if (stall_.next_launch()) stall_.hold(comm_stream.stream());
      check_locked(ncclGroupStart(), what, "ncclGroupStart");
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
      if (failed != ncclSuccess) check_locked(failed, failed_what, "its NCCL call");
      check_locked(end, what, "ncclGroupEnd");
      settle_locked(what);
      auto done = std::make_shared<CudaEvent>();
      C10_CUDA_CHECK(cudaEventRecord(done->event, comm_stream.stream()));
      for (const auto& p : group) p.work->set_done(done);
      watchdog_->watch(std::move(started), std::move(done), what);
    } catch (...) {
      // never launched: out of the in-flight list, whose clean-up would stop at it for good. A group
      // that failed past ncclGroupEnd may have queued kernels (aborted, draining) that touch its
      // buffers: their launch streams are ordered after the comm stream before the buffers go back
      // to those streams' pools (best effort: the device may be failing)
      try {
        CudaEvent drained;
        if (cudaEventRecord(drained.event, comm_stream.stream()) == cudaSuccess) {
          for (const auto& p : group) (void)cudaStreamWaitEvent(p.work->launch_stream().stream(), drained.event, 0);
        }
        (void)cudaGetLastError();
      } catch (...) {
      }
      for (const auto& p : group) inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), p.work), inflight_.end());
      throw;
    }
  }

  bool grouping_ = false;
  std::vector<Pending> pending_;
  std::chrono::milliseconds timeout_;
  c10::DeviceIndex device_;
  std::shared_ptr<Failure> failure_;
  c10::cuda::CUDAStream rs_stream_, ag_stream_, p2p_stream_;
  std::mutex comm_mu_;  // guards comm_ ([Note: NCCL watchdog])
  ncclComm_t comm_ = nullptr;
  std::deque<std::shared_ptr<NcclWork>> inflight_;
  DebugStall stall_;
  std::unique_ptr<NcclWatchdog> watchdog_;  // last: its thread uses the members above
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                               const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                               std::chrono::milliseconds timeout, c10::DeviceIndex device,
                                               std::shared_ptr<Failure> failure) {
  return std::make_unique<NcclTransport>(pg, store, key, timeout, device, std::move(failure));
}

}  // namespace zerofuse::comm
