// The fake device's allocator hook: counts the CPU allocations made while a fake device is
// active on the calling thread, below dispatch (no Python per operator).
//
// See Note [Counting device memory with allocations] in tracking.py. In short: torch's CPU
// allocator is wrapped once per process (c10::SetCPUAllocator with a priority above the
// default's). An allocation an operator makes while the calling thread has a Ledger installed
// (set_current) is charged to that ledger, capacity-checked (over capacity: the ledger's
// Python out-of-memory factory builds the exception, raised through torch as a
// python_error), optionally poisoned with 0xFF bytes (the sanitizer), and handed out with a
// deleter that credits the ledger when the memory is really freed (its StorageImpl died, or
// a resize_ replaced it), from whatever thread. Any other allocation is the previous
// allocator's, untouched.

#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace {

// A Python number as a tensor has one element: at most a complex128.
constexpr size_t kScalarBytes = 16;

struct Ledger {
  Ledger(int64_t capacity, bool poison, pybind11::object oom)
      : capacity(capacity), poison(poison), oom(std::move(oom)) {}

  // The last reference may die in a deleter on a thread without the GIL (a storage freed
  // inside an operator): release the Python callable under the GIL.
  ~Ledger() {
    if (oom && Py_IsInitialized()) {
      pybind11::gil_scoped_acquire gil;
      oom = pybind11::object();
    } else {
      oom.release();  // the interpreter is gone: leak the reference rather than touch it
    }
  }

  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // All fit, or nothing is charged. ``pending``: a small allocation made while a Python
  // number is in use on the thread (see commit()); it does not raise the peak yet.
  bool try_add(int64_t nbytes, int64_t count, bool pending = false) {
    return charge(nbytes, count, pending) != kRefused;
  }

  // try_add for the hook: the generation a pending allocation belongs to (read under the same
  // lock, so a commit() cannot come in between), -1 for others, kRefused when it does not fit.
  static constexpr int64_t kRefused = -2;
  int64_t charge(int64_t nbytes, int64_t count, bool pending) {
    std::lock_guard<std::mutex> guard(mu);
    if (current + nbytes > capacity) {
      return kRefused;
    }
    current += nbytes;
    allocations += count;
    if (pending) {
      pending_bytes += nbytes;
      return generation;
    }
    if (current - pending_bytes > peak) {
      peak = current - pending_bytes;
    }
    return -1;
  }

  void add(int64_t nbytes, int64_t count) {
    std::lock_guard<std::mutex> guard(mu);
    current += nbytes;
    allocations += count;
    if (current - pending_bytes > peak) {
      peak = current - pending_bytes;
    }
  }

  // ``generation``: that of a pending allocation (-1: not pending).
  void sub(int64_t nbytes, int64_t count, int64_t of_generation = -1) {
    std::lock_guard<std::mutex> guard(mu);
    current -= nbytes;
    allocations -= count;
    if (of_generation == generation) {
      pending_bytes -= nbytes;
    }
  }

  // The Python numbers in use died (the operators using them returned): the pending
  // allocations still alive were outputs, not the operator's dtype casts of the number
  // (``x.mul_(2)`` on a float tensor casts 2 to a one-element float tensor inside the
  // operator: host memory on CUDA, where the number stays on the host), so they count.
  void commit() {
    std::lock_guard<std::mutex> guard(mu);
    pending_bytes = 0;
    generation += 1;
    if (current > peak) {
      peak = current;
    }
  }

  // What has been live is the peak (the pending bytes too: they are live now).
  int64_t read_peak() {
    std::lock_guard<std::mutex> guard(mu);
    if (current > peak) {
      peak = current;
    }
    return peak;
  }

  std::mutex mu;
  int64_t capacity;
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocations = 0;
  int64_t pending_bytes = 0;  // live bytes of pending allocations of this generation
  int64_t generation = 0;
  bool poison;
  pybind11::object oom;  // oom(requested_bytes, allocated_bytes) -> exception instance
};

enum class Kind : uint8_t { Counted, Pending, Scalar };

// The Python numbers of a thread that are *fresh*: made (wrapped as tensors) since the
// thread's last counted allocation of more than kScalarBytes, and alive. A number autograd
// saves for backward stops being fresh at the next such allocation, so it does not make the
// rest of the forward's small tensors pending.
struct Fresh {
  std::atomic<int64_t> count{0};
  std::atomic<int64_t> epoch{0};
};

