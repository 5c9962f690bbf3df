// The eager hot path of a planned call, in C++ (commfuse/kernels/native.py builds and loads it).
//
// Per call signature Python settles everything once: the checks, the route and its LaunchPlan (the
// kernels, their launch shapes and parameter bytes with every field but the pointers filled in,
// commfuse/kernels/launch.py). What is left per call is here: the operands' pointers (copies of
// strided or misaligned ones), the outputs the caller did not give, the pointers patched into the
// bytes, then NCCL's all-reduce and/or the kernels on torch's current stream (Launcher); and the plan
// table that finds a signature's launcher without Python (Table; commfuse/kernels/table.py describes
// its interface and the signature). In Python those steps cost tens of microseconds (tensor objects,
// the driver binding's argument conversion); here a few, most of it the driver's own.
#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/core/grad_mode.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

namespace py = pybind11;

namespace {

// Where a patched pointer comes from: a call argument (a MoE call's y is kX, its routing weights kZ), an
// output, or the NCCL route's sum buffer (commfuse/kernels/launch.py numbers them alike; native.py checks
// that the two agree).
enum Source : int {
  kX = 0, kResidual = 1, kWeight = 2, kScale = 3, kZ = 4, kRowIndex = 5, kShared = 6, kOut0 = 7, kSum = 12,
  kSources = 13
};
const char* const kInputNames[kOut0] = {"x", "residual", "weight", "scale", "z", "row_index", "shared"};
const char* const kMoeInputNames[kOut0] = {"y", "residual", "weight", "scale", "weights", "row_index", "shared"};
constexpr int kOutputs = 5;  // residual, norm, quant, scale_factors, scales (a plain all-reduce: 1)
constexpr size_t kMaxParams = 1024;
constexpr size_t kMaxEntries = 4096;  // then a table is cleared (commfuse/kernels/table.py's MAX_ENTRIES)
const char* const kOutNames[kOutputs] = {"residual", "norm", "quant", "scale_factors", "scales"};
// The NCCL watchdog's words (commfuse/nccl.py: DONE, ISSUED, ABORTED, BEGUN, ENDED, STAMPS, RING; native.py
// checks them), and the code a launcher throws for a communicator the watchdog aborted (TIMED_OUT).
enum Progress : int { kDone = 0, kIssued = 1, kAborted = 2, kBegun = 3, kEnded = 4, kStamps = 8, kRing = 4096 };
constexpr int kTimedOut = -1;

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);
using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using IsCapturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);
using MemcpyAsync = CUresult (*)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
using AllReduce = int (*)(const void*, void*, size_t, int, int, void*, void*);

// The driver entry points, from the libcuda torch has loaded already.
struct Driver {
  LaunchEx launch_ex = nullptr;
  ErrorString error_string = nullptr;
  WriteValue64 write_value64 = nullptr;
  IsCapturing is_capturing = nullptr;
  MemcpyAsync memcpy_async = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) throw std::runtime_error(std::string("commfuse host launch: ") + dlerror());
    launch_ex = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    error_string = reinterpret_cast<ErrorString>(dlsym(lib, "cuGetErrorString"));
    // CUDA 12's cuda.h maps cuStreamWriteValue64 to its _v2; older drivers export the first name only.
    write_value64 = reinterpret_cast<WriteValue64>(dlsym(lib, "cuStreamWriteValue64_v2"));
    if (write_value64 == nullptr) write_value64 = reinterpret_cast<WriteValue64>(dlsym(lib, "cuStreamWriteValue64"));
    is_capturing = reinterpret_cast<IsCapturing>(dlsym(lib, "cuStreamIsCapturing"));
    memcpy_async = reinterpret_cast<MemcpyAsync>(dlsym(lib, "cuMemcpyAsync"));
    if (launch_ex == nullptr || error_string == nullptr || write_value64 == nullptr || is_capturing == nullptr ||
        memcpy_async == nullptr)
      throw std::runtime_error("commfuse host launch: libcuda lacks cuLaunchKernelEx, cuStreamWriteValue64, "
                               "cuStreamIsCapturing or cuMemcpyAsync");
  }
};

const Driver& driver() {
  static const Driver d;
  return d;
}

bool g_pdl = true;   // jit.disable_pdl turns programmatic dependent launch off process-wide
int g_poison = -1;   // the GPU tests' poison byte for fresh outputs (launch.set_poison), -1: none

// commfuse.nccl.native_error, set at load: (code, the communicator's token) -> the exception NcclComm.all_reduce
// raises. Never freed: a launcher may raise while the interpreter exits.
py::object* g_nccl_error = nullptr;

// Raises an NCCL failure of a launcher as commfuse.nccl's own exception (NcclTimeoutError, NcclError), set as
// the Python error, so that a direct call, a torch.ops call and a compiled graph's call all raise that type
// (torch's op dispatch and pybind11 both pass a Python error through). code: the ncclResult_t, or kTimedOut.
[[noreturn]] void raise_nccl_error(int code, int64_t token) {
  py::gil_scoped_acquire gil;  // the op kernels run without it
  if (g_nccl_error == nullptr) throw std::runtime_error("ncclAllReduce failed: code " + std::to_string(code));
  const py::object e = (*g_nccl_error)(code, token);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
  throw py::error_already_set();
}

// One output of the call: its shape, and for an MN-major view the strides over a flat storage of
// storage_numel elements (strides empty: contiguous).
struct OutSpec {
  bool present = false;
  std::vector<int64_t> sizes, strides;
  int64_t storage_numel = 0;
  at::ScalarType dtype = at::kFloat;
};

// An argument the plan checked; the check here costs nanoseconds and keeps a stray None from crashing.
const at::Tensor& tensor(py::handle h, const char* name) {
  if (!THPVariable_Check(h.ptr())) throw py::type_error(std::string(name) + " must be a tensor");
  return THPVariable_Unpack(h.ptr());
}

py::object wrap(const at::Tensor& t) {
  PyObject* o = THPVariable_Wrap(t);
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

uintptr_t address(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()); }

// [first byte, past the last byte) of t's elements, or of storage_numel elements from its start (an
// MN-major output, whose padding rows the kernels write too); tail/checks.py's _span.
std::pair<uintptr_t, uintptr_t> span(const at::Tensor& t, int64_t storage_numel = -1) {
  if (!t.defined() || t.numel() == 0) return {0, 0};
  int64_t extent = storage_numel;
  if (extent < 0) {
    extent = 1;
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  }
  const uintptr_t begin = address(t);
  return {begin, begin + static_cast<uintptr_t>(extent) * t.element_size()};
}

bool overlap(const std::pair<uintptr_t, uintptr_t>& a, const std::pair<uintptr_t, uintptr_t>& b) {
  return a.first < a.second && b.first < b.second && a.first < b.second && b.first < a.second;
}

// The kernels read dense rows of 16-byte vectors: a strided or misaligned operand gets a copy
// (which lives until this call returns, after the launch: the caching allocator orders its reuse
// after the kernel on this stream).
at::Tensor operand(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return address(c) % 16 ? c.clone() : c;
}

// Whether tail/checks.py's fields_of reads `out` by position: a tuple that is not a namedtuple (a
// subclass of tuple too, or its fields would be read as absent attributes and never written). On the
// instance, as fields_of asks: a tuple whose instances alone answer _fields (a record type's __getattr__)
// is read by its names in both, where asking its type had it checked by name and written by position.
bool positional(py::handle out) {
  if (PyTuple_CheckExact(out.ptr())) return true;
  if (!PyTuple_Check(out.ptr())) return false;
  return PyObject_HasAttrString(out.ptr(), "_fields") == 0;
}

