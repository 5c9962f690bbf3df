// The eager hot path of a planned call, in C++ (commfuse/native.py builds and loads it).
//
// Per call signature Python settles everything once: the checks, the plan, the kernel, its launch
// shape and the parameter struct's bytes with every field but the pointers filled in. What is left
// per call is here: the operands' pointers (copies of strided or misaligned ones), fresh outputs,
// the pointers patched into the bytes, then NCCL's all-reduce and/or the kernel on torch's current
// stream. In Python those steps cost tens of microseconds (tensor objects, the driver binding's
// argument conversion); here a few, most of it the driver's own.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

namespace py = pybind11;

namespace {

// Where a patched pointer comes from: a call argument, an output, or the NCCL route's sum buffer.
enum Source : int { kX = 0, kResidual = 1, kWeight = 2, kScale = 3, kOut0 = 4, kSum = 9, kSources = 10 };
constexpr int kOutputs = 5;  // residual, norm, quant, scale_factors, scales (a plain all-reduce: 1)
constexpr size_t kMaxParams = 1024;
const char* const kOutNames[kOutputs] = {"residual", "norm", "quant", "scale_factors", "scales"};

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using ErrorString = CUresult (*)(CUresult, const char**);
// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
using AllReduce = int (*)(const void*, void*, size_t, int, int, void*, void*);

// The driver entry points, from the libcuda torch has loaded already.
struct Driver {
  LaunchEx launch_ex = nullptr;
  ErrorString error_string = nullptr;
  Driver() {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) throw std::runtime_error(std::string("commfuse host launch: ") + dlerror());
    launch_ex = reinterpret_cast<LaunchEx>(dlsym(lib, "cuLaunchKernelEx"));
    error_string = reinterpret_cast<ErrorString>(dlsym(lib, "cuGetErrorString"));
    if (launch_ex == nullptr || error_string == nullptr)
      throw std::runtime_error("commfuse host launch: libcuda has no cuLaunchKernelEx");
  }
};

const Driver& driver() {
  static const Driver d;
  return d;
}

bool g_pdl = true;   // jit.disable_pdl turns programmatic dependent launch off process-wide
int g_poison = -1;   // the GPU tests' poison byte for fresh outputs (tests/compare.py), -1: none

struct NcclFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

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

// The kernels read dense rows of 16-byte vectors: a strided or misaligned operand gets a copy
// (which lives until this call returns, after the launch: the caching allocator orders its reuse
// after the kernel on this stream).
at::Tensor operand(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return address(c) % 16 ? c.clone() : c;
}

class Launcher {
 public:
  Launcher(std::string name, uintptr_t function, bool pdl, unsigned grid, unsigned block, py::bytes params,
           std::vector<std::pair<int, int>> patches, std::vector<py::object> specs, bool fused,
           uintptr_t nccl_fn, uintptr_t nccl_comm, int nccl_dtype, int64_t count, int device)
      : name_(std::move(name)), function_(reinterpret_cast<CUfunction>(function)), pdl_(pdl), grid_(grid),
        block_(block), patches_(std::move(patches)), fused_(fused),
        nccl_(reinterpret_cast<AllReduce>(nccl_fn)), nccl_comm_(reinterpret_cast<void*>(nccl_comm)),
        nccl_dtype_(nccl_dtype), count_(count), device_(device) {
    params_ = static_cast<std::string>(params);
    if (params_.size() > kMaxParams) throw std::invalid_argument(name_ + ": parameter struct too large");
    for (const auto& [offset, source] : patches_) {
      if (offset < 0 || offset + 8 > static_cast<int>(params_.size()) || offset % 8 || source < 0 ||
          source >= kSources)
        throw std::invalid_argument(name_ + ": bad pointer patch");
    }
    if (specs.size() != (fused_ ? kOutputs : 1)) throw std::invalid_argument(name_ + ": wrong number of specs");
    for (size_t i = 0; i < specs.size(); ++i) {
      if (specs[i].is_none()) continue;
      // (sizes, strides or None, storage elements, a tensor of the dtype)
      auto s = specs[i].cast<py::tuple>();
      OutSpec& o = specs_[i];
      o.present = true;
      o.sizes = s[0].cast<std::vector<int64_t>>();
      if (!s[1].is_none()) o.strides = s[1].cast<std::vector<int64_t>>();
      o.storage_numel = s[2].cast<int64_t>();
      o.dtype = tensor(s[3], "spec dtype").scalar_type();
      field_names_[i] = fused_ ? std::string("out.") + kOutNames[i] : std::string("out");
    }
    if (function_ == nullptr && nccl_ == nullptr) throw std::invalid_argument(name_ + ": nothing to launch");
    driver();  // fail at plan time, not in a call
  }