struct Entry {
  std::shared_ptr<Ledger> ledger;
  size_t nbytes;
  Kind kind;
  int64_t generation;  // Pending: the ledger's generation at allocation
  std::shared_ptr<Fresh> fresh;  // Scalar: its thread's fresh Python numbers
  int64_t epoch;                 // Scalar: that thread's epoch when it was made
  c10::DeleterFnPtr deleter;
};

std::mutex g_mu;  // guards g_live and g_host
std::unordered_map<void*, Entry> g_live;

// Note [Host buffers the hook knows]: the device's host buffers (its arena's pinned and pageable owners)
// by data pointer, with their StorageImpl, so small_pair can tell a host side without a Python lookup.
// Marked when the arena starts counting one, unmarked when it forgets it (the storage died); a storage
// whose data moved (resize_) or an address reused by another StorageImpl is simply not found.
// (A mark does not keep its device's ledger alive: an arena collected before its host buffers never
// unmarks them, and an expired ledger matches no device.)
struct HostMark {
  std::weak_ptr<Ledger> ledger;
  const c10::StorageImpl* impl;
};
std::unordered_map<void*, HostMark> g_host;
c10::Allocator* g_previous = nullptr;

thread_local std::shared_ptr<Ledger> tl_ledger;
thread_local std::shared_ptr<Fresh> tl_fresh = std::make_shared<Fresh>();

[[noreturn]] void raise_out_of_memory(const std::shared_ptr<Ledger>& ledger, size_t nbytes) {
  pybind11::gil_scoped_acquire gil;
  int64_t allocated = 0;
  {
    std::lock_guard<std::mutex> guard(ledger->mu);
    allocated = ledger->current;
  }
  PyObject* exc = PyObject_CallFunction(ledger->oom.ptr(), "nL", static_cast<Py_ssize_t>(nbytes),
                                        static_cast<long long>(allocated));
  if (exc != nullptr) {
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
    Py_DECREF(exc);
  }
  python_error err;
  err.persist();
  throw std::move(err);
}

void tracked_delete(void* ptr) {
  Entry entry;
  bool found = false;
  {
    std::lock_guard<std::mutex> guard(g_mu);
    auto it = g_live.find(ptr);
    if (it != g_live.end()) {
      entry = std::move(it->second);
      g_live.erase(it);
      found = true;
    }
  }
  if (!found) {  // not ours (raw_deallocate of an allocation made while no ledger was installed)
    c10::DeleterFnPtr previous = g_previous->raw_deleter();
    TORCH_INTERNAL_ASSERT(previous != nullptr);
    previous(ptr);
    return;
  }
  if (entry.kind == Kind::Scalar) {
    Fresh& fresh = *entry.fresh;
    if (entry.epoch == fresh.epoch.load() && fresh.count.fetch_sub(1) == 1) {
      entry.ledger->commit();  // the operators using the fresh numbers returned
    }
  } else {
    entry.ledger->sub(static_cast<int64_t>(entry.nbytes), 1, entry.kind == Kind::Pending ? entry.generation : -1);
  }
  entry.deleter(ptr);
}

// A Python number the frontend wraps as a one-element CPU tensor to pass it to an operator
// (``x * 2``, ``x.mul_(2)``, ``x[0] = 3``; also inside operators): made under
// at::tracer::impl::NoTracerDispatchMode (Tracer excluded) but, unlike ``torch.tensor(data)``,
// with Python dispatch still enabled. On CUDA such scalars stay on the host.
bool python_number(size_t nbytes, c10::DispatchKeySet excluded) {
  return nbytes <= kScalarBytes && excluded.has(c10::DispatchKey::Tracer) && !excluded.has(c10::DispatchKey::Python);
}

// Python-level code holding the GIL outside any operator (torch.get_rng_state(), an
// UntypedStorage constructed directly) makes host tensors. Inside an operator called from
// Python the GIL is released, or (``torch.tensor(data)``, kernels below autograd) the
// ADInplaceOrView key is excluded.
bool outside_operators(c10::DispatchKeySet excluded) {
  return PyGILState_Check() && !excluded.has(c10::DispatchKey::ADInplaceOrView);
}

