// Keys the Python launch paths compute per call, in C++ (the same in Python costs microseconds):
// launch_key ([Note: launch handles], kernels/launch.py) and signature ([Note: call signatures],
// zerofuse/ops/signatures.py).
#pragma once

#include <torch/extension.h>

namespace zerofuse {

pybind11::bytes launch_key(const pybind11::tuple& args);
pybind11::object signature_function();  // the builtin zerofuse._C.signature(*args) -> bytes | None

}  // namespace zerofuse
