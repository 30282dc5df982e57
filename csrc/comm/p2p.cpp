// Communicator::batch_p2p (communicator.h): point-to-point sends and receives posted together, the
// transfers between pipeline stages. Checks here, transfers in the transports.
#include "communicator.h"

#include "../checks.h"

#include <sstream>

namespace zerofuse::comm {

std::shared_ptr<Work> Communicator::batch_p2p(const std::vector<P2POp>& ops) {
  const char* fn = ".batch_p2p";
  std::ostringstream label;
  label << "batch_p2p #" << p2p_seq_++ << " on rank " << rank_ << " of " << world_size_ << " in " << group_ << " (";
  for (size_t i = 0; i < ops.size(); ++i) {
    const P2POp& op = ops[i];
    const std::string name = std::string("ops[") + std::to_string(i) + "]";
    ZF_COMM_CHECK_VALUE(op.peer >= 0 && op.peer < world_size_, fn, "expected ", name,
                   ".peer to be a rank of the group (0 <= peer < ", world_size_, "), got ", op.peer);
    ZF_COMM_CHECK_VALUE(op.peer != rank_, fn, "expected ", name, ".peer to be another rank than this one (",
                   rank_, "), got ", op.peer);
    ZF_COMM_CHECK(op.tensor.is_contiguous(), fn, "expected ", name, ".tensor to be contiguous, got strides ",
             op.tensor.strides(), " for shape ", op.tensor.sizes());
    ZF_COMM_CHECK(op.tensor.device() == ops[0].tensor.device(), fn, "expected ", name, ".tensor on ",
             ops[0].tensor.device(), " like ops[0].tensor, got ", op.tensor.device());
    ZF_COMM_CHECK_VALUE(op.tag >= 0, fn, "expected ", name, ".tag >= 0, got ", op.tag);
    label << (i ? ", " : "") << (op.send ? "send " : "recv ") << op.tensor.sizes() << ":" << op.tensor.scalar_type()
          << (op.send ? " to " : " from ") << op.peer;
  }
  label << ")";
  const std::string what = label.str();
  if (ops.empty()) return std::make_shared<DoneWork>(what, timeout_);
  failure_->check(what);  // [Note: communicator failure]
  Transport& transport = transport_for(ops[0].tensor.device(), fn);
  auto work = watched(transport.p2p(ops, what));
  std::vector<at::Tensor> keep;
  for (const auto& op : ops) keep.push_back(op.tensor);
  work->keep_alive(std::move(keep));
  return work;
}

}  // namespace zerofuse::comm