struct HookAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const std::shared_ptr<Ledger>& ledger = tl_ledger;
    if (!ledger || nbytes == 0) {
      return g_previous->allocate(nbytes);
    }
    c10::DispatchKeySet excluded = c10::impl::tls_local_dispatch_key_set().excluded_;
    if (python_number(nbytes, excluded)) {
      return track(g_previous->allocate(nbytes), nbytes, Kind::Scalar, ledger);
    }
    if (outside_operators(excluded)) {
      return g_previous->allocate(nbytes);
    }
    bool pending = nbytes <= kScalarBytes && tl_fresh->count.load() > 0;
    if (nbytes > kScalarBytes && tl_fresh->count.load() > 0) {  // the fresh numbers are not fresh any more
      tl_fresh->epoch.fetch_add(1);
      tl_fresh->count.store(0);
    }
    int64_t n = static_cast<int64_t>(nbytes);
    int64_t generation = ledger->charge(n, 1, pending);
    if (generation == Ledger::kRefused) {
      raise_out_of_memory(ledger, nbytes);
    }
    c10::DataPtr inner;
    try {
      inner = g_previous->allocate(nbytes);
    } catch (...) {
      ledger->sub(n, 1, generation);
      throw;
    }
    if (ledger->poison && inner.get() != nullptr) {
      std::memset(inner.get(), 0xFF, nbytes);  // Note [What the sanitizer poisons, and when], point 2
    }
    return track(std::move(inner), nbytes, pending ? Kind::Pending : Kind::Counted, ledger, generation);
  }

  // Hands out ``inner`` with a deleter that credits ``ledger`` (Counted, Pending) or counts the
  // Python number down (Scalar) when the memory is freed.
  static c10::DataPtr track(c10::DataPtr inner, size_t nbytes, Kind kind, const std::shared_ptr<Ledger>& ledger,
                           int64_t generation = -1) {
    void* data = inner.get();
    if (data == nullptr || data != inner.get_context()) {  // not a plain pointer: never happens on the CPU
      if (kind != Kind::Scalar) {
        ledger->sub(static_cast<int64_t>(nbytes), 1, generation);
      }
      return inner;
    }
    std::shared_ptr<Fresh> fresh;
    int64_t epoch = 0;
    if (kind == Kind::Scalar) {
      fresh = tl_fresh;
      epoch = fresh->epoch.load();
      fresh->count.fetch_add(1);
    }
    c10::DeleterFnPtr deleter = inner.get_deleter();
    c10::Device device = inner.device();
    inner.release_context();
    {
      std::lock_guard<std::mutex> guard(g_mu);
      g_live[data] = Entry{ledger, nbytes, kind, generation, std::move(fresh), epoch, deleter};
    }
    return c10::DataPtr(data, data, &tracked_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return g_previous->raw_deleter() ? &tracked_delete : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

HookAllocator g_hook;

void install() {
  if (g_previous != nullptr) {
    return;
  }
  g_previous = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&g_hook, /*priority=*/100);
}

bool installed() {
  return g_previous != nullptr && c10::GetCPUAllocator() == &g_hook;
}

void set_current(std::shared_ptr<Ledger> ledger) {
  tl_ledger = std::move(ledger);
}

std::shared_ptr<Ledger> get_current() {
  return tl_ledger;
}

bool owns(const std::shared_ptr<Ledger>& ledger, uintptr_t address) {
  std::lock_guard<std::mutex> guard(g_mu);
  auto it = g_live.find(reinterpret_cast<void*>(address));
  return it != g_live.end() && it->second.ledger == ledger && it->second.kind != Kind::Scalar;
}

// dev.adopt(..) of a storage torch's allocator made before (a model built on the host): from now
// on its memory is counted like a hooked allocation of ``ledger`` -- its DataPtr is swapped for
// one with the tracking deleter, so the ledger is credited when the memory is really freed (the
// storage dies, or ``resize_`` replaces or frees it), and its allocator becomes the hook, so a
// ``resize_`` that grows it inside ``with dev:`` is counted. The caller has already charged the
// ledger for ``nbytes`` (one allocation). False (nothing changed) for memory torch did not
// allocate (not resizable: from_numpy, frombuffer, DLPack), an empty storage or one the hook
// already tracks: the arena counts those by weak reference, as before.
bool adopt(const std::shared_ptr<Ledger>& ledger, const at::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (impl == nullptr || !impl->resizable() || impl->nbytes() == 0 ||
      impl->device_type() != c10::DeviceType::CPU) {
    return false;
  }
  const c10::DataPtr& current = impl->data_ptr();
  void* data = current.get();
  if (data == nullptr || data != current.get_context() || current.get_deleter() == &tracked_delete) {
    return false;
  }
  size_t nbytes = impl->nbytes();
  c10::Device device = current.device();
  {
    std::lock_guard<std::mutex> guard(g_mu);
    if (g_live.count(data) != 0) {
      return false;
    }
    // Registered before the swap: the storage (held by the caller) cannot be freed meanwhile.
    g_live[data] = Entry{ledger, nbytes, Kind::Counted, -1, nullptr, 0, current.get_deleter()};
  }
  c10::DataPtr previous = impl->set_data_ptr(c10::DataPtr(data, data, &tracked_delete, device));
  previous.release_context();  // the memory now belongs to the tracked DataPtr
  if (impl->allocator() == g_previous) {
    impl->set_allocator(&g_hook);
  }
  return true;
}

// Note [The small copy's fast path] (copying.py), its checks in one call: TorchBuffers.small_pair's
// questions of two tensors (each side plain -- strided, neither nested, quantized, meta, functorch-wrapped
// nor functional -- and contiguous, the same byte count of at most ``limit``, the source neither a lazy conj
// nor neg view, each inside its storage's bytes), asked of the TensorImpls without a Python call per
// question, plus which side the allocator hook counts on ``ledger`` (``owns`` of each storage's data
// pointer) and which side is one of the device's host buffers (Note [Host buffers the hook knows]). Both
// must be exactly ``torch.Tensor`` (no subclass). None: declined (the general path checks again and
// reports); else (nbytes, dst address, src address, known): known's bits 0 and 1 say the destination, the
// source is device memory, bits 2 and 3 that it is a host buffer (neither: ask the arena).
bool plain_contiguous(const at::Tensor& t) {
  if (!t.defined() || t.layout() != c10::kStrided || !t.has_storage()) {
    return false;
  }
  c10::DispatchKeySet keys = t.key_set();
  if (keys.has(c10::DispatchKey::Functionalize) || keys.has(c10::DispatchKey::FuncTorchGradWrapper) ||
      keys.has(c10::DispatchKey::FuncTorchBatched) || keys.has(c10::DispatchKey::BatchedNestedTensor) ||
      keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Meta)) {
    return false;
  }
  return !t.is_nested() && !t.is_quantized() && !t.is_meta() && t.device().is_cpu() && t.is_contiguous();
}

