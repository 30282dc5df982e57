// zerofuse's Communicator: fused, coalesced collectives over lists of tensors on top of a c10d
// ProcessGroup (any backend; gloo on CPU) or, in CUDA builds, its own NCCL communicator.
//
// A coalesced collective copies its tensors into one flat buffer (zerofuse::flatten_into: one
// parallel pass on CPU, one kernel on CUDA), runs one collective on it, and copies the result
// out (zerofuse::unflatten_from) when the caller waits: the Work returned by every call is the
// only way to the result, like torch's async collectives.
//
// [Note: Work lifetimes] A Work owns every buffer its collective touches (the flat buffers, the
// output shard). The ProcessGroup transport keeps them alive through the c10d Work; the NCCL
// transport keeps each in-flight Work in a list until its done event has fired, so buffers that
// the comm stream uses are never freed early and record_stream is never needed, even when the
// caller drops the Work without waiting.
//
// [Note: communicator failure] The first collective that fails (a wait that times out or reports
// a peer's loss; on NCCL also a failed NCCL call, the watchdog's expiry or an asynchronous error:
// [Note: NCCL watchdog] in nccl_transport.cu) marks its communicator failed with one message naming
// that collective, its sequence number, the group and the timeout. From then on every launch and every
// wait of that communicator raises at once (c10::DistBackendError, torch.distributed.DistBackendError
// in Python) with that message: the ranks' sequences of collectives no longer match (gloo has closed
// its pairs, the NCCL communicator is aborted), so going on could only hang or mix data up, and
// results that an aborted collective left behind must never be handed out as if complete.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

// "zerofuse::comm.<fn>: <message>", fn being ".reduce_scatter_coalesced" etc.: the messages of
// comm/local.py (world size 1) word for word (ZF_CHECK's "zerofuse::comm: .fn" did not match)
#define ZF_COMM_CHECK(cond, fn, ...) TORCH_CHECK(cond, "zerofuse::comm", fn, ": ", __VA_ARGS__)
#define ZF_COMM_CHECK_VALUE(cond, fn, ...) TORCH_CHECK_VALUE(cond, "zerofuse::comm", fn, ": ", __VA_ARGS__)

namespace zerofuse::comm {

enum class Reduce { kSum, kAvg, kMax, kMin };

Reduce parse_reduce(const std::string& op, const char* fn);

// "group 0 (default_pg)": how messages name a process group (its name, and its description if any)
std::string group_label(const c10d::ProcessGroup& pg);
// "3 s", "2.5 s"
std::string seconds(std::chrono::milliseconds t);

// The failed state of one communicator, shared by its transports and Works ([Note: communicator
// failure]). Thread-safe: the NCCL watchdog sets it from its own thread.
class Failure {
 public:
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  std::string message() const;
  // Raises if failed: `what` (a collective about to be launched or waited for) is refused.
  void check(const std::string& what) const;
  // Records `message` unless a failure is recorded already (later ones follow from the first).
  void set(const std::string& message);
  // set(), then raises the first failure (and this one, when it is another).
  [[noreturn]] void raise(const std::string& message);

 private:
  mutable std::mutex mu_;
  std::string message_;
  std::atomic<bool> failed_{false};
};

// One collective in flight. wait(): CPU, blocks until done (at most the communicator's timeout);
// CUDA, makes the current stream wait for it (no host block). Then runs the copy-out once.
class Work {
 public:
  Work(std::string what, std::chrono::milliseconds timeout) : what_(std::move(what)), timeout_(timeout) {}
  virtual ~Work() = default;
  void wait();
  // wait() bounded by `limit` where it is below the communicator's timeout (Work.wait(timeout=) on
  // the ProcessGroup transport: gloo's send/recv Works report no completion before their wait, so
  // polling is_completed() failed every timed point-to-point wait; a review's reproduction,
  // 2026-12-07). Past it, the communicator's failure, as its own timeout.
  void wait_within(std::chrono::milliseconds limit);
  bool is_completed();
  const std::string& what() const { return what_; }
  // runs after the collective, in wait() (on the current stream for CUDA tensors)
  void set_finish(std::function<void()> fn) { finish_ = std::move(fn); }
  void keep_alive(std::vector<at::Tensor> ts) { keep_ = std::move(ts); }
  // the communicator's failed state: wait() raises once it is set ([Note: communicator failure])
  void set_failure(std::shared_ptr<Failure> f) { failure_ = std::move(f); }

