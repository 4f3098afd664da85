// The fake device's allocator hook: counts the CPU allocations made while a fake device is
// active on the calling thread, below dispatch (no Python per operator).
//
// See Note [Counting device memory with allocations] in tracking.py. In short: torch's CPU
// allocator is wrapped once per process (c10::SetCPUAllocator with a priority above the
// default's). An allocation made while the calling thread has a Ledger installed
// (set_current) is charged to that ledger, capacity-checked (over capacity: the ledger's
// Python out-of-memory factory builds the exception, raised through torch as a
// python_error), optionally poisoned with 0xFF bytes (the sanitizer), and handed out with
// a deleter that credits the ledger when the memory is really freed (its StorageImpl died,
// or a resize_ replaced it), from whatever thread. Any other allocation is the previous
// allocator's, untouched.

#include <torch/extension.h>

#include <ATen/record_function.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/Exceptions.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace {

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

  // All fit, or nothing is charged. ``settle``: the peak takes the new figure now (false inside
  // an operator: see settle()).
  bool try_add(int64_t nbytes, int64_t count, bool settle = true) {
    std::lock_guard<std::mutex> guard(mu);
    if (current + nbytes > capacity) {
      return false;
    }
    current += nbytes;
    allocations += count;
    if (settle && current > peak) {
      peak = current;
    }
    return true;
  }

  // An operator returned: what it allocated and still holds (its outputs) is in the peak; its
  // temporaries (a Python number wrapped as a CPU scalar tensor, a dtype cast of it, a
  // workspace) were freed inside it and never are.
  void settle() {
    std::lock_guard<std::mutex> guard(mu);
    if (current > peak) {
      peak = current;
    }
  }

  void add(int64_t nbytes, int64_t count) {
    std::lock_guard<std::mutex> guard(mu);
    current += nbytes;
    allocations += count;
    if (current > peak) {
      peak = current;
    }
  }

  void sub(int64_t nbytes, int64_t count) {
    std::lock_guard<std::mutex> guard(mu);
    current -= nbytes;
    allocations -= count;
  }

  std::mutex mu;
  int64_t capacity;
  int64_t current = 0;
  int64_t peak = 0;
  int64_t allocations = 0;
  int64_t hooked = 0;  // live allocations made through the hook (under g_mu)
  bool poison;
  pybind11::object oom;  // oom(requested_bytes, allocated_bytes) -> exception instance
};

struct Entry {
  std::shared_ptr<Ledger> ledger;
  size_t nbytes;
  c10::DeleterFnPtr deleter;
};

std::mutex g_mu;  // guards g_live and Ledger::hooked
std::unordered_map<void*, Entry> g_live;
thread_local std::shared_ptr<Ledger> tl_ledger;
// Operators running on this thread (nesting depth, from RecordFunction callbacks of this thread
// while it has a fake device active): allocations inside one settle the peak when it returns.
thread_local int tl_depth = 0;
thread_local at::CallbackHandle tl_callback = at::INVALID_CALLBACK_HANDLE;

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& /*fn*/) {
  ++tl_depth;
  return nullptr;
}

void on_op_end(const at::RecordFunction& /*fn*/, at::ObserverContext* /*ctx*/) {
  if (tl_depth > 0 && --tl_depth == 0 && tl_ledger) {
    tl_ledger->settle();
  }
}
c10::Allocator* g_previous = nullptr;

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
      entry.ledger->hooked -= 1;
      found = true;
    }
  }
  if (found) {
    entry.ledger->sub(static_cast<int64_t>(entry.nbytes), 1);
    entry.deleter(ptr);
    return;
  }
  // Not ours (raw_deallocate of an allocation made while no ledger was installed).
  c10::DeleterFnPtr previous = g_previous->raw_deleter();
  TORCH_INTERNAL_ASSERT(previous != nullptr);
  previous(ptr);
}

// A Python number the frontend wraps as a one-element CPU tensor to pass it to an operator
// (``x * 2``, ``x.mul_(2)``, ``x[0] = 3``): made under at::tracer::impl::NoTracerDispatchMode
// (Tracer excluded) but, unlike ``torch.tensor(data)``, with Python dispatch still enabled.
// On CUDA such scalars stay on the host: they are not device memory.
bool cpu_scalar(size_t nbytes) {
  return nbytes <= 16 && c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Tracer) &&
         !c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python);
}