pybind11::object small_pair(const std::shared_ptr<Ledger>& ledger, int64_t limit, pybind11::handle dst_object,
                            pybind11::handle src_object) {
  // exactly torch.Tensor (no subclass: its TensorImpl is all there is to it)
  PyTypeObject* tensor_type = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  if (tensor_type == nullptr || Py_TYPE(dst_object.ptr()) != tensor_type || Py_TYPE(src_object.ptr()) != tensor_type) {
    return pybind11::none();
  }
  const at::Tensor& dst = THPVariable_Unpack(dst_object.ptr());
  const at::Tensor& src = THPVariable_Unpack(src_object.ptr());
  if (!plain_contiguous(dst) || !plain_contiguous(src) || src.is_conj() || src.is_neg()) {
    return pybind11::none();
  }
  int64_t nbytes = static_cast<int64_t>(dst.nbytes());
  if (nbytes > limit || nbytes != static_cast<int64_t>(src.nbytes())) {
    return pybind11::none();
  }
  const c10::Storage& dst_storage = dst.storage();
  const c10::Storage& src_storage = src.storage();
  // a contiguous tensor's bytes start storage_offset * element_size into its storage
  int64_t dst_start = dst.storage_offset() * static_cast<int64_t>(dst.element_size());
  int64_t src_start = src.storage_offset() * static_cast<int64_t>(src.element_size());
  if (nbytes != 0 && (dst_start + nbytes > static_cast<int64_t>(dst_storage.nbytes()) ||
                      src_start + nbytes > static_cast<int64_t>(src_storage.nbytes()))) {
    return pybind11::none();  // a freed or shrunk storage: the general path raises
  }
  // the addresses Python's data_ptr() gives (the destination's as written to: a lazily cloned storage is
  // materialised first), then the storages' own, which the hook knows its allocations by
  uintptr_t dst_address = reinterpret_cast<uintptr_t>(dst.mutable_data_ptr());
  uintptr_t src_address = reinterpret_cast<uintptr_t>(src.const_data_ptr());
  void* dst_base = dst_storage.unsafeGetStorageImpl()->data_ptr().get();
  void* src_base = src_storage.unsafeGetStorageImpl()->data_ptr().get();
  int known = 0;
  {
    std::lock_guard<std::mutex> guard(g_mu);
    for (int side = 0; side < 2; ++side) {
      void* base = side == 0 ? dst_base : src_base;
      if (base == nullptr) {
        continue;
      }
      auto it = g_live.find(base);
      if (it != g_live.end() && it->second.ledger == ledger && it->second.kind != Kind::Scalar) {
        known |= 1 << side;  // device memory
        continue;
      }
      const c10::StorageImpl* impl = (side == 0 ? dst_storage : src_storage).unsafeGetStorageImpl();
      auto host = g_host.find(base);
      if (host != g_host.end() && host->second.impl == impl && host->second.ledger.lock() == ledger) {
        known |= 4 << side;  // one of the device's host buffers
      }
    }
  }
  return pybind11::make_tuple(nbytes, dst_address, src_address, known);
}

