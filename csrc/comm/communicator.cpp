// Communicator (communicator.h): the coalesced collectives, Work and the failed state.
#include "communicator.h"

#include "../checks.h"

#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace zerofuse::comm {

namespace {

void flatten_into(at::TensorList tensors, const at::Tensor& flat, c10::ArrayRef<int64_t> offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("zerofuse::flatten_into", "")
                       .typed<void(at::TensorList, const at::Tensor&, c10::ArrayRef<int64_t>)>();
  op.call(tensors, flat, offsets);
}

void unflatten_from(const at::Tensor& flat, at::TensorList tensors, c10::ArrayRef<int64_t> offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("zerofuse::unflatten_from", "")
                       .typed<void(const at::Tensor&, at::TensorList, c10::ArrayRef<int64_t>)>();
  op.call(flat, tensors, offsets);
}

std::vector<int64_t> packed_offsets(at::TensorList tensors, int64_t* total) {
  std::vector<int64_t> offsets;
  offsets.reserve(tensors.size());
  int64_t off = 0;
  for (const auto& t : tensors) {
    offsets.push_back(off);
    off += t.numel();
  }
  *total = off;
  return offsets;
}

void check_one_device(at::TensorList tensors, const char* fn, const at::Tensor* other, const char* other_name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Device want = other ? other->device() : tensors[0].device();
    ZF_COMM_CHECK(tensors[i].device() == want, fn, "expected ", indexed("tensors", i), " on ", want,
             other ? " like " : " like tensors[0]", other ? other_name : "", ", got ", tensors[i].device());
  }
}

// One contiguous tensor of exactly the collective's flat size and dtype: used as the flat buffer.
bool is_whole_flat(at::TensorList tensors, int64_t numel, at::ScalarType dtype) {
  return tensors.size() == 1 && tensors[0].is_contiguous() && tensors[0].numel() == numel &&
         tensors[0].scalar_type() == dtype;
}

void check_flat(const at::Tensor& t, int64_t numel, const char* fn, const char* name) {
  ZF_COMM_CHECK(t.dim() == 1 && t.is_contiguous(), fn, "expected ", name,
           " to be a 1-D contiguous tensor, got shape ", t.sizes(), " with strides ", t.strides());
  ZF_COMM_CHECK_VALUE(t.numel() == numel, fn, "expected ", name, " to have ", numel,
                 " elements (ceil(total numel / world_size)), got ", t.numel());
}

// How a reduction runs: the op the transport runs, the factor the flat buffer is multiplied by
// before it and the one the result is multiplied by after it. AVG is SUM and 1 / world_size where
// the transport has no AVG: after the sum, except in fp16, whose range (65504) the sum of the
// ranks' values can leave where their mean does not (gloo gave inf for the avg of 40000 on two
// ranks): before it, as NCCL's own avg of floats; `scale` multiplies the result either way.
struct ReducePlan {
  Reduce op;
  double before, after;
};

// t *= factor, the factor kept in double (the product in the dtype's opmath, as torch's t.mul_(1 / 3)):
// aten's mul_(Scalar) rounds the factor to t's dtype first (bf16(1/3) = 0.334, fp16(0.1) = 0.09998: an
// average over 3 ranks or a scale of 0.1 was off by an ulp against one rank's path; a review's
// reproduction, 2026-12-07).
void scale_in_place(at::Tensor t, double factor) {
  if (factor != 1.0) t.mul_(at::native::wrapped_scalar_tensor(at::Scalar(factor)));
}

ReducePlan plan_reduce(Reduce op, const Transport& transport, std::optional<double> scale, int world_size,
                       at::ScalarType dtype) {
  const bool avg_here = op == Reduce::kAvg && !transport.native_avg();
  const bool first = avg_here && dtype == at::kHalf;
  const double ws = static_cast<double>(world_size);
  return {avg_here ? Reduce::kSum : op, first ? 1.0 / ws : 1.0, scale.value_or(1.0) / (avg_here && !first ? ws : 1.0)};
}