// Field i of a caller's `out`, read as tail/checks.py's fields_of reads it: a tuple by position in
// reference.Tail's order, else the object's attribute (a reference.Tail, a commfuse.FusedResult); None
// where it has none.
py::object out_field(py::handle out, bool by_position, int i) {
  if (by_position) {
    const Py_ssize_t n = PyTuple_GET_SIZE(out.ptr());
    return i < n ? py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(out.ptr(), i)) : py::none();
  }
  return py::getattr(out, kOutNames[i], py::none());
}

struct Patch {
  int offset;
  int source;
  int64_t delta;
};

struct KernelLaunch {
  CUfunction function;
  bool pdl;
  unsigned grid, block;
  std::string params;
  std::vector<Patch> patches;
  unsigned cluster;  // CTAs per thread-block cluster (1: none)
};

// A LaunchPlan's executor (commfuse/kernels/launch.py: PyLauncher is its Python twin).
class Launcher {
 public:
  // launches: (function, pdl, grid, block, params, [(offset, source, delta)], cluster) each; specs: one per output
  // ((sizes, strides or None, storage elements, a tensor of the dtype), or None where absent), five for a
  // tail, one for a plain all-reduce; nccl: None, or NcclComm.native_args (commfuse/nccl.py: ncclAllReduce's
  // address, the communicator, the NCCL dtype, the element count, then the watchdog's words, the device
  // address of their DONE, the mark kernel and the begin and end marks' parameters; zeros without one),
  // enqueued first; combine: the kernels combine MoE expert rows (the sources named as a MoE call's arguments);
  // copy: the output is x copied (the sum of one rank, launch.py's LaunchPlan.copy).
  Launcher(std::string name, const std::vector<py::tuple>& launches, const std::vector<py::object>& specs,
           bool fused, py::object nccl, int device, bool combine, bool copy)
      : name_(std::move(name)), fused_(fused), copy_(copy), inputs_(combine ? kMoeInputNames : kInputNames),
        device_(device) {
    for (const py::tuple& l : launches) {
      KernelLaunch k;
      k.function = reinterpret_cast<CUfunction>(l[0].cast<uintptr_t>());
      k.pdl = l[1].cast<bool>();
      k.grid = l[2].cast<unsigned>();
      k.block = l[3].cast<unsigned>();
      k.params = static_cast<std::string>(l[4].cast<py::bytes>());
      k.cluster = l[6].cast<unsigned>();
      if (k.cluster == 0 || k.grid % k.cluster) throw std::invalid_argument(name_ + ": bad cluster size");
      if (k.params.size() > kMaxParams) throw std::invalid_argument(name_ + ": parameter struct too large");
      for (const auto& p : l[5].cast<std::vector<std::tuple<int, int, int64_t>>>()) {
        const auto [offset, source, delta] = p;
        if (offset < 0 || offset + 8 > static_cast<int>(k.params.size()) || offset % 8 || source < 0 ||
            source >= kSources)
          throw std::invalid_argument(name_ + ": bad pointer patch");
        k.patches.push_back({offset, source, delta});
      }
      if (k.function == nullptr) throw std::invalid_argument(name_ + ": a launch without a kernel");
      launches_.push_back(std::move(k));
    }
    if (specs.size() != static_cast<size_t>(outputs())) throw std::invalid_argument(name_ + ": wrong number of specs");
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].is_none()) continue;
      auto s = specs[i].cast<py::tuple>();
      OutSpec& o = specs_[i];
      o.present = true;
      o.sizes = s[0].cast<std::vector<int64_t>>();
      if (!s[1].is_none()) o.strides = s[1].cast<std::vector<int64_t>>();
      o.storage_numel = s[2].cast<int64_t>();
      o.dtype = tensor(s[3], "spec dtype").scalar_type();
      field_names_[i] = fused_ ? std::string("out.") + kOutNames[i] : std::string("out");
    }
    if (!nccl.is_none()) {
      auto n = nccl.cast<py::tuple>();
      nccl_ = reinterpret_cast<AllReduce>(n[0].cast<uintptr_t>());
      nccl_comm_ = reinterpret_cast<void*>(n[1].cast<uintptr_t>());
      nccl_dtype_ = n[2].cast<int>();
      count_ = n[3].cast<int64_t>();
      progress_ = reinterpret_cast<volatile int64_t*>(n[4].cast<uintptr_t>());
      done_ = static_cast<CUdeviceptr>(n[5].cast<uintptr_t>());
      nccl_token_ = n[9].cast<int64_t>();
      if (n[6].cast<uintptr_t>() != 0) {  // COMMFUSE_NCCL_WATCH_REPLAYS=0: captured calls get no marks
        marked_ = true;
        for (int end = 0; end < 2; ++end) {
          KernelLaunch& m = marks_[end];
          m.function = reinterpret_cast<CUfunction>(n[6].cast<uintptr_t>());
          m.pdl = false;
          m.grid = 1;
          m.block = 32;  // commfuse/kernels/nccl_mark.py's THREADS
          m.params = static_cast<std::string>(n[7 + end].cast<py::bytes>());
          m.cluster = 1;
          if (m.function == nullptr || m.params.size() > kMaxParams) throw std::invalid_argument(name_ + ": bad marks");
        }
      }
    }
    if (copy_ && (fused_ || nccl_ != nullptr || !launches_.empty()))
      throw std::invalid_argument(name_ + ": a copy is a plain call's whole work");
    if (!launches_.empty() || progress_ != nullptr || copy_) driver();  // fail at plan time, not in a call
  }

  // x, residual, weight, scale, z, row_index, shared: tensors (or None where the call has none), as the plan
  // checked them. out: None, the caller's output tensor (a plain all-reduce) or the five output fields (see
  // out_field), each None to allocate. Returns the sum, or a tuple of the five outputs (None where absent).
  py::object operator()(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
                        py::handle z, py::handle row_index, py::handle shared) const {
    at::Tensor t[kSources];
    call(t, x, residual, weight, scale, out, z, row_index, shared);
    if (!fused_) return wrap(t[kOut0]);
    py::tuple result(kOutputs);
    for (int i = 0; i < kOutputs; ++i) result[i] = output(t, i);
    return result;
  }

  // operator()'s work, leaving the outputs in t[kOut0 + i].
  void call(at::Tensor (&t)[kSources], py::handle x, py::handle residual, py::handle weight, py::handle scale,
            py::handle out, py::handle z, py::handle row_index, py::handle shared) const {
    const py::handle inputs[kOut0] = {x, residual, weight, scale, z, row_index, shared};
    for (int i = kX; i < kOut0; ++i) {
      if (i == kX || !inputs[i].is_none()) t[i] = tensor(inputs[i], inputs_[i]);
    }
    if (!out.is_none()) {
      const bool by_position = fused_ && positional(out);
      for (int i = 0; i < outputs(); ++i) {
        if (!specs_[i].present) continue;
        const py::object h = fused_ ? out_field(out, by_position, i) : py::reinterpret_borrow<py::object>(out);
        if (h.is_none()) continue;  // allocated in run()
        // The plan checked the caller's outputs' metadata, which its key holds; not their addresses.
        const std::string& field = field_names_[i];
        at::Tensor& o = t[kOut0 + i];
        o = tensor(h, field.c_str());
        if (address(o) % 16) throw py::value_error(field + " must be 16-byte aligned");
        // The kernels write through the pointer, past autograd and inference mode: refuse what those guard
        // (commfuse/tail/checks.py's out_placed, in the same words).
        if (o.requires_grad() && at::GradMode::is_enabled())
          throw py::value_error(field + " requires grad: commfuse writes it outside autograd, which torch's out= "
                                        "refuses too; pass one that does not, or call under torch.no_grad()");
        if (o.is_inference() && !c10::InferenceMode::is_enabled())
          throw py::value_error(field + " is an inference tensor: it may be written only under torch.inference_mode()");
        // The key holds an MN-major view's shape and strides, not the room of its storage (the kernels
        // write the padding rows too).
        if (!specs_[i].strides.empty() &&
            static_cast<int64_t>(o.storage().nbytes()) - o.storage_offset() * o.element_size() <
                specs_[i].storage_numel * o.element_size())
          throw py::value_error(field + " must be a view of a storage of " +
                                std::to_string(specs_[i].storage_numel) + " elements (padding rows included)");
      }
      check_overlaps(t);
    }
    bool given[kOutputs] = {};
    for (int i = 0; i < outputs(); ++i) given[i] = t[kOut0 + i].defined();
    {
      // As torch's own ops do: a launch may block (NCCL's enqueue waiting for a peer, a stream's queue full
      // behind a stalled kernel), and the NCCL watchdog's thread, like the caller's others, needs the GIL to run.
      py::gil_scoped_release nogil;
      run(t);
    }
    // As torch's out= does, autograd sees the write: once it is launched (a refused call writes nothing),
    // as the Python launcher does.
    for (int i = 0; i < outputs(); ++i) {
      if (given[i]) t[kOut0 + i].unsafeGetTensorImpl()->bump_version();
    }
  }

  // The caller's outputs (defined in t[kOut0 + i]) overlap neither each other nor an input, except
  // out.residual being the residual input's own memory (an in-place update: the same address and
  // elements, both contiguous): tail/checks.py's no_overlap, per call, as the key holds no addresses.
  void check_overlaps(const at::Tensor (&t)[kSources]) const {
    const auto out_span = [&](int i) {
      return span(t[kOut0 + i], specs_[i].strides.empty() ? -1 : specs_[i].storage_numel);
    };
    for (int i = 0; i < outputs(); ++i) {
      const at::Tensor& o = t[kOut0 + i];
      if (!o.defined()) continue;
      const auto s = out_span(i);
      for (int j = i + 1; j < outputs(); ++j) {
        if (t[kOut0 + j].defined() && overlap(s, out_span(j)))
          throw py::value_error(field_names_[i] + " and " + field_names_[j] +
                                " overlap: the caller's outputs must be separate tensors");
      }
      for (int k = kX; k < kOut0; ++k) {
        const at::Tensor& in = t[k];
        if (!in.defined() || !overlap(s, span(in))) continue;
        if (fused_ && i == 0 && k == kResidual && address(in) == address(o) && in.numel() == o.numel() &&
            in.is_contiguous() && o.is_contiguous())
          continue;
        throw py::value_error(field_names_[i] + " overlaps " + inputs_[k] +
                              ": the caller's outputs may not overlap an input (out.residual may be residual "
                              "itself, or a [t, h] view of a contiguous residual, for an in-place update)");
      }
    }
  }

  // Output i of a call as a Python object (None where the call has none).
  py::object output(const at::Tensor (&t)[kSources], int i) const {
    return specs_[i].present ? wrap(t[kOut0 + i]) : py::none();
  }

  // t: the operands at kX..kZ (undefined where absent) and the caller's outputs at kOut0 + i (undefined
  // where not given); allocates the others and enqueues the work. Touches no Python object but to raise an
  // NCCL failure (under the GIL it takes then): the op kernels call it without the GIL.
  void run(at::Tensor (&t)[kSources]) const {
    const at::Tensor residual_in = t[kResidual];
    for (int i = kX; i < kOut0; ++i) {
      if (t[i].defined() && i != kScale) t[i] = operand(t[i]);
    }
    for (int i = 0; i < outputs(); ++i) {
      if (specs_[i].present && !t[kOut0 + i].defined()) t[kOut0 + i] = allocate(specs_[i]);
    }
    if (nccl_ != nullptr) {
      // NCCL writes the sum into the residual output, which the tail then updates in place; a
      // scratch buffer where that output is the residual input itself.
      at::Tensor& sum = t[kSum];
      const bool aliased = fused_ && residual_in.defined() && address(t[kOut0]) == address(residual_in);
      sum = aliased ? allocate(specs_[0]) : t[kOut0];
      if (progress_ != nullptr && progress_[kAborted] != 0) raise_nccl_error(kTimedOut, nccl_token_);
      const int captured = progress_ != nullptr ? capturing() : -1;
      if (captured == 1 && marked_) launch(marks_[0], t);
      const int64_t seq = captured == 0 ? issue() : 0;
      const int rc = nccl_(t[kX].data_ptr(), sum.data_ptr(), static_cast<size_t>(count_), nccl_dtype_, 0,
                           nccl_comm_, stream());
      const bool written = seq == 0 || done_when_reached(seq);
      if (rc != 0) raise_nccl_error(rc, nccl_token_);  // NcclTimeoutError where the watchdog's abort ended it
      if (!written) throw std::runtime_error(name_ + ": cuStreamWriteValue64 after ncclAllReduce failed");
      if (captured == 1 && marked_) launch(marks_[1], t);
    }
    if (copy_) copy(t[kOut0], t[kX]);
    for (const KernelLaunch& k : launches_) launch(k, t);
  }

 private:
  int outputs() const { return fused_ ? kOutputs : 1; }
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(device_).stream(); }

  // 1 where the stream is capturing a CUDA graph, 0 where not, -1 where the driver cannot say (commfuse/nccl.py's
  // NcclComm._captured): a captured all-reduce gets the marks, an eager one the stamp, neither when unknown.
  int capturing() const {
    CUstreamCaptureStatus status;
    if (driver().is_capturing(reinterpret_cast<CUstream>(stream()), &status) != CUDA_SUCCESS) return -1;
    return status != CU_STREAM_CAPTURE_STATUS_NONE ? 1 : 0;
  }

  // commfuse/nccl.py's NcclComm._issue: an eager all-reduce's number, counted with the time its enqueue begins
  // (NCCL's enqueue may itself wait for a peer, and the watchdog bounds that wait too).
  int64_t issue() const {
    const int64_t seq = progress_[kIssued] + 1;
    progress_[kStamps + seq % kRing] =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
            .count();
    std::atomic_thread_fence(std::memory_order_release);  // the stamp before the count the watchdog reads
    progress_[kIssued] = seq;
    return seq;
  }

  // NcclComm._done_when_reached: the stream writes seq when it gets there (at once after a failed enqueue, so
  // that the count catches up). False where the driver refused the write.
  bool done_when_reached(int64_t seq) const {
    const auto s = reinterpret_cast<CUstream>(stream());
    return driver().write_value64(s, done_, static_cast<cuuint64_t>(seq), 0) == CUDA_SUCCESS;
  }

  at::Tensor allocate(const OutSpec& s) const {
    // at::detail::empty_cuda is at::empty's CUDA kernel, called without the dispatcher's round trip.
    const int64_t flat[1] = {s.storage_numel};
    at::Tensor o = at::detail::empty_cuda(s.strides.empty() ? at::IntArrayRef(s.sizes) : at::IntArrayRef(flat),
                                          s.dtype, at::Device(at::kCUDA, device_), std::nullopt);
    if (g_poison >= 0) o.view(at::kByte).fill_(g_poison);
    return s.strides.empty() ? o : o.as_strided(s.sizes, s.strides);
  }

  // dst = src, both dense (an operand; an output of the plan's spec), on the current stream.
  void copy(const at::Tensor& dst, const at::Tensor& src) const {
    const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
    if (bytes == 0) return;
    c10::cuda::OptionalCUDAGuard guard;
    if (c10::cuda::current_device() != device_) guard.set_index(device_);
    const CUresult rc = driver().memcpy_async(static_cast<CUdeviceptr>(address(dst)),
                                              static_cast<CUdeviceptr>(address(src)), bytes,
                                              reinterpret_cast<CUstream>(stream()));
    if (rc != CUDA_SUCCESS) {
      const char* text = nullptr;
      driver().error_string(rc, &text);
      throw std::runtime_error("copy of " + name_ + " on cuda:" + std::to_string(device_) + ": " +
                               (text ? text : "unknown error") + " (" + std::to_string(rc) + ")");
    }
  }

  void launch(const KernelLaunch& k, const at::Tensor (&t)[kSources]) const {
    alignas(16) char buf[kMaxParams];
    std::memcpy(buf, k.params.data(), k.params.size());
    for (const Patch& p : k.patches) {
      const uintptr_t ptr = t[p.source].defined() ? address(t[p.source]) + p.delta : 0;
      std::memcpy(buf + p.offset, &ptr, sizeof ptr);
    }
    // The module was loaded in the device's primary context: launch with that device current.
    c10::cuda::OptionalCUDAGuard guard;
    if (c10::cuda::current_device() != device_) guard.set_index(device_);
    CUlaunchAttribute attrs[2]{};
    unsigned n = 0;
    if (k.pdl && g_pdl) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[n++].value.programmaticStreamSerializationAllowed = 1;
    }
    if (k.cluster > 1) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
      attrs[n].value.clusterDim.x = k.cluster;
      attrs[n].value.clusterDim.y = attrs[n].value.clusterDim.z = 1;
      ++n;
    }
    CUlaunchConfig config{};
    config.gridDimX = k.grid;
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = k.block;
    config.blockDimY = config.blockDimZ = 1;
    config.hStream = reinterpret_cast<CUstream>(stream());
    config.attrs = attrs;
    config.numAttrs = n;
    void* args[1] = {buf};
    const CUresult rc = driver().launch_ex(&config, k.function, args, nullptr);
    if (rc != CUDA_SUCCESS) {
      const char* text = nullptr;
      driver().error_string(rc, &text);
      throw std::runtime_error("launch of " + name_ + " grid=(" + std::to_string(k.grid) + ",) block=(" +
                               std::to_string(k.block) + ",) on cuda:" + std::to_string(device_) + ": " +
                               (text ? text : "unknown error") + " (" + std::to_string(rc) + ")");
    }
  }

  std::string name_;
  std::vector<KernelLaunch> launches_;
  OutSpec specs_[kOutputs];
  std::string field_names_[kOutputs];  // for the caller-owned outputs' errors: "out.norm" (or "out")
  bool fused_;
  bool copy_;
  const char* const* inputs_;  // the inputs' names in errors: a MoE call's or the others'
  AllReduce nccl_ = nullptr;
  void* nccl_comm_ = nullptr;
  int64_t nccl_token_ = 0;  // commfuse.nccl's name for the communicator, for its errors
  int nccl_dtype_ = 0;
  int64_t count_ = 0;
  volatile int64_t* progress_ = nullptr;  // the NCCL watchdog's words, nullptr without one
  CUdeviceptr done_ = 0;
  bool marked_ = false;    // captured all-reduces get the watchdog's marks:
  KernelLaunch marks_[2];  // their begin and end
  int device_;
};

