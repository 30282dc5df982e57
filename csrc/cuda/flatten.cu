// CUDA kernels of zerofuse::flatten_into / unflatten_from: one multi-tensor launch per call.
//
// The host writes one TensorMeta per tensor (pointer, numel, offset into flat, dtype, first chunk),
// finds that table on the device or copies it there once ([Note: device tables kept by content]),
// and launches one block per kChunk-element chunk of all tensors together; a block finds its
// tensor by binary search over the chunk prefix. Same-dtype chunks move 16 bytes per thread per access when aligned; others
// convert element by element (e.g. bf16 grads into an fp32 bucket). Tensors the kernel does not
// take (non-contiguous, or dtypes other than fp32/fp16/bf16/fp64) go through Tensor::copy_,
// correct but one launch each.
#include "../flatten.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace zerofuse {
namespace {

constexpr int64_t kChunk = 16384;
constexpr int kThreads = 256;

enum DType : int64_t { kF32 = 0, kF16 = 1, kBF16 = 2, kF64 = 3 };

struct TensorMeta {
  int64_t ptr;
  int64_t numel;
  int64_t offset;       // element offset into flat
  int64_t dtype;        // DType
  int64_t chunk_begin;  // index of this tensor's first chunk among all chunks
};
static_assert(sizeof(TensorMeta) == 5 * sizeof(int64_t), "TensorMeta is shipped as int64 words");

int64_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kDouble: return kF64;
    default: return -1;
  }
}

template <typename T, typename F, bool kToFlat>
__device__ void copy_chunk(T* t, F* f, int64_t begin, int64_t end) {
  if constexpr (sizeof(T) == sizeof(F) && std::is_same_v<T, F>) {
    // 16-byte vector path when both sides of this chunk are aligned.
    constexpr int64_t kVec = 16 / sizeof(T);
    const bool aligned = ((reinterpret_cast<uintptr_t>(t + begin) | reinterpret_cast<uintptr_t>(f + begin)) % 16) == 0;
    if (aligned) {
      const int64_t n_vec = (end - begin) / kVec;
      const int4* src = reinterpret_cast<const int4*>(kToFlat ? t + begin : f + begin);
      int4* dst = reinterpret_cast<int4*>(kToFlat ? f + begin : t + begin);
      for (int64_t v = threadIdx.x; v < n_vec; v += blockDim.x) dst[v] = src[v];
      begin += n_vec * kVec;
    }
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    if constexpr (kToFlat) f[i] = c10::convert<F>(t[i]);
    else t[i] = c10::convert<T>(f[i]);
  }
}

template <typename F, bool kToFlat>
__global__ void __launch_bounds__(kThreads) multi_tensor_copy_kernel(const TensorMeta* __restrict__ meta,
                                                                    int64_t n_tensors, F* flat) {
  const int64_t chunk = blockIdx.x;
  int64_t lo = 0, hi = n_tensors - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (meta[mid].chunk_begin <= chunk) lo = mid;
    else hi = mid - 1;
  }
  const TensorMeta m = meta[lo];
  const int64_t begin = (chunk - m.chunk_begin) * kChunk;
  const int64_t end = begin + kChunk < m.numel ? begin + kChunk : m.numel;
  F* f = flat + m.offset;
  switch (m.dtype) {
    case kF32: copy_chunk<float, F, kToFlat>(reinterpret_cast<float*>(m.ptr), f, begin, end); break;
    case kF16: copy_chunk<at::Half, F, kToFlat>(reinterpret_cast<at::Half*>(m.ptr), f, begin, end); break;
    case kBF16: copy_chunk<at::BFloat16, F, kToFlat>(reinterpret_cast<at::BFloat16*>(m.ptr), f, begin, end); break;
    case kF64: copy_chunk<double, F, kToFlat>(reinterpret_cast<double*>(m.ptr), f, begin, end); break;
  }
}

// [Note: device tables kept by content]
// A call's TensorMeta table reaches the device once per distinct content (the tensors' addresses,
// sizes, offsets and dtypes: ZeRO flattens the same grads into the same bucket every step), and
// stays there: eagerly, one pinned allocation and host-to-device copy per content instead of per
// call. Under CUDA-graph capture no host memory is touched: a table made while capturing (the
// grads autograd allocates in the graph's pool have addresses the warm-up never saw) is written by
// kernels that carry it in their parameters (kMetasPerWrite entries each, 2560 bytes of the 4 KB a
// launch may pass), which the graph keeps by value, so a replay needs no host buffer alive and no
// pinned allocation (with its event queries) ran inside the capture. A table a graph reads is never
// dropped (a handful per graph); the others are kept for the kKept most recent contents. The key
// holds every byte the kernel reads, so a hit is the same table. A table read from a stream other
// than the one it was made on is marked in use by that stream (record_stream), so dropping it later
// waits for that stream's work.
struct DeviceTable {
  at::Tensor device;  // the table the kernel reads
  cudaStream_t made_on;
  bool captured;
};

constexpr size_t kKept = 256;
constexpr int64_t kMetasPerWrite = 64;

struct MetaBatch {
  TensorMeta m[kMetasPerWrite];
};