// An integer reduction cannot be multiplied by a fraction: refused before anything runs (it raised
// in wait(), after the collective, and a second wait() returned with the tensors unwritten).
void check_reduce_dtype(Reduce op, std::optional<double> scale, at::ScalarType dtype, const char* fn) {
  // (a scale of 1.0 is none: the collective checker's signature, zerofuse/comm/checker.py, takes it so)
  ZF_COMM_CHECK_VALUE(at::isFloatingType(dtype) || (op != Reduce::kAvg && (!scale || *scale == 1.0)), fn,
                      "expected a floating dtype with op 'avg' or a scale (the result is multiplied by a fraction), "
                      "got ", dtype, op == Reduce::kAvg ? " with op 'avg'" : " with a scale");
}

// Seconds to the communicator's timeout: positive (NaN refused); at most kMaxTimeoutS (~3 years:
// inf, 1e30 or 1e10 s overflowed the milliseconds, and deadlines in nanoseconds, into a 1 ms timeout
// that failed the first collective and broke the group).
constexpr double kMaxTimeoutS = 1e8;

std::chrono::milliseconds timeout_ms(double timeout_s) {
  TORCH_CHECK_VALUE(timeout_s > 0, "zerofuse.comm.Communicator: expected timeout > 0 seconds, got ", timeout_s);
  const double ms = std::min(timeout_s, kMaxTimeoutS) * 1000;
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(ms)));
}

}  // namespace

Reduce parse_reduce(const std::string& op, const char* fn) {
  if (op == "sum") return Reduce::kSum;
  if (op == "avg") return Reduce::kAvg;
  if (op == "max") return Reduce::kMax;
  if (op == "min") return Reduce::kMin;
  TORCH_CHECK_VALUE(false, "zerofuse::comm", fn, ": expected op 'sum', 'avg', 'max' or 'min', got '", op, "'");
}

std::string group_label(const c10d::ProcessGroup& pg) {
  const std::string& desc = pg.getGroupDesc();
  std::string out = "group " + pg.getGroupName();
  if (!desc.empty() && desc != "undefined") out += " (" + desc + ")";
  return out;
}

std::string seconds(std::chrono::milliseconds t) {
  std::ostringstream s;
  s << static_cast<double>(t.count()) / 1000.0 << " s";
  return s.str();
}

std::string Failure::message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return message_;
}

void Failure::check(const std::string& what) const {
  if (!failed()) return;
  C10_THROW_ERROR(DistBackendError, "zerofuse.comm: " + what +
                                        " refused: the communicator failed earlier and is unusable: " + message());
}

void Failure::set(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  message_ = message;
  failed_.store(true, std::memory_order_release);
}

void Failure::raise(const std::string& message) {
  set(message);
  const std::string first = this->message();
  C10_THROW_ERROR(DistBackendError, "zerofuse.comm: " + first + (first == message ? "" : "; then " + message));
}

void Work::wait() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (finished_) return;
  if (failure_) failure_->check(what_);
  try {
    wait_transport();
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    const std::string cause = c10_error ? c10_error->what_without_backtrace() : e.what();
    const std::string message =
        limited_ ? what_ + " did not finish within the wait's timeout of " + seconds(limit_) + ": " + cause
                 : what_ + " failed (timeout " + seconds(timeout_) + "): " + cause;
    if (failure_) failure_->raise(message);
    C10_THROW_ERROR(DistBackendError, "zerofuse.comm: " + message);
  }
  if (finish_) {
    finish_();  // (when it raises, the next wait() runs it again and raises again: never "done" unwritten)
    after_finish();
    finish_ = nullptr;  // drops the buffers it holds: a waited Work kept by the caller pins nothing
  }
  finished_ = true;
  keep_.clear();
  release_transport();
}

void Work::wait_within(std::chrono::milliseconds limit) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const auto saved = timeout_;
  if (limit < timeout_) {
    // (+1 ms: c10d's timed waits may return a fraction of a millisecond early: never before the limit)
    timeout_ = limit + std::chrono::milliseconds(1);
    limit_ = limit;
    limited_ = true;
  }
  try {
    wait();
  } catch (...) {
    timeout_ = saved;
    limited_ = false;
    throw;
  }
  timeout_ = saved;
  limited_ = false;
}

// true once wait() would not block: done, or failed (then wait() raises)
bool Work::is_completed() {
  if (finished_) return true;
  std::unique_lock<std::recursive_mutex> lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return finished_;  // another thread is in wait(): not done until it says so
  return finished_ || (failure_ && failure_->failed()) || transport_done();
}