  // x, residual, weight, scale: tensors (or None where the call has none), as the plan checked them.
  // out: None, the caller's output tensor (a plain all-reduce) or an object with the five output
  // fields. Returns the output tensor, or a tuple of the five outputs (None where absent).
  py::object operator()(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out) const {
    at::Tensor t[kSources];
    call(t, x, residual, weight, scale, out);
    if (!fused_) return wrap(t[kOut0]);
    py::tuple result(kOutputs);
    for (int i = 0; i < kOutputs; ++i) result[i] = output(t, i);
    return result;
  }

  // operator()'s work, leaving the outputs in t[kOut0 + i].
  void call(at::Tensor (&t)[kSources], py::handle x, py::handle residual, py::handle weight, py::handle scale,
            py::handle out) const {
    t[kX] = tensor(x, "x");
    if (!residual.is_none()) t[kResidual] = tensor(residual, "residual");
    if (!weight.is_none()) t[kWeight] = tensor(weight, "weight");
    if (!scale.is_none()) t[kScale] = tensor(scale, "scale");
    const bool owned = !out.is_none();
    if (owned) {
      for (int i = 0; i < outputs(); ++i) {
        if (!specs_[i].present) continue;
        // The plan checked the caller's outputs' metadata, which its key holds; not their addresses.
        const std::string& field = field_names_[i];
        const py::object h = fused_ ? py::getattr(out, kOutNames[i], py::none()) : py::reinterpret_borrow<py::object>(out);
        at::Tensor& o = t[kOut0 + i];
        o = tensor(h, field.c_str());
        if (address(o) % 16) throw py::value_error(field + " must be 16-byte aligned");
        // The key holds an MN-major view's shape and strides, not the room of its storage (the kernels
        // write the padding rows too).
        if (!specs_[i].strides.empty() &&
            static_cast<int64_t>(o.storage().nbytes()) - o.storage_offset() * o.element_size() <
                specs_[i].storage_numel * o.element_size())
          throw py::value_error(field + " must be a view of a storage of " +
                                std::to_string(specs_[i].storage_numel) + " elements (padding rows included)");
      }
    }
    run(t, owned);
  }

  // Output i of a call as a Python object (None where the call has none).
  py::object output(const at::Tensor (&t)[kSources], int i) const {
    return specs_[i].present ? wrap(t[kOut0 + i]) : py::none();
  }

  // t: the operands at kX..kScale (undefined where absent) and, when owned, the caller's outputs at
  // kOut0 + i; fills in the rest and enqueues the work. Touches no Python object: the op kernels
  // call it without the GIL.
  void run(at::Tensor (&t)[kSources], bool owned) const {
    for (int i = kX; i <= kScale; ++i) {
      if (t[i].defined() && i != kScale) t[i] = operand(t[i]);
    }
    for (int i = 0; i < outputs() && !owned; ++i) {
      if (specs_[i].present) t[kOut0 + i] = allocate(specs_[i]);
    }
    if (nccl_ != nullptr) {
      // NCCL writes the sum into the residual output, which the tail then updates in place; a
      // scratch buffer where that output is the residual input itself.
      at::Tensor& sum = t[kSum];
      sum = owned && fused_ && address(t[kOut0]) == address(t[kResidual]) ? allocate(specs_[0]) : t[kOut0];
      const int rc = nccl_(t[kX].data_ptr(), sum.data_ptr(), static_cast<size_t>(count_), nccl_dtype_, 0,
                           nccl_comm_, stream());
      if (rc != 0) throw NcclFailure(std::to_string(rc));
    }
    if (function_ != nullptr) launch(t);
  }

  bool fused() const { return fused_; }
  bool present(int i) const { return specs_[i].present; }

 private:
  int outputs() const { return fused_ ? kOutputs : 1; }
  cudaStream_t stream() const { return c10::cuda::getCurrentCUDAStream(device_).stream(); }