// Note [Host buffers the hook knows]: the data pointer marked (0: none, an empty storage).
uintptr_t mark_host(const std::shared_ptr<Ledger>& ledger, const at::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  if (impl == nullptr || impl->device_type() != c10::DeviceType::CPU) {
    return 0;
  }
  void* base = impl->data_ptr().get();
  if (base == nullptr) {
    return 0;
  }
  std::lock_guard<std::mutex> guard(g_mu);
  g_host[base] = HostMark{ledger, impl};
  return reinterpret_cast<uintptr_t>(base);
}

void unmark_host(const std::shared_ptr<Ledger>& ledger, uintptr_t address) {
  std::lock_guard<std::mutex> guard(g_mu);
  auto it = g_host.find(reinterpret_cast<void*>(address));
  if (it == g_host.end()) {
    return;
  }
  std::shared_ptr<Ledger> owner = it->second.ledger.lock();
  if (owner == nullptr || owner == ledger) {  // this device's mark, or one a collected device left behind
    g_host.erase(it);
  }
}

// memmove without releasing the GIL (Note [Small copies keep the GIL] in torch_buffers.py)
void move_bytes(uintptr_t dst, uintptr_t src, size_t nbytes) {
  std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
}

int64_t locked(Ledger& ledger, int64_t Ledger::*field) {
  std::lock_guard<std::mutex> guard(ledger.mu);
  return ledger.*field;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Ledger, std::shared_ptr<Ledger>>(m, "Ledger")
      .def(py::init<int64_t, bool, py::object>(), py::arg("capacity"), py::arg("poison"), py::arg("oom"))
      .def("try_add", &Ledger::try_add, py::arg("nbytes"), py::arg("count") = 1, py::arg("pending") = false)
      .def("add", &Ledger::add, py::arg("nbytes"), py::arg("count") = 1)
      .def("sub", &Ledger::sub, py::arg("nbytes"), py::arg("count") = 1, py::arg("of_generation") = -1)
      .def("current", [](Ledger& l) { return locked(l, &Ledger::current); })
      .def("peak", &Ledger::read_peak)
      .def("allocations", [](Ledger& l) { return locked(l, &Ledger::allocations); })
      .def("reset_peak", [](Ledger& l) {
        std::lock_guard<std::mutex> guard(l.mu);
        l.peak = l.current;
        l.pending_bytes = 0;
        l.generation += 1;
      })
      .def_readonly("capacity", &Ledger::capacity)
      .def_readonly("poison", &Ledger::poison);
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("set_current", &set_current, py::arg("ledger").none(true));
  m.def("get_current", &get_current);
  m.def("owns", &owns, py::arg("ledger"), py::arg("address"));
  m.def("adopt", &adopt, py::arg("ledger"), py::arg("storage"));
  m.def("small_pair", &small_pair, py::arg("ledger"), py::arg("limit"), py::arg("dst"), py::arg("src"));
  m.def("mark_host", &mark_host, py::arg("ledger"), py::arg("storage"));
  m.def("unmark_host", &unmark_host, py::arg("ledger"), py::arg("address"));
  m.def("move_bytes", &move_bytes, py::arg("dst"), py::arg("src"), py::arg("nbytes"));
}