#ifndef ZEROFUSE_WITH_NCCL
std::unique_ptr<Transport> make_nccl_transport(const c10::intrusive_ptr<c10d::ProcessGroup>&,
                                               const c10::intrusive_ptr<c10d::Store>&, const std::string&,
                                               std::chrono::milliseconds, c10::DeviceIndex, std::shared_ptr<Failure>) {
  TORCH_CHECK(false,
              "zerofuse.comm.Communicator: the NCCL transport needs CUDA: this build of zerofuse has no CUDA/NCCL "
              "(CPU torch or no nvcc at build time); use transport='process_group'");
}
#endif

Communicator::Communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::Store> store,
                           const std::string& transport, const std::string& key, double timeout_s,
                           double debug_delay_ms)
    : pg_(std::move(pg)),
      store_(std::move(store)),
      mode_(transport),
      key_(key),
      rank_(pg_->getRank()),
      world_size_(pg_->getSize()),
      timeout_(timeout_ms(timeout_s)),
      group_(group_label(*pg_)) {
  TORCH_CHECK_VALUE(mode_ == "auto" || mode_ == "process_group" || mode_ == "nccl",
                    "zerofuse.comm.Communicator: expected transport 'auto', 'process_group' or 'nccl', got '", mode_,
                    "'");
  pg_transport_ =
      make_process_group_transport(pg_, timeout_, std::chrono::milliseconds(static_cast<int64_t>(debug_delay_ms)));
  if (mode_ == "nccl") {
    TORCH_CHECK_VALUE(store_, "zerofuse.comm.Communicator: the NCCL transport needs a store to share its id");
    nccl_transport_ = make_nccl_transport(pg_, store_, key_, timeout_, /*device=*/-1, failure_);  // the current device
  }
}

// CPU staging buffers: a fresh buffer per call paid its page faults every time (measured, one
// rank, 150 MB fp32: a copy into a fresh buffer 95 ms, into a reused one 32 ms; the 2-rank
// all_reduce_coalesced of 256 tensors of 4 KB - 4 MB, ~150 MB, took 252 ms against 109 ms for the
// all-reduce of an existing flat buffer). Up to kStagingBuffers buffers are kept, each as large as
// the largest call that used it; a buffer is free when the pool holds its only reference (a Work
// drops its buffers in wait(), the transports when the collective is done), so a buffer is never
// handed out while a collective may still touch it. CUDA buffers come from torch's caching
// allocator as before (reuse there is stream-ordered by the allocator itself).
constexpr size_t kStagingBuffers = 4;

at::Tensor Communicator::staging(int64_t numel, const at::TensorOptions& options) {
  if (!options.device().is_cpu() || numel == 0) return at::empty({numel}, options);
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  std::lock_guard<std::mutex> lock(staging_mu_);
  at::Tensor* pick = nullptr;   // the smallest free buffer that fits
  at::Tensor* spare = nullptr;  // else the smallest free one, to be replaced by a larger one
  for (auto& b : staging_pool_) {
    if (b.storage().use_count() != 1) continue;  // in flight
    if (b.numel() >= bytes && (!pick || b.numel() < pick->numel())) pick = &b;
    if (!spare || b.numel() < spare->numel()) spare = &b;
  }
  if (!pick) {
    at::Tensor fresh = at::empty({bytes}, options.dtype(at::kByte));
    if (staging_pool_.size() < kStagingBuffers) {
      staging_pool_.push_back(std::move(fresh));
      pick = &staging_pool_.back();
    } else if (spare) {
      *spare = std::move(fresh);
      pick = spare;
    } else {
      return fresh.view(dtype);  // every kept buffer is in flight: this one is not kept
    }
  }
  return pick->narrow(0, 0, bytes).view(dtype);
}

int64_t Communicator::staging_bytes() {
  std::lock_guard<std::mutex> lock(staging_mu_);
  int64_t total = 0;
  for (const auto& b : staging_pool_) total += b.numel();
  return total;
}

void Communicator::free_staging() {
  std::lock_guard<std::mutex> lock(staging_mu_);
  staging_pool_.clear();
}

