// The ProcessGroup transport of the Communicator (communicator.h): collectives on the c10d group
// (gloo on CPU), launched asynchronously; Work::wait() blocks, bounded by the timeout.
#include "communicator.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <future>
#include <thread>

namespace zerofuse::comm {

namespace {

c10d::ReduceOp to_c10d(Reduce op) {
  switch (op) {
    case Reduce::kMax:
      return c10d::ReduceOp(c10d::ReduceOp::MAX);
    case Reduce::kMin:
      return c10d::ReduceOp(c10d::ReduceOp::MIN);
    default:
      return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
}

using Launch = std::function<c10::intrusive_ptr<c10d::Work>()>;

// [Note: gloo lets go late] ProcessGroupGloo marks a collective complete from its worker thread and
// only then drops that thread's references to the c10d Work, which holds the collective's tensors.
// A wait() that returned at once therefore left the buffers alive for as long as the worker was not
// scheduled: with busy cores, a stage-3 unit's full-size gradient (3 MiB in test_zero_memory) was
// still allocated when the next forward began, and measured peaks varied from run to run (CI
// 2026-11-26; here 4 of 12 runs of that test, and 33-46 of 300 waits of a 1 MiB all-reduce).
// After a gloo wait the Work's references are awaited (yielding, then sleeping 20 us at a time, at
// most kSettleBound; after kSettleGiveUp waits that reached the bound, never again in this
// process: a backend that keeps its references is not waited for), so a waited collective's
// buffers are freed by the time wait() returns, as on the NCCL transport. Wait times unchanged
// (2 ranks here, medians of 50: p2p 0.10-0.19 ms, 1000-float all-reduce 0.25-0.30 ms, both trees).
constexpr auto kSettleBound = std::chrono::milliseconds(100);
constexpr int kSettleGiveUp = 3;
std::atomic<int> settle_bound_reached{0};

class PgWork : public Work {
 public:
  using Future = std::shared_future<c10::intrusive_ptr<c10d::Work>>;
  PgWork(std::string what, std::chrono::milliseconds timeout, std::vector<Future> futs, bool gloo)
      : Work(std::move(what), timeout), futs_(std::move(futs)), gloo_(gloo) {}

 protected:
  void wait_transport() override {
    // one deadline for all of the Work's pieces (each waited up to the whole timeout before)
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const auto left = [&] {
      return std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                        deadline - std::chrono::steady_clock::now()));
    };
    for (auto& f : futs_) {
      if (f.wait_for(left()) != std::future_status::ready) {
        TORCH_CHECK(false, "timed out after ", timeout_.count(), " ms before the collective was launched");
      }
      f.get()->wait(left());
    }
  }
  void release_transport() override {
    if (gloo_) settle();
    futs_.clear();
  }
  bool transport_done() override {
    for (auto& f : futs_) {
      if (f.wait_for(std::chrono::seconds(0)) != std::future_status::ready || !f.get()->isCompleted()) return false;
    }
    return true;
  }

