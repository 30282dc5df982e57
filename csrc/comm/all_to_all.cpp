// Communicator::all_to_all (communicator.h): rows to every rank with per-rank counts, e.g. MoE's
// token dispatch and combine. Checks here, transfers in the transports.
#include "communicator.h"

#include "../checks.h"

#include <numeric>

namespace zerofuse::comm {

std::shared_ptr<Work> Communicator::all_to_all(const at::Tensor& out, const at::Tensor& in,
                                               const std::vector<int64_t>& out_splits,
                                               const std::vector<int64_t>& in_splits) {
  const char* fn = ".all_to_all";
  for (const auto* splits : {&out_splits, &in_splits}) {
    const char* name = splits == &out_splits ? "out_splits" : "in_splits";
    ZF_COMM_CHECK_VALUE(static_cast<int>(splits->size()) == world_size_, fn, "expected ", name, " to hold ",
                   world_size_, " row counts (one per rank), got ", splits->size());
    for (int64_t n : *splits) ZF_COMM_CHECK_VALUE(n >= 0, fn, "expected ", name, " >= 0, got ", *splits);
  }
  ZF_COMM_CHECK(in.is_contiguous() && out.is_contiguous(), fn, "expected contiguous input and out");
  ZF_COMM_CHECK(in.device() == out.device() && in.scalar_type() == out.scalar_type(), fn,
           "expected out on input's device with its dtype (", in.device(), ", ", in.scalar_type(), "), got ",
           out.device(), ", ", out.scalar_type());
  ZF_COMM_CHECK(in.dim() >= 1 && out.dim() == in.dim() && in.sizes().slice(1) == out.sizes().slice(1), fn,
           "expected input and out of one row shape, got ", in.sizes(), " and ", out.sizes());
  const int64_t sent = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
  const int64_t got = std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
  ZF_COMM_CHECK_VALUE(sent == in.size(0), fn, "expected in_splits to sum to input's ", in.size(0),
                 " rows, got ", in_splits);
  ZF_COMM_CHECK_VALUE(got == out.size(0), fn, "expected out_splits to sum to out's ", out.size(0), " rows, got ",
                 out_splits);
  const std::string what = label("all_to_all");
  failure_->check(what);  // [Note: communicator failure]
  Transport& transport = transport_for(in.device(), fn);
  auto work = watched(transport.all_to_all(out, in, out_splits, in_splits, what));
  work->keep_alive({out, in});
  return work;
}

}  // namespace zerofuse::comm