Transport& Communicator::transport_for(const at::Device& device, const char* fn) {
  if (mode_ == "process_group") return *pg_transport_;
  if (mode_ == "nccl") {
    ZF_COMM_CHECK(device.is_cuda(), fn, "the NCCL transport takes CUDA tensors, got tensors on ", device);
    return *nccl_transport_;
  }
#ifdef ZEROFUSE_WITH_NCCL
  if (device.is_cuda()) {
    // every rank issues its first CUDA collective in the same order: creation is collective too
    if (!nccl_transport_) {
      nccl_transport_ = make_nccl_transport(pg_, store_, key_, timeout_, device.index(), failure_);
      if (grouping_) nccl_transport_->group_start();
    }
    return *nccl_transport_;
  }
#endif
  return *pg_transport_;
}

void Communicator::group_start() {
  TORCH_CHECK(!grouping_, "zerofuse.comm: group_start() inside an open group");
  grouping_ = true;
  pg_transport_->group_start();
  if (nccl_transport_) nccl_transport_->group_start();
}

void Communicator::group_end() {
  TORCH_CHECK(grouping_, "zerofuse.comm: group_end() without group_start()");
  grouping_ = false;
  pg_transport_->group_end();
  if (nccl_transport_) nccl_transport_->group_end();
}

int64_t Communicator::shard_numel(at::TensorList tensors) const {
  int64_t total = 0;
  for (const auto& t : tensors) total += t.numel();
  return ceil_shard(total);
}

std::string Communicator::label(const char* fn) {
  std::ostringstream s;
  s << fn << " #" << seq_++ << " on rank " << rank_ << " of " << world_size_ << " in " << group_;
  return s.str();
}

std::shared_ptr<Work> Communicator::watched(std::shared_ptr<Work> work) {
  work->set_failure(failure_);
  return work;
}

std::shared_ptr<Work> Communicator::reduce_scatter_coalesced(at::TensorList tensors, const at::Tensor& out_shard,
                                                             const std::string& op, std::optional<double> scale,
                                                             std::optional<at::ScalarType> reduce_dtype) {
  const char* fn = ".reduce_scatter_coalesced";
  const Reduce red = parse_reduce(op, fn);
  check_one_device(tensors, fn, &out_shard, "out_shard");
  int64_t total = 0;
  const auto offsets = packed_offsets(tensors, &total);
  const int64_t shard = ceil_shard(total);
  check_flat(out_shard, shard, fn, "out_shard");
  const at::ScalarType dtype = reduce_dtype.value_or(out_shard.scalar_type());
  if (total) check_reduce_dtype(red, scale, dtype, fn);
  const std::string what = label("reduce_scatter_coalesced");
  if (total == 0) return std::make_shared<DoneWork>(what, timeout_);
  failure_->check(what);  // [Note: communicator failure]
  Transport& transport = transport_for(out_shard.device(), fn);
  const ReducePlan plan = plan_reduce(red, transport, scale, world_size_, dtype);
  at::Tensor flat;
  if (is_whole_flat(tensors, shard * world_size_, dtype) && !out_shard.is_alias_of(tensors[0])) {
    flat = tensors[0].view({-1});  // already one flat buffer (e.g. ZeRO's): no copy; kept alive until done
  } else {
    flat = staging(shard * world_size_, out_shard.options().dtype(dtype));
    if (shard * world_size_ > total) flat.narrow(0, total, shard * world_size_ - total).zero_();
    flatten_into(tensors, flat, offsets);
  }
  scale_in_place(flat, plan.before);
  const double factor = plan.after;
  if (transport.reduce_scatter_via_all_reduce()) {
    auto work = watched(transport.all_reduce(flat, plan.op, what));
    const int64_t lo = rank_ * shard;
    work->set_finish([flat, out_shard, lo, shard, factor]() mutable {
      at::Tensor mine = flat.narrow(0, lo, shard);
      scale_in_place(mine, factor);
      out_shard.copy_(mine);
    });
    work->keep_alive({flat, out_shard});
    return work;
  }
  const bool direct = dtype == out_shard.scalar_type();
  at::Tensor out = direct ? out_shard : at::empty({shard}, flat.options());
  auto work = watched(transport.reduce_scatter(out, flat, plan.op, what));
  work->set_finish([out, out_shard, direct, factor]() mutable {
    scale_in_place(out, factor);
    if (!direct) out_shard.copy_(out);
  });
  work->keep_alive({flat, out, out_shard});
  return work;
}