// ------------------------------------------------------------------ the call signature (the key)

// The ops a table serves, and their key's first byte (commfuse/kernels/table.py's OPS).
enum Op : char { kPlain = 'P', kFused = 'F', kLocal = 'L', kGated = 'G', kQuantize = 'Q', kMoe = 'M' };

Op op_of(std::string_view name) {
  if (name == "plain") return kPlain;
  if (name == "fused") return kFused;
  if (name == "local") return kLocal;
  if (name == "gated") return kGated;
  if (name == "quantize") return kQuantize;
  if (name == "moe") return kMoe;
  throw py::value_error("op must be one of plain, fused, local, gated, quantize, moe");
}

// Everything a key is written from, whoever made the call (Python through a table's lookup, or an op
// kernel): nullptr / nullopt where the call has no such argument or passed None.
struct Call {
  Op op = kPlain;
  const at::Tensor* x = nullptr;
  const at::Tensor* residual = nullptr;
  const at::Tensor* weight = nullptr;
  const at::Tensor* scale = nullptr;
  const at::Tensor* z = nullptr;
  const at::Tensor* row_index = nullptr;
  const at::Tensor* shared = nullptr;
  bool has_out = false;                         // the caller gave outputs
  const at::Tensor* outs[kOutputs] = {};        // plain: outs[0]; a tail: each field, nullptr for None
  double eps = 0, weight_offset = 0;
  int64_t group_size = 0;
  bool return_norm = false, norm_before_gate = false, scale_ue8m0 = false;
  std::optional<std::string_view> quant, sf_layout, scale_layout;  // quant nullopt: None (no quantization)
  // The Python front end's references to a caller's output fields (an attribute read is a new reference):
  // what outs[i] points into lives until the key is written. Empty in the op kernels (no GIL there).
  py::object held[kOutputs];
};

