// Every C++ op schema of zerofuse, in one place. Backend files hold the TORCH_LIBRARY_IMPLs; fake
// (meta) impls and Python-side validation live in pyextension/ops/.
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

TORCH_LIBRARY(zerofuse, m) {
  // Bucket copy-in: tensors[i] (any shape and strides, cast to flat's dtype) is written, in
  // row-major order, to flat[offsets[i] : offsets[i] + tensors[i].numel()].
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) flat, int[] offsets) -> ()");
  // Bucket copy-out, the reverse: tensors[i] = flat[offsets[i] : ...].view(shape), cast.
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] tensors, int[] offsets) -> ()");
  // CPU kernels behind zerofuse::layer_norm / rms_norm (Python custom ops; CUDA runs Triton):
  // x, residual (M, N) contiguous fp32/fp16/bf16; returns (y, h or empty, mean or empty, rstd).
  m.def("norm_fwd_cpu(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, bool rms) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  // returns (dx, dweight or empty, dbias or empty); dh is added to dx.
  m.def("norm_bwd_cpu(Tensor dy, Tensor? dh, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd, bool rms) -> (Tensor, Tensor, Tensor)");
  // Optimizer steps over lists of tensors (the segments of a flat ZeRO shard are a list of views),
  // in place. masters: empty, or fp32 master weights the low-precision params are written from.
  // steps[i]: 1-element float tensor, the step count of params[i], advanced by 1 by the op (once per
  // distinct tensor; not when the step is skipped) before its bias corrections. grad_mult: (1,) tensor
  // the grads are multiplied by (1 / loss scale, times a clipping factor). found_inf: (1,) tensor,
  // nonzero skips the step (nothing changes). Math: the backend files and zerofuse.reference.
  m.def("adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] masters, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool decoupled, bool maximize, Tensor? grad_mult, Tensor? found_inf) -> ()");
  // LAMB in one call (both stages; the CPU kernel blocks them for the cache).
  m.def("lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] masters, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool bias_correction, int trust_mode, float min_trust, float max_trust, Tensor? grad_mult, "
        "Tensor? found_inf) -> ()");
  // LAMB stage 1 (advances steps): moments, and per-tensor (sum p^2, sum u^2) into norms (n, 2) fp32.
  m.def("lamb_stage1_(Tensor[] params, Tensor[] grads, Tensor(a!)[] exp_avgs, Tensor(b!)[] exp_avg_sqs, "
        "Tensor[] masters, Tensor(d!)[] steps, float beta1, float beta2, float eps, float weight_decay, "
        "bool bias_correction, Tensor? grad_mult, Tensor? found_inf, Tensor(c!) norms) -> ()");
  // LAMB stage 2: p -= lr * trust(norms) * u; trust_mode 0 = paper (clamped |p|), 1 = nvlamb.
  m.def("lamb_stage2_(Tensor(a!)[] params, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, Tensor(b!)[] masters, "
        "Tensor[] steps, Tensor norms, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool bias_correction, int trust_mode, float min_trust, float max_trust, Tensor? found_inf) -> ()");
  // LARS with momentum; norms (2n,) fp32: |p_i| then |grad_i * grad_mult| (from l2norm with mult).
  m.def("lars_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] momentum_buffers, Tensor(c!)[] masters, "
        "Tensor norms, float lr, float momentum, float weight_decay, float trust_coefficient, float eps, "
        "Tensor? grad_mult, Tensor? found_inf) -> ()");
  // 2-norm of all tensors together (0-dim fp32) and, with per_tensor, of each ((n,) fp32; else (0,));
  // mult (1 element): tensors[mult_from:] multiplied by it before they are squared (unscaled norms of
  // loss-scaled grads without the squares' fp32 overflow).
  m.def("l2norm(Tensor[] tensors, bool per_tensor, Tensor? mult=None, int mult_from=0) -> (Tensor, Tensor)");
}

// The ops that write their (a!) arguments bump those tensors' version counters, as torch's
// in-place ops do, so autograd still refuses a backward through a tensor changed after it was
// saved (the dispatcher's default autograd fallback redispatches past ADInplaceOrView, and torch's
// autogradNotImplementedInplaceOrViewFallback bumps no Tensor[] argument: unflatten_from into a
// saved activation gave a silently wrong gradient, and zero/grads.py's check of .grad's version
// missed a write). Autograd: straight on to ADInplaceOrView (no outputs, nothing to record).
// The Python launches of the same kernels bump the versions themselves (ops/_optim.py: mutated).
namespace {
void to_inplace_or_view(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

void bump_written(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack->size() - args.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite()) continue;
    const c10::IValue& v = (*stack)[first + i];
    if (v.isTensor()) {
      written.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) written.push_back(t);
    }
  }
  op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  for (const at::Tensor& t : written) {
    if (t.defined()) torch::autograd::impl::bump_version(t);
  }
}

constexpr const char* kWritingOps[] = {"flatten_into", "unflatten_from", "adam_", "lamb_", "lamb_stage1_",
                                       "lamb_stage2_", "lars_"};
}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, Autograd, m) {
  for (const char* op : kWritingOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&to_inplace_or_view>());
}

TORCH_LIBRARY_IMPL(zerofuse, ADInplaceOrView, m) {
  for (const char* op : kWritingOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&bump_written>());
}