__global__ void write_table_kernel(MetaBatch batch, int64_t n, TensorMeta* out) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = batch.m[i];
}

at::Tensor table_on_device(const std::vector<TensorMeta>& metas, const at::Device& device, cudaStream_t stream,
                           bool capturing) {
  const int64_t words = static_cast<int64_t>(metas.size() * sizeof(TensorMeta) / sizeof(int64_t));
  if (!capturing) {
    at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    std::memcpy(host.data_ptr(), metas.data(), metas.size() * sizeof(TensorMeta));
    return host.to(device, /*non_blocking=*/true);  // the host allocator keeps host until the copy is done
  }
  at::Tensor dev = at::empty({words}, at::TensorOptions().dtype(at::kLong).device(device));
  auto* out = reinterpret_cast<TensorMeta*>(dev.data_ptr<int64_t>());
  for (size_t first = 0; first < metas.size(); first += kMetasPerWrite) {
    MetaBatch batch{};
    const int64_t n = std::min<int64_t>(kMetasPerWrite, static_cast<int64_t>(metas.size() - first));
    std::memcpy(batch.m, metas.data() + first, n * sizeof(TensorMeta));
    write_table_kernel<<<1, kMetasPerWrite, 0, stream>>>(batch, n, out + first);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return dev;
}

const TensorMeta* device_table(const std::vector<TensorMeta>& metas, const at::Device& device, cudaStream_t stream) {
  static std::mutex mu;
  static std::unordered_map<std::string, DeviceTable> tables;
  static std::deque<std::string> uncaptured;  // the droppable keys, oldest first
  std::string key(reinterpret_cast<const char*>(metas.data()), metas.size() * sizeof(TensorMeta));
  const int idx = device.index();
  key.append(reinterpret_cast<const char*>(&idx), sizeof(idx));
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  std::lock_guard<std::mutex> lock(mu);
  auto it = tables.find(key);
  if (it == tables.end()) {
    it = tables.emplace(key, DeviceTable{table_on_device(metas, device, stream, capturing), stream, capturing}).first;
    if (!capturing) uncaptured.push_back(key);
  } else if (it->second.made_on != stream) {
    it->second.device.record_stream(c10::cuda::getCurrentCUDAStream(device.index()));
  }
  it->second.captured = it->second.captured || capturing;
  const TensorMeta* table = reinterpret_cast<const TensorMeta*>(it->second.device.data_ptr<int64_t>());
  while (uncaptured.size() > kKept) {  // drop the oldest table no graph reads
    auto old = tables.find(uncaptured.front());
    if (old != tables.end() && !old->second.captured) tables.erase(old);
    uncaptured.pop_front();
  }
  return table;
}

template <bool kToFlat>
void copy_ranges(at::TensorList tensors, const at::Tensor& flat, at::IntArrayRef offsets) {
  at::AutoDispatchBelowADInplaceOrView no_autograd;
  c10::cuda::CUDAGuard guard(flat.device());
  const bool flat_in_kernel = dtype_code(flat.scalar_type()) >= 0;
  std::vector<TensorMeta> metas;
  std::vector<size_t> fallback;
  int64_t n_chunks = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    const int64_t code = dtype_code(t.scalar_type());
    if (!flat_in_kernel || code < 0 || !t.is_contiguous()) {
      fallback.push_back(i);
      continue;
    }
    metas.push_back({reinterpret_cast<int64_t>(t.data_ptr()), t.numel(), offsets[i], code, n_chunks});
    n_chunks += (t.numel() + kChunk - 1) / kChunk;
  }

  if (!metas.empty()) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(flat.get_device()).stream();
    const TensorMeta* meta = device_table(metas, flat.device(), stream);  // [Note: device tables kept by content]
    const int64_t n = static_cast<int64_t>(metas.size());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "zerofuse_multi_tensor_copy", [&] {
      multi_tensor_copy_kernel<scalar_t, kToFlat>
          <<<static_cast<unsigned>(n_chunks), kThreads, 0, stream>>>(meta, n, flat.data_ptr<scalar_t>());
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  copy_ranges_with_aten(tensors, flat, offsets, fallback, kToFlat);
}

void flatten_into_cuda(at::TensorList tensors,  // n tensors, any shapes/strides/dtypes, on flat's device
                       const at::Tensor& flat,  // (N,) contiguous, written
                       at::IntArrayRef offsets  // (n,) element offsets into flat
) {
  check_flatten_args(tensors, flat, offsets, "flatten_into", "tensors");
  copy_ranges<true>(tensors, flat, offsets);
}

void unflatten_from_cuda(const at::Tensor& flat,  // (N,) contiguous, read
                         at::TensorList tensors,  // n tensors, any shapes/strides/dtypes, written
                         at::IntArrayRef offsets  // (n,) element offsets into flat
) {
  check_flatten_args(tensors, flat, offsets, "unflatten_from", "tensors");
  check_outputs_disjoint(tensors, "unflatten_from", "tensors");
  copy_ranges<false>(tensors, flat, offsets);
}

}  // namespace

TORCH_LIBRARY_IMPL(zerofuse, CUDA, m) {
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_from", &unflatten_from_cuda);
}

}  // namespace zerofuse