  at::Tensor allocate(const OutSpec& s) const {
    // at::detail::empty_cuda is at::empty's CUDA kernel, called without the dispatcher's round trip.
    const int64_t flat[1] = {s.storage_numel};
    at::Tensor o = at::detail::empty_cuda(s.strides.empty() ? at::IntArrayRef(s.sizes) : at::IntArrayRef(flat),
                                          s.dtype, at::Device(at::kCUDA, device_), std::nullopt);
    if (g_poison >= 0) o.view(at::kByte).fill_(g_poison);
    return s.strides.empty() ? o : o.as_strided(s.sizes, s.strides);
  }

  void launch(const at::Tensor (&t)[kSources]) const {
    alignas(16) char buf[kMaxParams];
    std::memcpy(buf, params_.data(), params_.size());
    for (const auto& [offset, source] : patches_) {
      const uintptr_t p = t[source].defined() ? address(t[source]) : 0;
      std::memcpy(buf + offset, &p, sizeof p);
    }
    // The module was loaded in the device's primary context: launch with that device current.
    c10::cuda::OptionalCUDAGuard guard;
    if (c10::cuda::current_device() != device_) guard.set_index(device_);
    CUlaunchAttribute attr{};
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig config{};
    config.gridDimX = grid_;
    config.gridDimY = config.gridDimZ = 1;
    config.blockDimX = block_;
    config.blockDimY = config.blockDimZ = 1;
    config.hStream = reinterpret_cast<CUstream>(stream());
    config.attrs = &attr;
    config.numAttrs = pdl_ && g_pdl ? 1 : 0;
    void* args[1] = {buf};
    const CUresult rc = driver().launch_ex(&config, function_, args, nullptr);
    if (rc != CUDA_SUCCESS) {
      const char* text = nullptr;
      driver().error_string(rc, &text);
      throw std::runtime_error("launch of " + name_ + " grid=(" + std::to_string(grid_) + ",) block=(" +
                               std::to_string(block_) + ",) on cuda:" + std::to_string(device_) + ": " +
                               (text ? text : "unknown error") + " (" + std::to_string(rc) + ")");
    }
  }

  std::string name_;
  CUfunction function_;
  bool pdl_;
  unsigned grid_, block_;
  std::string params_;
  std::vector<std::pair<int, int>> patches_;
  OutSpec specs_[kOutputs];
  std::string field_names_[kOutputs];  // for the caller-owned outputs' errors: "out.norm" (or "out")
  bool fused_;
  AllReduce nccl_;
  void* nccl_comm_;
  int nccl_dtype_;
  int64_t count_;
  int device_;
};

// The plan cache's hot half: per call signature (what the Python cache key holds: each tensor's
// dtype, device, shape and strides, the caller's outputs' too, and the scalar arguments) the plan
// object and its launcher. A hit costs the key (a few hundred bytes appended, hashed) instead of
// building and hashing a tuple of tensor metadata in Python (~2.5 us of a call on an H200 host).
// Anything the key cannot hold (a Python float scale, a non-tensor output, an unusual argument type)
// is a miss: the Python path then checks and plans as always.
class Table;

// The op kernels run without the GIL (torch.ops releases it), so the tables and the registry that
// finds a communicator's table by its name are guarded by one mutex, held for lookups and updates
// only: a launch runs on a shared_ptr copy of its launcher (immutable, so launches may overlap), and
// nobody runs Python or waits for the GIL while holding it.
// Leaked on purpose: a Table still alive at exit must not find them destroyed.
std::mutex& g_mutex = *new std::mutex;
std::unordered_map<std::string, Table*>& g_tables = *new std::unordered_map<std::string, Table*>;