struct HookAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const std::shared_ptr<Ledger>& ledger = tl_ledger;
    if (!ledger || nbytes == 0 || cpu_scalar(nbytes)) {
      return g_previous->allocate(nbytes);
    }
    if (!ledger->try_add(static_cast<int64_t>(nbytes), 1, /*settle=*/tl_depth == 0)) {
      raise_out_of_memory(ledger, nbytes);
    }
    c10::DataPtr inner;
    try {
      inner = g_previous->allocate(nbytes);
    } catch (...) {
      ledger->sub(static_cast<int64_t>(nbytes), 1);
      throw;
    }
    void* data = inner.get();
    if (data == nullptr || data != inner.get_context()) {  // not a plain pointer: not counted
      ledger->sub(static_cast<int64_t>(nbytes), 1);
      return inner;
    }
    c10::DeleterFnPtr deleter = inner.get_deleter();
    c10::Device device = inner.device();
    inner.release_context();
    if (ledger->poison) {
      std::memset(data, 0xFF, nbytes);  // Note [What the sanitizer poisons, and when], point 2
    }
    {
      std::lock_guard<std::mutex> guard(g_mu);
      g_live[data] = Entry{ledger, nbytes, deleter};
      ledger->hooked += 1;
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

// Follow operator boundaries on this thread (a thread-local RecordFunction callback, so threads
// without a fake device, and plain torch, pay nothing).
void observe_ops(bool on) {
  if (on && tl_callback == at::INVALID_CALLBACK_HANDLE) {
    tl_depth = 0;
    tl_callback = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_op_start, &on_op_end)
                                                 .needsInputs(false)
                                                 .needsOutputs(false)
                                                 .needsIds(false)
                                                 .scopes({at::RecordScope::FUNCTION}));
  } else if (!on && tl_callback != at::INVALID_CALLBACK_HANDLE) {
    at::removeCallback(tl_callback);
    tl_callback = at::INVALID_CALLBACK_HANDLE;
    tl_depth = 0;
  }
}

std::shared_ptr<Ledger> get_current() {
  return tl_ledger;
}

bool owns(const std::shared_ptr<Ledger>& ledger, uintptr_t address) {
  std::lock_guard<std::mutex> guard(g_mu);
  auto it = g_live.find(reinterpret_cast<void*>(address));
  return it != g_live.end() && it->second.ledger == ledger;
}

int64_t hooked(const std::shared_ptr<Ledger>& ledger) {
  std::lock_guard<std::mutex> guard(g_mu);
  return ledger->hooked;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Ledger, std::shared_ptr<Ledger>>(m, "Ledger")
      .def(pybind11::init<int64_t, bool, pybind11::object>(), pybind11::arg("capacity"), pybind11::arg("poison"),
           pybind11::arg("oom"))
      .def("try_add", &Ledger::try_add, pybind11::arg("nbytes"), pybind11::arg("count") = 1,
           pybind11::arg("settle") = true)
      .def("add", &Ledger::add, pybind11::arg("nbytes"), pybind11::arg("count") = 1)
      .def("sub", &Ledger::sub, pybind11::arg("nbytes"), pybind11::arg("count") = 1)
      .def("current", [](Ledger& l) { std::lock_guard<std::mutex> g(l.mu); return l.current; })
      .def("peak", [](Ledger& l) { std::lock_guard<std::mutex> g(l.mu); return l.peak; })
      .def("allocations", [](Ledger& l) { std::lock_guard<std::mutex> g(l.mu); return l.allocations; })
      .def("reset_peak", [](Ledger& l) { std::lock_guard<std::mutex> g(l.mu); l.peak = l.current; })
      .def_readwrite("poison", &Ledger::poison)
      .def_readonly("capacity", &Ledger::capacity);
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("set_current", &set_current, pybind11::arg("ledger").none(true));
  m.def("get_current", &get_current);
  m.def("observe_ops", &observe_ops, pybind11::arg("on"));
  m.def("owns", &owns, pybind11::arg("ledger"), pybind11::arg("address"));
  m.def("hooked", &hooked, pybind11::arg("ledger"));
}