 private:
  // [Note: gloo lets go late]: until this Work holds the only reference to each c10d Work
  void settle() {
    if (settle_bound_reached.load(std::memory_order_relaxed) >= kSettleGiveUp) return;
    const auto deadline = std::chrono::steady_clock::now() + kSettleBound;
    int tries = 0;
    for (auto& f : futs_) {
      const auto& w = f.get();
      while (w.use_count() > 1) {
        if (std::chrono::steady_clock::now() > deadline) {
          settle_bound_reached.fetch_add(1, std::memory_order_relaxed);
          return;
        }
        // a few yields, then short sleeps: a spinning waiter (one per rank, on few cores) would
        // keep the gloo worker it waits for off the CPU
        if (++tries <= 8) {
          std::this_thread::yield();
        } else {
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      }
    }
  }

  std::vector<Future> futs_;
  bool gloo_;
};

// All-reduces above this size are split into pieces of about kPieceBytes, launched back to back:
// ProcessGroupGloo runs async collectives on several worker threads, so pieces pipeline (measured
// on gloo, 2 ranks: a ~100 MB buffer reduced as one collective took ~1.9x as long as in 1 MB
// buckets; see bench_collectives' bucket sweep).
//
// [Note: piece size] A piece is kPieceBytes / element size + 1 elements, not a round number. gloo
// pairs collectives by order and aborts a rank that receives more than it posted, so ranks that
// all-reduce different sizes (a bug: ZEROFUSE_CHECK_COLLECTIVES names it) normally abort at the
// first piece that differs. But when one rank's pieces are a prefix of the other's (its size a
// whole number of pieces, the other's larger), each of its pieces finds a partner of its size and
// its call returns with a mix of the ranks' data. With round pieces (4 MiB) that took a rank whose
// buffer was 4 MiB; with pieces of 2^20 + 1 floats it takes a multiple of 1048577 elements.
// No split avoids it for every size (the smallest size split in two starts with a piece that is a
// whole call on its own); only a size check before each call would, a collective of its own.
constexpr int64_t kPieceBytes = 4 << 20;

// [Note: gloo p2p poster] gloo's send/recv calls, though asynchronous, take the pair's lock and may
// start the transfer in the calling thread; with busy cores the caller then waits for the
// peer's and its own gloo threads to be scheduled (measured in a pp 2 pipeline on 2 cores:
// 1.6-3.5 ms per post, on both ranks at once, against 0.1 ms typically). Point-to-point posts on
// gloo therefore run on one thread of the transport: the caller only queues them and its Work
// waits for "posted" and then for the transfer. gloo matches p2p by tag, so a post's moment does
// not change what it pairs with. Not for other backends: NCCL's c10d send/recv order themselves
// after the calling thread's current stream.
class Poster {
 public:
  ~Poster() {
    {
      std::lock_guard<std::mutex> g(m_);
      stop_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  PgWork::Future post(Launch launch) {
    auto result = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
    PgWork::Future fut = result->get_future().share();
    {
      std::lock_guard<std::mutex> g(m_);
      if (!thread_.joinable()) thread_ = std::thread([this]() { run(); });  // first use: after any fork
      queue_.emplace_back([launch = std::move(launch), result]() {
        try {
          result->set_value(launch());
        } catch (...) {
          result->set_exception(std::current_exception());
        }
      });
    }
    cv_.notify_one();
    return fut;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> g(m_);
        cv_.wait(g, [this]() { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left to post
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;
};

class ProcessGroupTransport : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::chrono::milliseconds timeout,
                        std::chrono::milliseconds delay)
      : pg_(std::move(pg)), timeout_(timeout), delay_(delay), gloo_(pg_->getBackendName() == "gloo") {}

  std::string name() const override { return "process_group(" + pg_->getBackendName() + ")"; }

  // gloo's tensor reduce-scatter and all-gather stage the whole buffer through temporaries
  // (measured, 2 ranks, 100 MB fp32: reduce_scatter_tensor 168 ms and +153 MB resident,
  // all_gather_into_tensor 112 ms and +102 MB; an in-place all-reduce 65 ms and +5 MB, one
  // in-place broadcast per rank's slot 33 ms and +1 MB): on gloo, reduce-scatter is an in-place
  // all-reduce and all-gather a broadcast from each rank's slot of the output.
  bool reduce_scatter_via_all_reduce() const override { return gloo_; }

  std::shared_ptr<Work> reduce_scatter(const at::Tensor& out, const at::Tensor& in, Reduce op,
                                       const std::string& what) override {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = timeout_;
    auto pg = pg_;
    return submit(what, {[pg, out, in, opts]() {
                    at::Tensor o = out, i = in;  // c10d takes non-const references
                    return pg->_reduce_scatter_base(o, i, opts);
                  }});
  }

  std::shared_ptr<Work> all_gather(const at::Tensor& out, const at::Tensor& in, const std::string& what) override {
    auto pg = pg_;
    if (gloo_) {
      const int64_t n = in.numel();
      const int ws = pg->getSize(), rank = pg->getRank();
      c10d::BroadcastOptions bopts;
      bopts.timeout = timeout_;
      std::vector<Launch> launches;
      for (int r = 0; r < ws; ++r) {
        at::Tensor slot = out.narrow(0, r * n, n);
        bopts.rootRank = r;
        launches.push_back([pg, slot, in, bopts, own = r == rank]() {
          if (own && slot.data_ptr() != in.data_ptr()) slot.copy_(in);  // not already in place
          std::vector<at::Tensor> ts{slot};
          return pg->broadcast(ts, bopts);
        });
      }
      return submit(what, launches);
    }
    c10d::AllgatherOptions opts;
    opts.timeout = timeout_;
    return submit(what, {[pg, out, in, opts]() {
                    at::Tensor o = out, i = in;
                    return pg->_allgather_base(o, i, opts);
                  }});
  }

  std::shared_ptr<Work> all_reduce(const at::Tensor& buf, Reduce op, const std::string& what) override {
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    opts.timeout = timeout_;
    auto pg = pg_;
    const int64_t piece = kPieceBytes / buf.element_size() + 1;  // [Note: piece size]
    std::vector<Launch> launches;
    for (int64_t b = 0; b < buf.numel(); b += piece) {
      at::Tensor part = buf.narrow(0, b, std::min(piece, buf.numel() - b));
      launches.push_back([pg, part, opts]() {
        std::vector<at::Tensor> ts{part};
        return pg->allreduce(ts, opts);
      });
    }
    return submit(what, launches);
  }

  std::shared_ptr<Work> all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                                   const std::vector<int64_t>& in_splits, const std::string& what) override {
    c10d::AllToAllOptions opts;
    opts.timeout = timeout_;
    auto pg = pg_;
    return submit(what, {[pg, out, in, out_splits, in_splits, opts]() {
                    at::Tensor o = out, i = in;
                    std::vector<int64_t> os = out_splits, is = in_splits;
                    return pg->alltoall_base(o, i, os, is, opts);
                  }});
  }

  // c10d send/recv (gloo: matched by source and tag, so the order of a pair's transfers need not
  // agree between the two ranks), posted by the poster thread on gloo ([Note: gloo p2p poster]),
  // at once otherwise
  std::shared_ptr<Work> p2p(const std::vector<P2POp>& ops, const std::string& what) override {
    auto pg = pg_;
    std::vector<Launch> launches;
    for (const auto& op : ops) {
      launches.push_back([pg, op]() {
        std::vector<at::Tensor> ts{op.tensor};
        return op.send ? pg->send(ts, op.peer, op.tag) : pg->recv(ts, op.peer, op.tag);
      });
    }
    if (!gloo_ || delay_.count() != 0) return submit(what, launches);
    std::vector<PgWork::Future> futs;
    for (auto& launch : launches) futs.push_back(poster_.post(std::move(launch)));
    return std::make_shared<PgWork>(what, timeout_, std::move(futs), gloo_);
  }

  void wait_launched() override {
    if (last_.valid()) last_.wait();
  }

 private:
  // Without a delay the collectives are launched here. With one (tests), launches go through a
  // chain of futures: each waits for the previous launch, sleeps, then launches, so the order of
  // collectives on the group is the order of the calls (gloo matches collectives by order).
  std::shared_ptr<Work> submit(const std::string& what, const std::vector<Launch>& launches) {
    std::vector<PgWork::Future> futs;
    for (const auto& launch : launches) {
      if (delay_.count() == 0) {
        std::promise<c10::intrusive_ptr<c10d::Work>> p;
        p.set_value(launch());
        futs.push_back(p.get_future().share());
      } else {
        // The chain (last_) carries only "launched": the c10d Work (and through it the buffers)
        // is held by this call's PgWork alone, and the launch closure and the promise are dropped
        // once it ran, so a waited collective pins no staging buffer through the chain.
        auto prev = last_;
        auto delay = delay_;
        auto result = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
        auto fn = std::make_shared<Launch>(launch);
        futs.push_back(result->get_future().share());
        last_ = std::async(std::launch::async, [prev, delay, fn, result]() mutable {
                  if (prev.valid()) prev.wait();
                  std::this_thread::sleep_for(delay);
                  Launch run;
                  run.swap(*fn);
                  try {
                    result->set_value(run());
                  } catch (...) {
                    result->set_exception(std::current_exception());
                  }
                  result.reset();  // the promise shares the Work's state: only the PgWork keeps it
                }).share();
      }
    }
    return std::make_shared<PgWork>(what, timeout_, std::move(futs), gloo_);
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::chrono::milliseconds timeout_, delay_;
  bool gloo_;
  std::shared_future<void> last_;
  Poster poster_;  // last: joined before the group it posts to is released
};

}  // namespace

std::unique_ptr<Transport> make_process_group_transport(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                        std::chrono::milliseconds timeout,
                                                        std::chrono::milliseconds delay) {
  return std::make_unique<ProcessGroupTransport>(std::move(pg), timeout, delay);
}

}  // namespace zerofuse::comm