template <typename V>
void put(std::string& key, V v) {
  key.append(reinterpret_cast<const char*>(&v), sizeof v);
}

void put_tensor(std::string& key, const at::Tensor* t) {
  if (t == nullptr) {
    put(key, 'n');
    return;
  }
  put(key, 't');
  put(key, static_cast<int8_t>(t->scalar_type()));
  put(key, static_cast<int8_t>(t->device().type()));
  put(key, static_cast<int8_t>(t->device().index()));
  put(key, static_cast<int64_t>(t->dim()));  // whole: torch takes more than 255 dims, and the sizes follow
  for (const int64_t v : t->sizes()) put(key, v);
  for (const int64_t v : t->strides()) put(key, v);
}

void put_text(std::string& key, const std::optional<std::string_view>& text) {
  if (!text) {
    put(key, static_cast<int32_t>(-1));
    return;
  }
  put(key, static_cast<int32_t>(text->size()));
  key.append(text->data(), text->size());
}

// The one key writer: every field of every op, in one order.
std::string write_key(const Call& c) {
  std::string key;
  key.reserve(320);
  put(key, static_cast<char>(c.op));
  for (const at::Tensor* t : {c.x, c.residual, c.weight, c.scale, c.z, c.row_index, c.shared}) put_tensor(key, t);
  put(key, c.has_out);
  if (c.has_out) {
    for (const at::Tensor* t : c.outs) put_tensor(key, t);
  }
  put(key, c.eps);
  put(key, c.weight_offset);
  put(key, c.group_size);
  put(key, c.return_norm);
  put(key, c.norm_before_gate);
  put(key, c.scale_ue8m0);
  put_text(key, c.quant);
  put_text(key, c.sf_layout);
  put_text(key, c.scale_layout);
  return key;
}

// ---- the Python front end: false where the key cannot hold an argument (a miss; Python plans it)

