// Every C++ op schema of zerofuse, in one place. Backend files hold the TORCH_LIBRARY_IMPLs; fake
// (meta) impls and Python-side validation live in pyextension/ops/.
#include <torch/library.h>

TORCH_LIBRARY(zerofuse, m) {
  // Bucket copy-in: tensors[i] (any shape and strides, cast to flat's dtype) is written, in
  // row-major order, to flat[offsets[i] : offsets[i] + tensors[i].numel()].
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) flat, int[] offsets) -> ()");
  // Bucket copy-out, the reverse: tensors[i] = flat[offsets[i] : ...].view(shape), cast.
  m.def("unflatten_from(Tensor flat, Tensor(a!)[] tensors, int[] offsets) -> ()");
}