class Table {
 public:
  // name: the communicator's commfuse.ops name (the ops' `comm` argument).
  // result_type: FusedResult, a class with __slots__ for the five outputs and the plan.
  Table(py::object result_type, uintptr_t error_word, std::string name)
      : result_type_(std::move(result_type)), error_word_(reinterpret_cast<volatile int*>(error_word)),
        name_(std::move(name)) {
    if (!PyType_Check(result_type_.ptr())) throw py::type_error("Table: result_type must be a class");
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

  // COMMFUSE_CHECK's per-call cross-rank check runs in Python: while it is on, the op kernels hand
  // every call to the Python op.
  void set_check_calls(bool on) {
    std::lock_guard<std::mutex> lock(g_mutex);
    check_calls_ = on;
  }

  // The op kernels' lookup: under g_mutex, the launcher of `key` if it may serve the call.
  std::shared_ptr<const Launcher> op_launcher(const std::string& key) const {
    if (check_calls_ || error_pending()) return nullptr;
    const auto it = entries_.find(key);
    return it == entries_.end() ? nullptr : it->second.launcher;
  }

  // Communicator.fused_all_reduce's arguments; the FusedResult, or None on a miss (or a P2P error
  // pending, which the Python path raises).
  py::object fused(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
                   py::handle eps, py::handle quant, py::handle return_norm, py::handle sf_layout,
                   py::handle weight_offset, py::handle scale_layout, py::handle scale_ue8m0) {
    std::string key;
    if (!fused_key(key, x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, scale_ue8m0))
      return py::none();
    py::object plan;
    std::shared_ptr<const Launcher> launcher;
    {
      // Only the lookup under the mutex: the launch runs Python (the out fields' getattr, a collection
      // at an allocation), which may switch threads or clear the table.
      std::lock_guard<std::mutex> lock(g_mutex);
      const auto it = entries_.find(key);
      if (it == entries_.end() || error_pending()) return py::none();
      plan = it->second.plan;
      launcher = it->second.launcher;
    }
    at::Tensor t[kSources];
    launcher->call(t, x, residual, weight, scale, out);
    // The result's slots set directly: a hit runs no Python frame (FusedResult's __init__ would be one).
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>(result_type_.ptr());
    py::object result = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
    if (!result) throw py::error_already_set();
    for (int i = 0; i <= kOutputs; ++i) {
      const py::object v = i < kOutputs ? launcher->output(t, i) : plan;
      if (PyObject_SetAttr(result.ptr(), fields_[i].ptr(), v.ptr()) < 0) throw py::error_already_set();
    }
    return result;
  }

  // Communicator.all_reduce's: the sum, or None on a miss.
  py::object plain(py::handle x, py::handle out) {
    std::string key;
    if (!plain_key(key, x, out)) return py::none();
    std::shared_ptr<const Launcher> launcher;
    {
      std::lock_guard<std::mutex> lock(g_mutex);  // as in fused()
      const auto it = entries_.find(key);
      if (it == entries_.end() || error_pending()) return py::none();
      launcher = it->second.launcher;
    }
    return (*launcher)(x, py::none(), py::none(), py::none(), out);
  }

  // The same arguments, then the plan and its launcher; false where the key cannot hold the call.
  bool insert_fused(py::handle x, py::handle residual, py::handle weight, py::handle scale, py::handle out,
                    py::handle eps, py::handle quant, py::handle return_norm, py::handle sf_layout,
                    py::handle weight_offset, py::handle scale_layout, py::handle scale_ue8m0, py::object plan,
                    py::object launcher) {
    std::string key;
    if (!fused_key(key, x, residual, weight, scale, out, eps, quant, return_norm, sf_layout, weight_offset,
                   scale_layout, scale_ue8m0))
      return false;
    return insert(std::move(key), std::move(plan), std::move(launcher));
  }

  bool insert_plain(py::handle x, py::handle out, py::object plan, py::object launcher) {
    std::string key;
    if (!plain_key(key, x, out)) return false;
    return insert(std::move(key), std::move(plan), std::move(launcher));
  }

  void clear() {
    std::unordered_map<std::string, Entry> old;  // destroyed after the unlock: a plan's release may run Python
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      old.swap(entries_);
    }
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(g_mutex);
    return entries_.size();
  }

  // The keys of the op kernels' calls: the same bytes as fused_key / plain_key of the Python call the
  // op makes (commfuse.ops: quant "" is None, no caller-owned outputs).
  static std::string op_fused_key(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& scale, double eps, std::string_view quant,
                                  bool return_norm, std::string_view sf_layout, double weight_offset,
                                  std::string_view scale_layout, bool scale_ue8m0) {
    std::string key;
    key.reserve(256);
    put(key, 'F');
    put_tensor(key, x);
    put_tensor(key, residual);
    put_tensor(key, weight);
    if (scale.has_value()) {
      put(key, 't');
      put_tensor(key, *scale);
    } else {
      put(key, 'n');
    }
    put(key, 'n');  // out=None
    put(key, eps);
    if (quant.empty()) {
      put(key, static_cast<int32_t>(-1));
    } else {
      put_chars(key, quant);
    }
    put(key, return_norm);
    put_chars(key, sf_layout);
    put(key, weight_offset);
    put_chars(key, scale_layout);
    put(key, scale_ue8m0);
    return key;
  }