bool from_tensor(py::handle h, const at::Tensor*& t, bool optional) {
  if (h.is_none()) {
    t = nullptr;
    return optional;
  }
  if (!THPVariable_Check(h.ptr())) return false;
  t = &THPVariable_Unpack(h.ptr());
  // Any other tensor has no key: planning says why (a FakeTensor's, a functionalized tensor's or a torch.func
  // transform's memory is not its values; a zero tensor has none, and its null pointer would read as an argument
  // not given).
  const c10::DispatchKeySet keys = t->key_set();
  return t->layout() == at::kStrided && !t->is_nested() && !t->is_neg() && !t->_is_zerotensor() &&
         !keys.has(c10::DispatchKey::Python) && !keys.has(c10::DispatchKey::Functionalize) &&
         !keys.has(c10::DispatchKey::FuncTorchBatched) && !keys.has(c10::DispatchKey::FuncTorchGradWrapper);
}

bool from_number(py::handle h, double& v) {
  if (PyFloat_CheckExact(h.ptr())) {
    v = PyFloat_AS_DOUBLE(h.ptr());
    return true;
  }
  if (PyLong_CheckExact(h.ptr())) {
    v = PyLong_AsDouble(h.ptr());
    if (v == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

bool from_int(py::handle h, int64_t& v) {
  if (!PyLong_CheckExact(h.ptr())) return false;
  v = PyLong_AsLongLong(h.ptr());
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool from_bool(py::handle h, bool& v) {
  if (h.ptr() != Py_True && h.ptr() != Py_False) return false;
  v = h.ptr() == Py_True;
  return true;
}

bool from_text(py::handle h, std::optional<std::string_view>& v) {  // a str, or None
  if (h.is_none()) {
    v.reset();
    return true;
  }
  if (!PyUnicode_CheckExact(h.ptr())) return false;
  Py_ssize_t n = 0;
  const char* text = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
  if (text == nullptr) {
    PyErr_Clear();
    return false;
  }
  v = std::string_view(text, static_cast<size_t>(n));
  return true;
}

bool from_out(py::handle out, bool fused, Call& c) {
  c.has_out = !out.is_none();
  if (!c.has_out) return true;
  if (!fused) return from_tensor(out, c.outs[0], false);
  // Only an `out` that fields_of takes (tail/checks.py) has a key: a tuple of 4 or 5 fields, or an object
  // with the first four; any other misses, and the checks raise.
  const bool tuple = positional(out);
  if (tuple && PyTuple_GET_SIZE(out.ptr()) != kOutputs - 1 && PyTuple_GET_SIZE(out.ptr()) != kOutputs) return false;
  for (int i = 0; i < kOutputs; ++i) {
    if (tuple) {
      c.held[i] = out_field(out, true, i);
    } else {
      PyObject* field = PyObject_GetAttrString(out.ptr(), kOutNames[i]);
      if (field == nullptr) {
        PyErr_Clear();
        if (i < kOutputs - 1) return false;
        field = Py_NewRef(Py_None);
      }
      c.held[i] = py::reinterpret_steal<py::object>(field);
    }
    if (!from_tensor(c.held[i], c.outs[i], true)) return false;
  }
  return true;
}

// The arguments of each op's lookup (table.py's order) into a Call.
bool plain_call(Call& c, py::handle x, py::handle out) {
  c.op = kPlain;
  return from_tensor(x, c.x, false) && from_out(out, false, c);
}

bool tail_call(Call& c, Op op, py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
               py::handle eps, py::handle quant, py::handle return_norm, py::handle sf_layout,
               py::handle weight_offset, py::handle scale_layout, py::handle scale_ue8m0) {
  c.op = op;
  return from_tensor(x, c.x, false) && from_tensor(residual, c.residual, op == kLocal) &&
         from_tensor(weight, c.weight, false) && from_tensor(scale, c.scale, true) && from_out(out, true, c) &&
         from_number(eps, c.eps) && from_text(quant, c.quant) && from_bool(return_norm, c.return_norm) &&
         from_text(sf_layout, c.sf_layout) && from_number(weight_offset, c.weight_offset) &&
         from_text(scale_layout, c.scale_layout) && from_bool(scale_ue8m0, c.scale_ue8m0);
}

bool gated_call(Call& c, py::handle x, py::handle z, py::handle weight, py::handle scale, py::handle eps,
                py::handle group_size, py::handle norm_before_gate, py::handle quant, py::handle return_norm,
                py::handle sf_layout, py::handle scale_layout, py::handle scale_ue8m0) {
  c.op = kGated;
  return from_tensor(x, c.x, false) && from_tensor(z, c.z, true) && from_tensor(weight, c.weight, false) &&
         from_tensor(scale, c.scale, true) && from_number(eps, c.eps) && from_int(group_size, c.group_size) &&
         from_bool(norm_before_gate, c.norm_before_gate) && from_text(quant, c.quant) &&
         from_bool(return_norm, c.return_norm) && from_text(sf_layout, c.sf_layout) &&
         from_text(scale_layout, c.scale_layout) && from_bool(scale_ue8m0, c.scale_ue8m0);
}

bool quantize_call(Call& c, py::handle x, py::handle scale, py::handle quant, py::handle sf_layout,
                   py::handle scale_layout, py::handle scale_ue8m0) {
  c.op = kQuantize;
  return from_tensor(x, c.x, false) && from_tensor(scale, c.scale, true) && from_text(quant, c.quant) &&
         from_text(sf_layout, c.sf_layout) && from_text(scale_layout, c.scale_layout) &&
         from_bool(scale_ue8m0, c.scale_ue8m0);
}

// moe's lookup: the MoE inputs, then fused's arguments from residual on (y stands in x's place).
bool moe_call(Call& c, py::handle y, py::handle weights, py::handle row_index, py::handle shared, py::handle residual,
              py::handle weight, py::handle scale, py::handle out, py::handle eps, py::handle quant,
              py::handle return_norm, py::handle sf_layout, py::handle weight_offset, py::handle scale_layout,
              py::handle scale_ue8m0) {
  return tail_call(c, kMoe, y, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, scale_ue8m0) &&
         from_tensor(weights, c.z, false) && from_tensor(row_index, c.row_index, true) &&
         from_tensor(shared, c.shared, true);
}

// The args tuple of an insert, as its op's lookup takes it.
bool call_of(Call& c, Op op, const py::tuple& a) {
  const auto n = a.size();
  switch (op) {
    case kPlain:
      return n == 2 && plain_call(c, a[0], a[1]);
    case kFused:  // and its post_weight (a fused call's z)
      return n == 13 && tail_call(c, op, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]) &&
             from_tensor(a[12], c.z, true);
    case kLocal:
      return n == 12 && tail_call(c, op, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    case kGated:
      return n == 12 && gated_call(c, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    case kQuantize:
      return n == 6 && quantize_call(c, a[0], a[1], a[2], a[3], a[4], a[5]);
    case kMoe:
      return n == 15 && moe_call(c, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
                                 a[13], a[14]);
  }
  return false;
}

// ------------------------------------------------------------------ the plan table

class Table;

// The op kernels run without the GIL (torch.ops releases it), so the tables and the registry that
// finds a table by its name are guarded by one mutex, held for lookups and updates only: a launch runs
// on a shared_ptr copy of its launcher (immutable, so launches may overlap), and nobody runs Python or
// waits for the GIL while holding it. Leaked on purpose: a Table still alive at exit must not find them
// destroyed.
std::mutex& g_mutex = *new std::mutex;
std::unordered_map<std::string, Table*>& g_tables = *new std::unordered_map<std::string, Table*>;

// A table entry: the plan, and its launcher: a C++ Launcher, or any Python callable taking the same call
// (the routes without kernels, the cross-rank check of COMMFUSE_CHECK=1).
struct Entry {
  py::object plan;
  std::shared_ptr<const Launcher> native;
  py::object callable;
};

class Table {
 public:
  // name: the ops' name for it (a Communicator's name, or "local"); error_word: a P2P workspace's pinned
  // error word (0: none); the result types of the fused, local / gated and quantize ops.
  Table(std::string name, uintptr_t error_word, py::object fused_type, py::object tail_type,
        py::object quantized_type)
      : name_(std::move(name)), error_word_(reinterpret_cast<volatile int*>(error_word)),
        fused_type_(std::move(fused_type)), tail_type_(std::move(tail_type)),
        quantized_type_(std::move(quantized_type)) {
    for (const py::object* t : {&fused_type_, &tail_type_, &quantized_type_}) {
      if (!PyType_Check(t->ptr())) throw py::type_error("Table: the result types must be classes");
    }
    for (int i = 0; i <= kOutputs; ++i) {
      fields_[i] = py::reinterpret_steal<py::object>(PyUnicode_InternFromString(i < kOutputs ? kOutNames[i] : "plan"));
      if (!fields_[i]) throw py::error_already_set();
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_tables[name_] = this;
  }

  ~Table() {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto it = g_tables.find(name_);
    if (it != g_tables.end() && it->second == this) g_tables.erase(it);
  }

  Table(const Table&) = delete;
  Table& operator=(const Table&) = delete;

  // ---- lookups (commfuse/kernels/table.py): the result, or None on a miss

  py::object plain(py::handle x, py::handle out) {
    Call c;
    if (!plain_call(c, x, out)) return py::none();
    return hit(c, x, py::none(), py::none(), py::none(), out, py::none());
  }

  // local (fused_add_rmsnorm) takes fused's arguments (a Communicator's fused_all_reduce) but its post_weight.
  py::object local(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
                   py::handle eps, py::handle quant, py::handle return_norm, py::handle sf_layout,
                   py::handle weight_offset, py::handle scale_layout, py::handle scale_ue8m0) {
    Call c;
    if (!tail_call(c, kLocal, x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, scale_ue8m0))
      return py::none();
    return hit(c, x, residual, weight, scale, out, py::none());
  }

  // The post-norm's weight is the call's z (commfuse/routes.py's Call.post).
  py::object fused(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
                   py::handle eps, py::handle quant, py::handle return_norm, py::handle sf_layout,
                   py::handle weight_offset, py::handle scale_layout, py::handle scale_ue8m0, py::handle post_weight) {
    Call c;
    if (!tail_call(c, kFused, x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, scale_ue8m0) ||
        !from_tensor(post_weight, c.z, true))
      return py::none();
    return hit(c, x, residual, weight, scale, out, post_weight);
  }

  py::object gated(py::handle x, py::handle z, py::handle weight, py::handle scale, py::handle eps,
                   py::handle group_size, py::handle norm_before_gate, py::handle quant, py::handle return_norm,
                   py::handle sf_layout, py::handle scale_layout, py::handle scale_ue8m0) {
    Call c;
    if (!gated_call(c, x, z, weight, scale, eps, group_size, norm_before_gate, quant, return_norm, sf_layout,
                    scale_layout, scale_ue8m0))
      return py::none();
    return hit(c, x, py::none(), weight, scale, py::none(), z);
  }

  py::object quantize(py::handle x, py::handle scale, py::handle quant, py::handle sf_layout,
                      py::handle scale_layout, py::handle scale_ue8m0) {
    Call c;
    if (!quantize_call(c, x, scale, quant, sf_layout, scale_layout, scale_ue8m0)) return py::none();
    return hit(c, x, py::none(), py::none(), scale, py::none(), py::none());
  }

  py::object moe(py::handle y, py::handle weights, py::handle row_index, py::handle shared, py::handle residual,
                 py::handle weight, py::handle scale, py::handle out, py::handle eps, py::handle quant,
                 py::handle return_norm, py::handle sf_layout, py::handle weight_offset, py::handle scale_layout,
                 py::handle scale_ue8m0) {
    Call c;
    if (!moe_call(c, y, weights, row_index, shared, residual, weight, scale, out, eps, quant, return_norm, sf_layout,
                  weight_offset, scale_layout, scale_ue8m0))
      return py::none();
    return hit(c, y, residual, weight, scale, out, weights, row_index, shared);
  }

  // op: table.py's name of the op; args: its lookup's arguments. False where the key cannot hold them.
  bool insert(std::string_view op, const py::tuple& args, py::object plan, py::object launcher) {
    Call c;
    if (!call_of(c, op_of(op), args)) return false;
    Entry entry{std::move(plan), nullptr, py::none()};
    if (py::isinstance<Launcher>(launcher)) {
      entry.native = launcher.cast<std::shared_ptr<Launcher>>();
    } else {
      entry.callable = std::move(launcher);
    }
    std::unordered_map<std::string, Entry> old;  // released after the unlock: a plan's release may run Python
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      if (entries_.size() >= kMaxEntries) old.swap(entries_);
      std::swap(entries_[write_key(c)], entry);
    }
    return true;  // a replaced entry is released here, after the unlock
  }

  void clear() {
    std::unordered_map<std::string, Entry> old;  // destroyed after the unlock, as in insert()
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      old.swap(entries_);
    }
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(g_mutex);
    return entries_.size();
  }

  // The op kernels' lookup, under g_mutex: the C++ launcher of the call, or nullptr where the table has
  // none that may run without Python (a miss, a Python launcher, or a P2P error pending).
  std::shared_ptr<const Launcher> op_launcher(const Call& c) const {
    if (error_pending()) return nullptr;
    const auto it = entries_.find(write_key(c));
    return it == entries_.end() ? nullptr : it->second.native;
  }

 private:
  bool error_pending() const { return error_word_ != nullptr && *error_word_ != 0; }

  // row_index, shared: a MoE call's (a Python launcher of another op is called without them).
  py::object hit(const Call& c, py::handle x, py::handle residual, py::handle weight, py::handle scale,
                 py::handle out, py::handle z, py::handle row_index = py::none(), py::handle shared = py::none()) {
    Entry entry;
    {
      // Only the lookup under the mutex: the launch may run Python (a collection at an allocation, a
      // Python launcher), which may switch threads or clear the table.
      std::lock_guard<std::mutex> lock(g_mutex);
      if (error_pending()) return py::none();
      const auto it = entries_.find(write_key(c));
      if (it == entries_.end()) return py::none();
      entry = it->second;
    }
    if (c.op == kPlain) {
      if (entry.native) return (*entry.native)(x, residual, weight, scale, out, z, row_index, shared);
      return entry.callable(x, residual, weight, scale, out, z);
    }
    PyObject* outs[kOutputs];
    py::tuple returned;
    at::Tensor t[kSources];
    py::object held[kOutputs];
    if (entry.native) {
      entry.native->call(t, x, residual, weight, scale, out, z, row_index, shared);
      for (int i = 0; i < kOutputs; ++i) {
        held[i] = entry.native->output(t, i);
        outs[i] = held[i].ptr();
      }
    } else {
      returned = (c.op == kMoe ? entry.callable(x, residual, weight, scale, out, z, row_index, shared)
                               : entry.callable(x, residual, weight, scale, out, z))
                     .cast<py::tuple>();
      if (returned.size() != kOutputs) throw py::value_error(name_ + ": a launcher returned no five outputs");
      for (int i = 0; i < kOutputs; ++i) outs[i] = returned[i].ptr();
    }
    return result(c.op, outs, entry.plan);
  }

  // The op's result from the five outputs: the fused op's result type with its fields set (no Python
  // frame: its __init__ would be one), the others' tuple types filled the way CPython fills a tuple
  // subclass.
  py::object result(Op op, PyObject* const (&outs)[kOutputs], const py::object& plan) const {
    if (op == kFused || op == kMoe) {
      PyTypeObject* type = reinterpret_cast<PyTypeObject*>(fused_type_.ptr());
      py::object r = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
      if (!r) throw py::error_already_set();
      for (int i = 0; i <= kOutputs; ++i) {
        PyObject* v = i < kOutputs ? outs[i] : plan.ptr();
        if (PyObject_SetAttr(r.ptr(), fields_[i].ptr(), v) < 0) throw py::error_already_set();
      }
      return r;
    }
    const bool quantized = op == kQuantize;
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>((quantized ? quantized_type_ : tail_type_).ptr());
    const int first = quantized ? 2 : 0;  // Quantized: (quant, scale_factors, scales)
    const int n = kOutputs - first;
    PyObject* r = type->tp_alloc(type, n);
    if (r == nullptr) throw py::error_already_set();
    for (int i = 0; i < n; ++i) {
      Py_INCREF(outs[first + i]);
      PyTuple_SET_ITEM(r, i, outs[first + i]);
    }
    return py::reinterpret_steal<py::object>(r);
  }

  std::string name_;
  volatile int* error_word_;
  py::object fused_type_, tail_type_, quantized_type_;
  py::object fields_[kOutputs + 1];  // the fused type's field names, interned
  std::unordered_map<std::string, Entry> entries_;
};

// ------------------------------------------------------------------ the op kernels

// commfuse::fused_all_reduce, all_reduce, fused_add_rmsnorm, gated_rmsnorm and quantize for CUDA tensors: a call
// whose signature has a C++ launcher in its table runs here without Python; the others go to the
// Python kernels of commfuse/ops.py (which plan them), as every other device's calls do (torch's
// dispatcher calling a Python kernel costs ~12 us of host time a call on an H200 host).
using Outputs = std::vector<at::Tensor>;

at::Tensor wrap_back(py::handle h) { return THPVariable_Unpack(h.ptr()); }

// The public keyword arguments of each `tail` code (commfuse/tail/spec.py's codes(), set once at load):
// a table's keys hold the Python calls' strings, and an op's call must write the same key.
struct TailOptions {
  bool valid = false;
  std::optional<std::string> quant;  // nullopt: no quantization
  bool return_norm = false, scale_ue8m0 = false;
  std::string sf_layout, scale_layout;
};
constexpr int64_t kTailCodes = 256;
std::vector<TailOptions>& g_tails = *new std::vector<TailOptions>(kTailCodes);

void set_tails(const py::dict& codes) {
  std::vector<TailOptions> tails(kTailCodes);
  for (const auto& [code, kw] : codes) {
    const int64_t c = code.cast<int64_t>();
    if (c < 0 || c >= kTailCodes) throw py::value_error("set_tails: a tail code outside [0, 256)");
    const py::dict d = kw.cast<py::dict>();
    TailOptions& o = tails[c];
    o.valid = true;
    if (!d["quant"].is_none()) o.quant = d["quant"].cast<std::string>();
    o.return_norm = d["return_norm"].cast<bool>();
    o.sf_layout = d["sf_layout"].cast<std::string>();
    o.scale_layout = d["scale_layout"].cast<std::string>();
    o.scale_ue8m0 = d["scale_ue8m0"].cast<bool>();
  }
  g_tails.swap(tails);  // at load, before any op kernel runs
}

// c's tail options from an op's `tail` code; false for a code that is no spec's (the Python kernel raises).
bool tail_options(Call& c, int64_t tail) {
  if (tail < 0 || tail >= kTailCodes || !g_tails[tail].valid) return false;
  const TailOptions& o = g_tails[tail];
  if (o.quant) c.quant = std::string_view(*o.quant);
  c.return_norm = o.return_norm;
  c.sf_layout = std::string_view(o.sf_layout);
  c.scale_layout = std::string_view(o.scale_layout);
  c.scale_ue8m0 = o.scale_ue8m0;
  return true;
}

// Runs the C++ launcher of `c` in table `name` on t (the operands); false where there is none.
bool run_op(std::string_view name, const Call& c, at::Tensor (&t)[kSources]) {
  std::shared_ptr<const Launcher> launcher;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto table = g_tables.find(std::string(name));
    if (table == g_tables.end()) return false;
    launcher = table->second->op_launcher(c);
  }
  if (launcher == nullptr) return false;
  launcher->run(t);
  return true;
}

// An op returns the outputs its call has (the launcher made those; the others stay undefined), in order.
Outputs op_outputs(const at::Tensor (&t)[kSources]) {
  Outputs o;
  o.reserve(kOutputs);
  for (int i = 0; i < kOutputs; ++i) {
    if (t[kOut0 + i].defined()) o.push_back(t[kOut0 + i]);
  }
  return o;
}

Outputs list_back(const py::object& r) {
  Outputs o;
  for (const py::handle h : r) o.push_back(wrap_back(h));
  return o;
}

py::object optional_wrap(const std::optional<at::Tensor>& t) { return t.has_value() ? wrap(*t) : py::none(); }

// The Call of an op's arguments (the gated norm's group is the caller's to set), with its operands in t;
// false for a `tail` code that is no spec's. residual, z: nullptr where the op has none.
bool op_call(Call& c, Op op, at::Tensor (&t)[kSources], const at::Tensor& x, const at::Tensor* residual,
             const at::Tensor* weight, const std::optional<at::Tensor>& scale, const at::Tensor* z, double eps,
             double weight_offset, int64_t tail) {
  // A None passed for a required tensor arrives undefined: the Python kernel names the argument.
  for (const at::Tensor* given : {&x, residual, weight, z}) {
    if (given != nullptr && !given->defined()) return false;
  }
  c.op = op;
  c.x = &x;
  c.residual = residual;
  c.weight = weight;
  c.scale = scale.has_value() ? &*scale : nullptr;
  c.z = z;
  c.eps = eps;
  c.weight_offset = weight_offset;
  t[kX] = x;
  if (residual != nullptr) t[kResidual] = *residual;
  if (weight != nullptr) t[kWeight] = *weight;
  if (scale.has_value()) t[kScale] = *scale;
  if (z != nullptr) t[kZ] = *z;
  return tail_options(c, tail);
}

// post_weight: a post-norm's weight, the call's z (commfuse/routes.py's Call.post).
Outputs fused_all_reduce_op(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                            const std::optional<at::Tensor>& scale, double eps, double weight_offset, int64_t tail,
                            std::string_view comm, const std::optional<at::Tensor>& post_weight) {
  at::Tensor t[kSources];
  Call c;
  if (op_call(c, kFused, t, x, &residual, &weight, scale, post_weight.has_value() ? &*post_weight : nullptr, eps,
              weight_offset, tail) &&
      run_op(comm, c, t))
    return op_outputs(t);
  py::gil_scoped_acquire gil;
  return list_back(py::module_::import("commfuse.ops").attr("_fused_all_reduce")(
      wrap(x), wrap(residual), wrap(weight), optional_wrap(scale), eps, weight_offset, tail, std::string(comm),
      optional_wrap(post_weight)));
}

at::Tensor all_reduce_op(const at::Tensor& x, std::string_view comm) {
  Call c;
  c.op = kPlain;
  c.x = &x;
  at::Tensor t[kSources];
  t[kX] = x;
  if (x.defined() && run_op(comm, c, t)) return t[kOut0];
  py::gil_scoped_acquire gil;
  return wrap_back(py::module_::import("commfuse.ops").attr("_all_reduce")(wrap(x), std::string(comm)));
}

Outputs fused_add_rmsnorm_op(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight,
                             const std::optional<at::Tensor>& scale, double eps, double weight_offset, int64_t tail) {
  at::Tensor t[kSources];
  Call c;
  // Outputs may not alias inputs: the kernel writes fresh tensors (the op takes no out=).
  if (op_call(c, kLocal, t, x, residual.has_value() ? &*residual : nullptr, &weight, scale, nullptr, eps, weight_offset,
              tail) && run_op("local", c, t))
    return op_outputs(t);
  py::gil_scoped_acquire gil;
  return list_back(py::module_::import("commfuse.ops").attr("_fused_add_rmsnorm")(
      wrap(x), optional_wrap(residual), wrap(weight), optional_wrap(scale), eps, weight_offset, tail));
}

Outputs gated_rmsnorm_op(const at::Tensor& x, const std::optional<at::Tensor>& z, const at::Tensor& weight,
                         const std::optional<at::Tensor>& scale, double eps, int64_t group_size, bool norm_before_gate,
                         int64_t tail) {
  at::Tensor t[kSources];
  Call c;
  c.group_size = group_size;
  c.norm_before_gate = norm_before_gate;
  if (op_call(c, kGated, t, x, nullptr, &weight, scale, z.has_value() ? &*z : nullptr, eps, 0.0, tail) &&
      run_op("local", c, t))
    return op_outputs(t);
  py::gil_scoped_acquire gil;
  return list_back(py::module_::import("commfuse.ops").attr("_gated_rmsnorm")(
      wrap(x), optional_wrap(z), wrap(weight), optional_wrap(scale), eps, group_size, norm_before_gate, tail));
}

Outputs quantize_op(const at::Tensor& x, const std::optional<at::Tensor>& scale, int64_t tail) {
  at::Tensor t[kSources];
  Call c;
  // The Python calls' key has no eps and no norm for quantize: a code with return_norm set misses (and raises).
  if (op_call(c, kQuantize, t, x, nullptr, nullptr, scale, nullptr, 0.0, 0.0, tail) && !c.return_norm &&
      run_op("local", c, t))
    return op_outputs(t);
  py::gil_scoped_acquire gil;
  return list_back(py::module_::import("commfuse.ops").attr("_quantize")(wrap(x), optional_wrap(scale), tail));
}

Outputs moe_all_reduce_op(const at::Tensor& y, const at::Tensor& weights, const std::optional<at::Tensor>& row_index,
                          const std::optional<at::Tensor>& shared, const at::Tensor& residual, const at::Tensor& weight,
                          const std::optional<at::Tensor>& scale, double eps, double weight_offset, int64_t tail,
                          std::string_view comm) {
  at::Tensor t[kSources];
  Call c;
  if (op_call(c, kMoe, t, y, &residual, &weight, scale, &weights, eps, weight_offset, tail)) {
    if (row_index.has_value()) t[kRowIndex] = *(c.row_index = &*row_index);
    if (shared.has_value()) t[kShared] = *(c.shared = &*shared);
    if (run_op(comm, c, t)) return op_outputs(t);
  }
  py::gil_scoped_acquire gil;
  return list_back(py::module_::import("commfuse.ops").attr("_moe_all_reduce")(
      wrap(y), wrap(weights), optional_wrap(row_index), optional_wrap(shared), wrap(residual), wrap(weight),
      optional_wrap(scale), eps, weight_offset, tail, std::string(comm)));
}

// An op kernel as a plain function (what Inductor's code calls, commfuse/fusion/lowering.py): without the
// dispatcher's argument parsing and boxing, which cost more host time than the kernel's own work. The GIL is
// released as torch.ops does; the op keeps its name in torch.profiler's traces.
// names: py::arg annotations of every argument where the schema defaults trailing ones (Inductor's code leaves a
// trailing argument at its default out of the call).
template <typename R, typename... A, typename... Names>
void def_direct(py::module_& m, const char* name, R (*op)(A...), const Names&... names) {
  m.def(
      name,
      [qualified = std::string("commfuse::") + name, op](A... a) -> R {
        RECORD_FUNCTION(qualified, std::vector<c10::IValue>());
        return op(std::forward<A>(a)...);
      },
      py::call_guard<py::gil_scoped_release>(), names...);
}

}  // namespace

TORCH_LIBRARY_IMPL(commfuse, CUDA, m) {
  m.impl("fused_all_reduce", fused_all_reduce_op);
  m.impl("all_reduce", all_reduce_op);
  m.impl("fused_add_rmsnorm", fused_add_rmsnorm_op);
  m.impl("gated_rmsnorm", gated_rmsnorm_op);
  m.impl("quantize", quantize_op);
  m.impl("moe_all_reduce", moe_all_reduce_op);
}

PYBIND11_MODULE(commfuse_host, m) {
  m.doc() = "commfuse's eager hot path (csrc/host_launch.cpp)";
  py::class_<Launcher, std::shared_ptr<Launcher>>(m, "Launcher")
      .def(py::init<std::string, const std::vector<py::tuple>&, const std::vector<py::object>&, bool, py::object,
                    int, bool, bool>())
      .def("__call__", &Launcher::operator(), py::arg("x"), py::arg("residual") = py::none(),
           py::arg("weight") = py::none(), py::arg("scale") = py::none(), py::arg("out") = py::none(),
           py::arg("z") = py::none(), py::arg("row_index") = py::none(), py::arg("shared") = py::none());
  py::class_<Table>(m, "Table")
      .def(py::init<std::string, uintptr_t, py::object, py::object, py::object>())
      .def("plain", &Table::plain)
      .def("fused", &Table::fused)
      .def("local", &Table::local)
      .def("gated", &Table::gated)
      .def("quantize", &Table::quantize)
      .def("moe", &Table::moe)
      .def("insert", &Table::insert)
      .def("clear", &Table::clear)
      .def("__len__", &Table::size);
  def_direct(m, "fused_all_reduce", &fused_all_reduce_op, py::arg("x"), py::arg("residual"), py::arg("weight"),
             py::arg("scale"), py::arg("eps"), py::arg("weight_offset"), py::arg("tail"), py::arg("comm"),
             py::arg("post_weight") = py::none());
  def_direct(m, "all_reduce", &all_reduce_op);
  def_direct(m, "fused_add_rmsnorm", &fused_add_rmsnorm_op);
  def_direct(m, "gated_rmsnorm", &gated_rmsnorm_op);
  def_direct(m, "quantize", &quantize_op);
  def_direct(m, "moe_all_reduce", &moe_all_reduce_op);
  m.def("set_pdl", [](bool on) { g_pdl = on; });
  m.def("set_tails", &set_tails);
  m.def("set_poison", [](int byte) { g_poison = byte; });
  m.def("set_nccl_error", [](py::object f) { g_nccl_error = new py::object(std::move(f)); });
  py::dict sources;
  for (const auto& [name, value] : {std::pair<const char*, int>{"X", kX}, {"RESIDUAL", kResidual}, {"WEIGHT", kWeight},
                                    {"SCALE", kScale}, {"Z", kZ}, {"ROW_INDEX", kRowIndex}, {"SHARED", kShared},
                                    {"OUT", kOut0}, {"SUM", kSum}})
    sources[name] = value;
  m.attr("SOURCES") = sources;
  py::dict progress;
  for (const auto& [name, value] : {std::pair<const char*, int>{"DONE", kDone}, {"ISSUED", kIssued},
                                    {"ABORTED", kAborted}, {"BEGUN", kBegun}, {"ENDED", kEnded},
                                    {"STAMPS", kStamps}, {"RING", kRing}, {"TIMED_OUT", kTimedOut}})
    progress[name] = value;
  m.attr("PROGRESS") = progress;
}