 protected:
  virtual void wait_transport() = 0;
  virtual bool transport_done() = 0;
  // after the copy-out (finish_) was queued, before the buffers it read are dropped
  virtual void after_finish() {}
  // after wait(): drop the transport's handles (a c10d Work holds its tensors until destroyed)
  virtual void release_transport() {}
  std::string what_;
  std::chrono::milliseconds timeout_;

 private:
  // wait(), wait_within() and is_completed() from several threads at once (the bindings release the
  // GIL): two waits ran finish_ and cleared keep_ together, a segfault (a review's reproduction,
  // 2026-12-07). A wait holds it throughout; is_completed() only tries it (a poll never blocks).
  std::recursive_mutex mu_;
  std::function<void()> finish_;
  std::vector<at::Tensor> keep_;
  std::shared_ptr<Failure> failure_;
  std::atomic<bool> finished_{false};
  bool limited_ = false;  // timeout_ is a wait_within limit (its message names the wait's timeout)
  std::chrono::milliseconds limit_{0};  // that limit, as given
};

// A Work that is complete at creation (empty lists: no collective runs).
class DoneWork : public Work {
 public:
  using Work::Work;

 protected:
  void wait_transport() override {}
  bool transport_done() override { return true; }
};

// One point-to-point transfer of a batch (csrc/comm/p2p.cpp): send `tensor` to, or receive it
// from, `peer` (a rank of the communicator's group). `tag` tells transfers between the same pair
// apart on transports that match by tag (c10d/gloo); NCCL matches a pair's transfers by order.
struct P2POp {
  bool send;
  at::Tensor tensor;  // contiguous; written at wait() for a receive
  int peer;
  int tag;
};

// How a collective reaches the other ranks. Buffers are flat, contiguous, on one device.
class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  virtual std::shared_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, Reduce op,
                                               const std::string& what) = 0;
  virtual std::shared_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) = 0;
  virtual std::shared_ptr<Work> all_reduce(const at::Tensor& buf, Reduce op, const std::string& what) = 0;
  // every op of the batch posted together (NCCL: one ncclGroupStart/End of ncclSend/ncclRecv on
  // the p2p stream; c10d: isend/irecv); the Work completes when all have
  virtual std::shared_ptr<Work> p2p(const std::vector<P2POp>& ops, const std::string& what) = 0;
  // rows of `in` to every rank, in_splits[r] rows to rank r in rank order; `out` gets out_splits[r]
  // rows from rank r (in, out: contiguous, [rows, ...] of one row size)
  virtual std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in,
                                           const std::vector<int64_t>& out_splits,
                                           const std::vector<int64_t>& in_splits, const std::string& what) = 0;
  // AVG is done by the transport (true) or by the communicator as SUM then a scale (false)
  virtual bool native_avg() const { return false; }
  // Reduce-scatter is faster and lighter as an in-place all-reduce of the flat buffer, then a
  // copy of this rank's shard (gloo: see ProcessGroupTransport)
  virtual bool reduce_scatter_via_all_reduce() const { return false; }
  // Collectives issued between group_start() and group_end() may be launched together (NCCL:
  // one ncclGroupStart/End, one done event); the ProcessGroup transport launches them at once.
  virtual void group_start() {}
  virtual void group_end() {}
  // The collectives of earlier calls launched on the group (a test delay's chain launches them
  // later): before a caller launches on the c10d group itself, which gloo pairs by order.
  virtual void wait_launched() {}
};

// csrc/comm/process_group_transport.cpp
std::unique_ptr<Transport> make_process_group_transport(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                        std::chrono::milliseconds timeout,
                                                        std::chrono::milliseconds delay);
// CUDA builds: csrc/comm/nccl_transport.cu; CPU builds: an error naming what is missing.
// device: the CUDA device the communicator lives on (-1: the current one); it takes tensors of
// that device only. failure: the communicator's, set by the transport's watchdog.
std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                               const c10::intrusive_ptr<c10d::Store>& store, const std::string& key,
                                               std::chrono::milliseconds timeout, c10::DeviceIndex device,
                                               std::shared_ptr<Failure> failure);