  static std::string op_plain_key(const at::Tensor& x) {
    std::string key;
    put(key, 'P');
    put_tensor(key, x);
    put(key, 'n');
    return key;
  }

 private:
  struct Entry {
    py::object plan;
    std::shared_ptr<const Launcher> launcher;
  };

  bool insert(std::string key, py::object plan, py::object launcher) {
    Entry entry{std::move(plan), launcher.cast<std::shared_ptr<Launcher>>()};
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      std::swap(entries_[std::move(key)], entry);
    }
    return true;  // a replaced entry is released here, after the unlock (as in clear())
  }

  bool error_pending() const { return error_word_ != nullptr && *error_word_ != 0; }

  template <typename V>
  static void put(std::string& key, V v) {
    key.append(reinterpret_cast<const char*>(&v), sizeof v);
  }

  static bool put_tensor(std::string& key, py::handle h) {
    if (!THPVariable_Check(h.ptr())) return false;
    put_tensor(key, THPVariable_Unpack(h.ptr()));
    return true;
  }

  static void put_chars(std::string& key, std::string_view text) {
    put(key, static_cast<int32_t>(text.size()));
    key.append(text.data(), text.size());
  }

  static void put_tensor(std::string& key, const at::Tensor& t) {
    put(key, static_cast<int8_t>(t.scalar_type()));
    put(key, static_cast<int8_t>(t.device().type()));
    put(key, static_cast<int8_t>(t.device().index()));
    put(key, static_cast<int8_t>(t.dim()));
    for (const int64_t v : t.sizes()) put(key, v);
    for (const int64_t v : t.strides()) put(key, v);
  }

  static bool put_optional_tensor(std::string& key, py::handle h) {
    if (h.is_none()) {
      put(key, 'n');
      return true;
    }
    put(key, 't');
    return put_tensor(key, h);
  }

  static bool put_number(std::string& key, py::handle h) {
    double v;
    if (PyFloat_CheckExact(h.ptr())) {
      v = PyFloat_AS_DOUBLE(h.ptr());
    } else if (PyLong_CheckExact(h.ptr())) {
      v = PyLong_AsDouble(h.ptr());
      if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    } else {
      return false;
    }
    put(key, v);
    return true;
  }

  static bool put_bool(std::string& key, py::handle h) {
    if (h.ptr() != Py_True && h.ptr() != Py_False) return false;
    put(key, h.ptr() == Py_True);
    return true;
  }

  static bool put_string(std::string& key, py::handle h) {  // a str, or None
    if (h.is_none()) {
      put(key, static_cast<int32_t>(-1));
      return true;
    }
    if (!PyUnicode_CheckExact(h.ptr())) return false;
    Py_ssize_t n = 0;
    const char* text = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
    if (text == nullptr) {
      PyErr_Clear();
      return false;
    }
    put_chars(key, std::string_view(text, static_cast<size_t>(n)));
    return true;
  }

  static bool fused_key(std::string& key, py::handle x, py::handle residual, py::handle weight, py::handle scale,
                        py::handle out, py::handle eps, py::handle quant, py::handle return_norm,
                        py::handle sf_layout, py::handle weight_offset, py::handle scale_layout,
                        py::handle scale_ue8m0) {
    key.reserve(256);
    put(key, 'F');
    if (!put_tensor(key, x) || !put_tensor(key, residual) || !put_tensor(key, weight) ||
        !put_optional_tensor(key, scale))
      return false;
    if (out.is_none()) {
      put(key, 'n');
    } else {
      put(key, 'o');
      for (const char* name : kOutNames) {
        if (!put_optional_tensor(key, py::getattr(out, name, py::none()))) return false;
      }
    }
    return put_number(key, eps) && put_string(key, quant) && put_bool(key, return_norm) &&
           put_string(key, sf_layout) && put_number(key, weight_offset) && put_string(key, scale_layout) &&
           put_bool(key, scale_ue8m0);
  }

  static bool plain_key(std::string& key, py::handle x, py::handle out) {
    put(key, 'P');
    return put_tensor(key, x) && put_optional_tensor(key, out);
  }

  py::object result_type_;
  py::object fields_[kOutputs + 1];  // its field names, interned
  volatile int* error_word_;
  std::string name_;
  bool check_calls_ = true;
  std::unordered_map<std::string, Entry> entries_;
};

