// The zerofuse._C Python module. Importing it runs the TORCH_LIBRARY registrations; ops are
// reached through torch.ops.zerofuse (no pybind bindings for ops). build_info() tells the doctor
// what this build contains.
#include <Python.h>

#ifdef ZEROFUSE_WITH_NCCL
#include "comm/nccl_info.h"
#endif

namespace {

PyObject* build_info(PyObject*, PyObject*) {
#ifdef ZEROFUSE_WITH_CUDA
  PyObject* cuda = Py_True;
#else
  PyObject* cuda = Py_False;
#endif
#ifdef ZEROFUSE_WITH_NCCL
  PyObject* nccl = Py_True;
  const long nccl_compiled = zerofuse::nccl_compiled_version();
  const long nccl_runtime = zerofuse::nccl_runtime_version();
#else
  PyObject* nccl = Py_False;
  const long nccl_compiled = 0;
  const long nccl_runtime = 0;
#endif
  return Py_BuildValue("{s:O,s:O,s:l,s:l}", "cuda", cuda, "nccl", nccl, "nccl_compiled_version",
                       nccl_compiled, "nccl_runtime_version", nccl_runtime);
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "Backends compiled into this build of zerofuse._C."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