class Communicator {
 public:
  // transport: "auto" (CPU tensors through the ProcessGroup; CUDA tensors through NCCL in CUDA
  // builds, created at the first CUDA collective, else the ProcessGroup), "process_group" or
  // "nccl" (created now). store and key: where rank 0 publishes the NCCL id.
  // timeout_s bounds every blocking wait and, on NCCL, every collective's run on the device
  // ([Note: NCCL watchdog]); debug_delay_ms delays each collective's launch (tests use it to expose
  // reads that do not wait).
  Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
               const std::string& transport, const std::string& key, double timeout_s, double debug_delay_ms);

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::string transport_name() const { return mode_; }
  int64_t sequence() const { return seq_; }

  // ceil(total numel / world_size): the shard numel of a coalesced reduce-scatter / all-gather
  int64_t shard_numel(at::TensorList tensors) const;

  std::shared_ptr<Work> reduce_scatter_coalesced(at::TensorList tensors,  // any shapes, one device
                                                 const at::Tensor& out_shard,  // (shard_numel,) contiguous
                                                 const std::string& op,  // "sum" | "avg" | "max" | "min"
                                                 std::optional<double> scale,  // multiplies the result
                                                 std::optional<at::ScalarType> reduce_dtype);  // default out's
  std::shared_ptr<Work> all_gather_coalesced(const at::Tensor& shard,  // (shard_numel,) contiguous
                                             at::TensorList tensors);  // written at wait()
  std::shared_ptr<Work> all_reduce_coalesced(at::TensorList tensors, const std::string& op,
                                             std::optional<double> scale, std::optional<at::ScalarType> reduce_dtype);
  // Point-to-point transfers posted together (csrc/comm/p2p.cpp). They take no collective
  // sequence number (only the two ranks of a transfer take part), so they never shift the
  // collective checker's numbering; messages number them per communicator as "batch_p2p #n".
  std::shared_ptr<Work> batch_p2p(const std::vector<P2POp>& ops);
  int64_t p2p_sequence() const { return p2p_seq_; }
  // The failed state from Python: collectives run on the c10d group itself
  // (reduce_scatter_fp32_sum) refuse once it is set, and set it when they fail.
  void fail(const std::string& message) { failure_->set(message); }
  void check_usable(const std::string& what) const { failure_->check(what); }
  // Before such a collective: this communicator's earlier ones launched on the group first (with
  // ZEROFUSE_COMM_DELAY_MS the fp32-sum all-to-all overtook them: both ranks' calls timed out,
  // a review's reproduction, 2026-12-07).
  void wait_launched() { pg_transport_->wait_launched(); }
  // All-to-all with per-rank row counts (csrc/comm/all_to_all.cpp): a collective (every rank of
  // the group calls it, in the same order as the others), e.g. MoE's token dispatch and combine.
  std::shared_ptr<Work> all_to_all(const at::Tensor& out,  // [sum(out_splits), ...] contiguous, written at wait()
                                   const at::Tensor& in,  // [sum(in_splits), ...] contiguous, out's row size
                                   const std::vector<int64_t>& out_splits,  // (world_size,) rows from each rank
                                   const std::vector<int64_t>& in_splits);  // (world_size,) rows to each rank
  // Fuse the collectives issued in between into one launch where the transport can (NCCL: e.g.
  // every bucket's reduce-scatter in one ncclGroupStart/End). Their Works may be waited for
  // only after group_end().
  void group_start();
  void group_end();

  // CPU staging buffers (the flat copies of tensor lists) are kept and reused across calls; see
  // Communicator::staging. Bytes held now, and dropping them (in-flight ones go when done).
  int64_t staging_bytes();
  void free_staging();

 private:
  at::Tensor staging(int64_t numel, const at::TensorOptions& options);
  std::string label(const char* fn);
  int64_t ceil_shard(int64_t total) const { return (total + world_size_ - 1) / world_size_; }
  Transport& transport_for(const at::Device& device, const char* fn);
  // the transport's Work, tied to this communicator's failed state
  std::shared_ptr<Work> watched(std::shared_ptr<Work> work);
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string mode_, key_;
  std::unique_ptr<Transport> pg_transport_, nccl_transport_;
  int rank_, world_size_;
  int64_t seq_ = 0;
  int64_t p2p_seq_ = 0;
  bool grouping_ = false;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<Failure> failure_ = std::make_shared<Failure>();
  std::string group_;  // group_label(*pg_)
  std::vector<at::Tensor> staging_pool_;  // 1-D byte tensors; free when the pool holds the only reference
  std::mutex staging_mu_;
};

}  // namespace zerofuse::comm