// commfuse::fused_all_reduce and commfuse::all_reduce for CUDA tensors (the Python kernels in
// commfuse/ops.py stay the ones of every other device, and of a CUDA call the table cannot serve:
// torch's dispatcher calling a Python kernel costs ~12 us of host time a call on an H200 host).
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

at::Tensor wrap_back(py::handle h) { return THPVariable_Unpack(h.ptr()); }

// Runs the launcher of `key` in `comm`'s table on t (the operands); false where there is none.
bool run_op(std::string_view comm, const std::string& key, at::Tensor (&t)[kSources]) {
  std::shared_ptr<const Launcher> launcher;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto table = g_tables.find(std::string(comm));
    if (table == g_tables.end()) return false;
    launcher = table->second->op_launcher(key);
  }
  if (launcher == nullptr) return false;
  try {
    launcher->run(t, false);
  } catch (const NcclFailure& e) {
    throw std::runtime_error(std::string("ncclAllReduce failed: ncclResult_t ") + e.what());
  }
  return true;
}

Outputs fused_all_reduce_op(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                            const std::optional<at::Tensor>& scale, double eps, std::string_view quant,
                            bool return_norm, std::string_view sf_layout, std::string_view comm, double weight_offset,
                            std::string_view scale_layout, bool scale_ue8m0) {
  at::Tensor t[kSources];
  t[kX] = x;
  t[kResidual] = residual;
  t[kWeight] = weight;
  if (scale.has_value()) t[kScale] = *scale;
  const std::string key = Table::op_fused_key(x, residual, weight, scale, eps, quant, return_norm, sf_layout,
                                              weight_offset, scale_layout, scale_ue8m0);
  if (run_op(comm, key, t)) {
    // An op returns tensors, never None: absent outputs are empty, each its own (as commfuse/ops.py).
    for (int i = 1; i < kOutputs; ++i) {
      if (!t[kOut0 + i].defined()) t[kOut0 + i] = at::detail::empty_cuda({0}, x.scalar_type(), x.device(), std::nullopt);
    }
    return {t[kOut0], t[kOut0 + 1], t[kOut0 + 2], t[kOut0 + 3], t[kOut0 + 4]};
  }
  py::gil_scoped_acquire gil;
  const py::tuple r = py::module_::import("commfuse.ops").attr("_fused_all_reduce")(
      wrap(x), wrap(residual), wrap(weight), scale.has_value() ? wrap(*scale) : py::none(), eps, std::string(quant),
      return_norm, std::string(sf_layout), std::string(comm), weight_offset, std::string(scale_layout), scale_ue8m0);
  return {wrap_back(r[0]), wrap_back(r[1]), wrap_back(r[2]), wrap_back(r[3]), wrap_back(r[4])};
}

at::Tensor all_reduce_op(const at::Tensor& x, std::string_view comm) {
  at::Tensor t[kSources];
  t[kX] = x;
  if (run_op(comm, Table::op_plain_key(x), t)) return t[kOut0];
  py::gil_scoped_acquire gil;
  return wrap_back(py::module_::import("commfuse.ops").attr("_all_reduce")(wrap(x), std::string(comm)));
}

}  // namespace

TORCH_LIBRARY_IMPL(commfuse, CUDA, m) {
  m.impl("fused_all_reduce", fused_all_reduce_op);
  m.impl("all_reduce", all_reduce_op);
}

PYBIND11_MODULE(commfuse_host, m) {
  m.doc() = "commfuse's eager hot path (csrc/host_launch.cpp)";
  py::register_exception<NcclFailure>(m, "NcclFailure", PyExc_RuntimeError);
  py::class_<Launcher, std::shared_ptr<Launcher>>(m, "Launcher")
      .def(py::init<std::string, uintptr_t, bool, unsigned, unsigned, py::bytes, std::vector<std::pair<int, int>>,
                    std::vector<py::object>, bool, uintptr_t, uintptr_t, int, int64_t, int>())
      .def("__call__", &Launcher::operator());
  py::class_<Table>(m, "Table")
      .def(py::init<py::object, uintptr_t, std::string>())
      .def("set_check_calls", &Table::set_check_calls)
      .def("fused", &Table::fused)
      .def("plain", &Table::plain)
      .def("insert_fused", &Table::insert_fused)
      .def("insert_plain", &Table::insert_plain)
      .def("clear", &Table::clear)
      .def("__len__", &Table::size);
  m.def("set_pdl", [](bool on) { g_pdl = on; });
  m.def("set_poison", [](int byte) { g_poison = byte; });
}
