// Every C++ op schema of zerofuse, in one place. Backend files hold the TORCH_LIBRARY_IMPLs; fake
// (meta) impls and Python-side validation live in pyextension/ops/.
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
  // Adam / AdamW step over lists of tensors (a flat ZeRO shard is a list of one), in place.
  // masters: empty, or fp32 master weights the low-precision params are written from.
  // found_inf: when nonzero the step is skipped (no state changes).
  m.def("adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] masters, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "float bias_correction1, float bias_correction2, bool decoupled, bool maximize, float inv_grad_scale, "
        "Tensor? found_inf) -> ()");
}