std::shared_ptr<Work> Communicator::all_gather_coalesced(const at::Tensor& shard, at::TensorList tensors) {
  const char* fn = ".all_gather_coalesced";
  check_one_device(tensors, fn, &shard, "shard");
  int64_t total = 0;
  const auto offsets = packed_offsets(tensors, &total);
  const int64_t n = ceil_shard(total);
  check_flat(shard, n, fn, "shard");
  const std::string what = label("all_gather_coalesced");
  if (total == 0) return std::make_shared<DoneWork>(what, timeout_);
  failure_->check(what);  // [Note: communicator failure]
  Transport& transport = transport_for(shard.device(), fn);
  // The output is one flat buffer (a ZeRO unit's): gathered into directly, no copy-out. The shard
  // may be this rank's own slot of it (in place: gloo and NCCL both take that form).
  const bool in_place = shard.is_alias_of(tensors[0]) &&
                        static_cast<const char*>(shard.data_ptr()) ==
                            static_cast<const char*>(tensors[0].data_ptr()) + rank_ * n * shard.element_size();
  if (is_whole_flat(tensors, n * world_size_, shard.scalar_type()) && (in_place || !shard.is_alias_of(tensors[0]))) {
    // any shape: the transports slice rank slots off dim 0 of a 1-D view
    auto work = watched(transport.all_gather(tensors[0].view({-1}), shard, what));
    work->keep_alive({tensors[0], shard});
    return work;
  }
  at::Tensor flat = staging(n * world_size_, shard.options());
  auto work = watched(transport.all_gather(flat, shard, what));
  std::vector<at::Tensor> outs(tensors.begin(), tensors.end());
  work->set_finish([flat, outs, offsets]() { unflatten_from(flat, outs, offsets); });
  work->keep_alive({flat, shard});
  return work;
}

std::shared_ptr<Work> Communicator::all_reduce_coalesced(at::TensorList tensors, const std::string& op,
                                                         std::optional<double> scale,
                                                         std::optional<at::ScalarType> reduce_dtype) {
  const char* fn = ".all_reduce_coalesced";
  const Reduce red = parse_reduce(op, fn);
  check_one_device(tensors, fn, nullptr, nullptr);
  int64_t total = 0;
  const auto offsets = packed_offsets(tensors, &total);
  at::ScalarType dtype = tensors.empty() ? at::kFloat : tensors[0].scalar_type();
  for (const auto& t : tensors) dtype = c10::promoteTypes(dtype, t.scalar_type());
  dtype = reduce_dtype.value_or(dtype);
  if (total) check_reduce_dtype(red, scale, dtype, fn);
  const std::string what = label("all_reduce_coalesced");
  if (total == 0) return std::make_shared<DoneWork>(what, timeout_);
  failure_->check(what);  // [Note: communicator failure]
  Transport& transport = transport_for(tensors[0].device(), fn);
  const ReducePlan plan = plan_reduce(red, transport, scale, world_size_, dtype);
  // One contiguous tensor in the reduce dtype (a ZeRO stage-0 grad buffer, a TP activation) is
  // reduced in place: no copy in or out. Its contents are undefined until wait(), as with a
  // reduce-scatter of a whole flat buffer.
  const bool in_place = is_whole_flat(tensors, total, dtype);
  at::Tensor flat;
  if (in_place) {
    flat = tensors[0].detach().view({-1});  // detached: the scaling in wait() is not an autograd op
  } else {
    flat = staging(total, tensors[0].options().dtype(dtype));
    flatten_into(tensors, flat, offsets);
  }
  scale_in_place(flat, plan.before);
  const double factor = plan.after;
  auto work = watched(transport.all_reduce(flat, plan.op, what));
  std::vector<at::Tensor> outs;
  if (!in_place) outs.assign(tensors.begin(), tensors.end());
  work->set_finish([flat, outs, offsets, factor]() mutable {
    scale_in_place(flat, factor);
    if (!outs.empty()) unflatten_from(flat, outs, offsets);
  });
  work->keep_alive({flat});
  return work;
}

}  // namespace zerofuse::comm
