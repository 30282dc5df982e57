// The zerofuse._C Python module. Importing it runs the TORCH_LIBRARY registrations; ops are
// reached through torch.ops.zerofuse (no pybind bindings for ops). Bound here: build_info() (what
// this build contains, for the doctor), the Communicator (csrc/comm/), whose Python face is
// zerofuse.comm, and the CPU memory counter (memory_counter.h) behind zerofuse.zero.peak_memory.
#include <torch/extension.h>

#include <cmath>

#include "comm/communicator.h"
#include "cpu/vector_isa.h"
#include "host_keys.h"
#include "memory_counter.h"
#ifdef ZEROFUSE_WITH_NCCL
#include "comm/nccl_info.h"
#endif

namespace py = pybind11;
using zerofuse::comm::Communicator;
using zerofuse::comm::Work;

namespace {

py::dict build_info() {
  py::dict d;
#ifdef ZEROFUSE_WITH_CUDA
  d["cuda"] = true;
#else
  d["cuda"] = false;
#endif
#ifdef ZEROFUSE_WITH_NCCL
  d["nccl"] = true;
  d["nccl_compiled_version"] = zerofuse::nccl_compiled_version();
  d["nccl_runtime_version"] = zerofuse::nccl_runtime_version();
#else
  d["nccl"] = false;
  d["nccl_compiled_version"] = 0;
  d["nccl_runtime_version"] = 0;
#endif
  return d;
}

// [Note: no GIL in the communicator's destructor] The last reference to a Communicator is usually
// dropped by Python, with the GIL held, and its destructor joins the transport's threads (the gloo
// p2p poster, the delayed-launch chain of tests, the NCCL watchdog). Those threads drop tensors,
// and dropping the last reference to a tensor that Python has let go of takes the GIL: joined with
// the GIL held, they wait for it forever (CI 2026-11-26: a pipeline rank hung at the end of its
// run, its main thread in the destructor, one thread with no Python frame). As torch's c10d
// bindings do for their process groups, the destructor runs with the GIL released.
struct DeleteWithoutGil {
  void operator()(Communicator* c) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete c;
    } else {
      delete c;
    }
  }
};

std::shared_ptr<Communicator> make_communicator(c10::intrusive_ptr<c10d::ProcessGroup> pg,
                                                c10::intrusive_ptr<c10d::Store> store, const std::string& transport,
                                                const std::string& key, double timeout_s, double debug_delay_ms) {
  py::gil_scoped_release nogil;
  return std::shared_ptr<Communicator>(
      new Communicator(std::move(pg), std::move(store), transport, key, timeout_s, debug_delay_ms),
      DeleteWithoutGil());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.def("build_info", &build_info, "Backends compiled into this build of zerofuse._C.");
  m.def("cpu_memory_counter_install", &zerofuse::cpu_memory_counter_install, py::arg("on"));
  m.def("cpu_memory_counter_installed", &zerofuse::cpu_memory_counter_installed);
  m.def("cpu_memory_counter_current", &zerofuse::cpu_memory_counter_current);
  m.def("cpu_memory_counter_peak", &zerofuse::cpu_memory_counter_peak);
  m.def("cpu_memory_counter_reset_peak", &zerofuse::cpu_memory_counter_reset_peak);
  m.def("cpu_memory_counter_begin", &zerofuse::cpu_memory_counter_begin);
  m.def("cpu_memory_counter_end", &zerofuse::cpu_memory_counter_end, py::arg("previous"));
  // csrc/cpu/vector_isa.h: 2 AVX-512, 1 AVX2, 0 baseline (the CPU kernels' loops in use)
  m.def("cpu_vector_isa", &zerofuse::vector_isa);
  m.def("launch_key", &zerofuse::launch_key, py::arg("args"));
  m.attr("signature") = zerofuse::signature_function();

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def("wait", &Work::wait, py::call_guard<py::gil_scoped_release>(),
           "CPU: block until the collective is done (bounded by the communicator's timeout); CUDA: make the "
           "current stream wait for it. Then copy the result out (once).")
      .def("wait_within",
           [](Work& w, double seconds) {
             w.wait_within(std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0))));
           },
           py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
           "wait(), bounded by `seconds` where that is below the communicator's timeout (the ProcessGroup "
           "transport; past it the communicator fails)")
      .def("is_completed", &Work::is_completed)
      .def_property_readonly("what", &Work::what);

  using Tensors = std::vector<at::Tensor>;
  py::class_<Communicator, std::shared_ptr<Communicator>>(m, "_Communicator")
      .def(py::init(&make_communicator), py::arg("group"), py::arg("store"), py::arg("transport"), py::arg("key"),
           py::arg("timeout_s"), py::arg("debug_delay_ms"))
      .def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("world_size", &Communicator::world_size)
      .def_property_readonly("transport", &Communicator::transport_name)
      .def_property_readonly("sequence", &Communicator::sequence)
      .def("group_start", &Communicator::group_start)
      .def("group_end", &Communicator::group_end, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("staging_bytes", &Communicator::staging_bytes)
      .def("free_staging", &Communicator::free_staging)
      .def("shard_numel", [](const Communicator& c, const Tensors& ts) { return c.shard_numel(ts); })
      .def(
          "reduce_scatter_coalesced",
          [](Communicator& c, const Tensors& ts, const at::Tensor& out, const std::string& op,
             std::optional<double> scale, std::optional<at::ScalarType> reduce_dtype) {
            return c.reduce_scatter_coalesced(ts, out, op, scale, reduce_dtype);
          },
          py::arg("tensors"), py::arg("out_shard"), py::arg("op"), py::arg("scale"), py::arg("reduce_dtype"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "all_gather_coalesced",
          [](Communicator& c, const at::Tensor& shard, const Tensors& ts) { return c.all_gather_coalesced(shard, ts); },
          py::arg("shard"), py::arg("tensors"), py::call_guard<py::gil_scoped_release>())
      .def(
          "all_reduce_coalesced",
          [](Communicator& c, const Tensors& ts, const std::string& op, std::optional<double> scale,
             std::optional<at::ScalarType> reduce_dtype) { return c.all_reduce_coalesced(ts, op, scale, reduce_dtype); },
          py::arg("tensors"), py::arg("op"), py::arg("scale"), py::arg("reduce_dtype"),
          py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("p2p_sequence", &Communicator::p2p_sequence)
      .def("fail", &Communicator::fail, py::arg("message"))
      .def("check_usable", &Communicator::check_usable, py::arg("what"))
      .def("wait_launched", &Communicator::wait_launched, py::call_guard<py::gil_scoped_release>())
      .def(
          "batch_p2p",
          [](Communicator& c, const std::vector<std::tuple<bool, at::Tensor, int, int>>& ops) {
            std::vector<zerofuse::comm::P2POp> list;
            for (const auto& [send, tensor, peer, tag] : ops) list.push_back({send, tensor, peer, tag});
            return c.batch_p2p(list);
          },
          py::arg("ops"), py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Communicator::all_to_all, py::arg("out"), py::arg("input"), py::arg("out_splits"),
           py::arg("in_splits"), py::call_guard<py::gil_scoped_release>());
}
