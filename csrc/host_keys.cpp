// launch_key and signature: see host_keys.h.
#include "host_keys.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace py = pybind11;

namespace zerofuse {

// [Note: launch handles] (kernels/launch.py): what Triton 3.6's specialization of each launch
// argument depends on, two bytes per argument: None (0, 0); bool (1, value); float (2, 0); int (3,
// range class i32/i64/u64 << 2 | (== 1) << 1 | (multiple of 16)); tensor (4 + (address multiple of
// 16), scalar type). Anything else raises TypeError (the caller launches through the JIT).
py::bytes launch_key(const py::tuple& args) {
  std::string key(2 * args.size(), '\0');
  for (size_t i = 0; i < args.size(); ++i) {
    PyObject* a = args[i].ptr();
    char kind = 0, value = 0;
    if (a == Py_None) {
    } else if (PyBool_Check(a)) {
      kind = 1, value = a == Py_True;
    } else if (PyFloat_CheckExact(a)) {
      kind = 2;
    } else if (PyLong_CheckExact(a)) {
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
      unsigned long long bits = static_cast<unsigned long long>(v);
      int range = v >= INT32_MIN && v <= INT32_MAX ? 0 : 1;
      if (overflow != 0) {
        bits = overflow > 0 ? PyLong_AsUnsignedLongLong(a) : 0;
        if (overflow < 0 || PyErr_Occurred()) {
          PyErr_Clear();
          throw py::type_error("launch_key: an int outside the 64-bit ranges");
        }
        range = 2;
      }
      kind = 3, value = static_cast<char>(range << 2 | (overflow == 0 && v == 1) << 1 | ((bits & 15) == 0));
    } else if (THPVariable_Check(a)) {
      const at::Tensor& t = THPVariable_Unpack(a);
      kind = static_cast<char>(4 + ((reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0));
      value = static_cast<char>(t.scalar_type());
    } else {
      throw py::type_error(std::string("launch_key: an argument of type ") + Py_TYPE(a)->tp_name);
    }
    key[2 * i] = kind, key[2 * i + 1] = value;
  }
  return py::bytes(key);
}

namespace {

template <typename T>
void put(std::string& key, T v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// One argument's bytes; false where the argument has no signature (the caller takes its slow path).
bool put_arg(std::string& key, PyObject* a) {
  if (a == Py_None) {
    key.push_back('N');
  } else if (PyBool_Check(a)) {
    key.push_back(a == Py_True ? 'T' : 'F');
  } else if (PyLong_CheckExact(a)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (overflow != 0) return false;
    key.push_back('i');
    put(key, v);
  } else if (PyFloat_CheckExact(a)) {
    key.push_back('f');
    put(key, PyFloat_AS_DOUBLE(a));
  } else if (PyTuple_Check(a) || PyList_Check(a)) {  // of ints (torch.Size too)
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    PyObject** items = PySequence_Fast_ITEMS(a);
    key.push_back('(');
    put(key, static_cast<int64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_CheckExact(items[i])) return false;
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
      if (overflow != 0) return false;
      put(key, v);
    }
  } else if (THPVariable_CheckTypeExact(Py_TYPE(a))) {  // a Tensor or a Parameter, no other subclass
    const at::Tensor& t = THPVariable_Unpack(a);
    // (nested tensors are strided but have no sizes: their sizes() throws)
    if (t.layout() != at::kStrided || t.is_nested() || t.is_conj() || t.is_neg()) return false;
    const at::Device d = t.device();
    key.push_back('t');
    put(key, static_cast<int8_t>(t.scalar_type()));
    put(key, static_cast<int8_t>(d.type()));
    put(key, static_cast<int8_t>(d.index()));
    put(key, static_cast<int8_t>(t.requires_grad()));
    put(key, static_cast<int64_t>(t.dim()));  // (all 8 bytes: where the sizes end is part of the key)
    for (const int64_t s : t.sizes()) put(key, s);
    for (const int64_t s : t.strides()) put(key, s);
  } else {
    return false;
  }
  return true;
}

}  // namespace

// [Note: call signatures] (zerofuse/ops/signatures.py): bytes that differ whenever a face's checks
// or path choices could: grad mode; per argument None, a bool's value, an int's or float's value,
// a tuple or list of ints (values), or a tensor's dtype, device, requires_grad, sizes and strides.
// None (no signature: take the slow path) for anything else, for a tensor subclass other than
// Parameter, a non-strided, conjugate or negative-bit tensor, and while a TorchFunctionMode is on.
namespace {

// METH_FASTCALL, no pybind11 argument handling: ~0.3 us of a ~0.7 us call through py::args. No
// C++ exception may leave it (a raw C function): any one means no signature, the slow path, which
// raises what it should.
PyObject* signature_fast(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (at::impl::torch_function_mode_enabled()) Py_RETURN_NONE;
    std::string key;
    key.reserve(160);
    key.push_back(at::GradMode::is_enabled() ? 'G' : 'g');
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      if (!put_arg(key, args[i])) Py_RETURN_NONE;
    }
    return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
  } catch (...) {
    Py_RETURN_NONE;
  }
}

PyMethodDef signature_def = {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&signature_fast)),
                             METH_FASTCALL, "[Note: call signatures] (zerofuse/ops/signatures.py)"};

}  // namespace

py::object signature_function() {
  PyObject* f = PyCFunction_New(&signature_def, nullptr);
  if (f == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(f);
}

}  // namespace zerofuse
