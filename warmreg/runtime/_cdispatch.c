/* warmreg.runtime._cdispatch: the guarded fast launch in one C call (see warmreg/runtime/fast.py).
 *
 * An Entry holds, for one compile key of one kernel on one device, what Triton's launcher would
 * otherwise recompute per call: the guard of every argument (the properties Triton specializes on),
 * the launch configuration (block size, shared memory, PDL / cooperative / cluster attributes) and
 * the kernel's wr_function. Entry.launch(grid, kwargs) checks every guard, packs the kernel's
 * parameters into stack storage and calls cuLaunchKernelEx; when a guard fails it calls the entry's
 * fallback (the Python fast launch, which falls back to Triton's own path) instead, so a launch is
 * never wrong, only slower.
 *
 * It is written against CPython's C API and the CUDA driver's stable ABI only: no CUDA headers are
 * needed to build it (the few driver types are declared here, checked against Triton's cuda.h by
 * tests/test_cdispatch.py), and libcuda.so.1 is opened on the first launch, as Triton's launchers
 * do. Tensors are read through torch's C shim (see tensor_abi) where it is found and agrees with
 * torch.Tensor's own C getters (dtype, is_cuda, data_ptr), else through those getters, looked up once,
 * for arguments whose type is exactly torch.Tensor or torch.nn.Parameter; anything else takes the
 * fallback.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#include "_cdispatch_abi.h"

typedef wr_result (*launch_ex_t)(const wr_launch_config *, wr_function, void **, void **);
typedef wr_result (*error_string_t)(wr_result, const char **);
typedef wr_result (*ctx_get_t)(wr_context *);
typedef wr_result (*ctx_set_t)(wr_context);
typedef wr_result (*device_get_t)(wr_device *, int);
typedef wr_result (*primary_retain_t)(wr_context *, wr_device);
typedef wr_result (*func_set_attr_t)(wr_function, int, int);

static struct {
  int loaded;
  launch_ex_t launch_ex;
  error_string_t error_string;
  ctx_get_t ctx_get;
  ctx_set_t ctx_set;
  device_get_t device_get;
  primary_retain_t primary_retain;
  func_set_attr_t func_set_attr;
} cu;

static int load_driver(void) {
  if (cu.loaded)
    return 0;
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    PyErr_Format(PyExc_RuntimeError, "warmreg: cannot open libcuda.so.1 (%s)", dlerror());
    return -1;
  }
#define WR_SYM(field, type, name)                                                              \
  cu.field = (type)dlsym(lib, name);                                                           \
  if (!cu.field) {                                                                             \
    PyErr_SetString(PyExc_RuntimeError, "warmreg: libcuda.so.1 has no " name);                 \
    return -1;                                                                                 \
  }
  WR_SYM(launch_ex, launch_ex_t, "cuLaunchKernelEx");
  WR_SYM(error_string, error_string_t, "cuGetErrorString");
  WR_SYM(ctx_get, ctx_get_t, "cuCtxGetCurrent");
  WR_SYM(ctx_set, ctx_set_t, "cuCtxSetCurrent");
  WR_SYM(device_get, device_get_t, "cuDeviceGet");
  WR_SYM(primary_retain, primary_retain_t, "cuDevicePrimaryCtxRetain");
  WR_SYM(func_set_attr, func_set_attr_t, "cuFuncSetAttribute");
#undef WR_SYM
  cu.loaded = 1;
  return 0;
}

static void cuda_error(wr_result code) {
  const char *text = NULL;
  if (cu.error_string == NULL || cu.error_string(code, &text) != 0 || text == NULL)
    text = "unknown error";
  /* the message Triton's launcher raises, so an engine's handling sees the same error */
  PyErr_Format(PyExc_RuntimeError, "Triton Error [CUDA]: %s", text);
}

/* ---- torch.Tensor's C getters, looked up once ------------------------------------------------ */
static PyTypeObject *tensor_type, *parameter_type;
static PyObject *calls_name; /* "calls", interned once */
static getter get_dtype, get_is_cuda;
static void *get_dtype_closure, *get_is_cuda_closure;
static PyCFunction data_ptr_fn;

static PyObject *class_attr(PyObject *type, const char *name, PyTypeObject *kind, const char *what) {
  /* torch.Tensor.<name> on the class: the descriptor itself (a Python override would not be one) */
  PyObject *descr = PyObject_GetAttrString(type, name);
  if (descr != NULL && !PyObject_TypeCheck(descr, kind)) {
    PyErr_Format(PyExc_TypeError, "warmreg: torch.Tensor.%s is not a %s", name, what);
    Py_CLEAR(descr);
  }
  return descr;
}

static int find_getter(PyObject *type, const char *name, getter *fn, void **closure) {
  PyObject *descr = class_attr(type, name, &PyGetSetDescr_Type, "C getter");
  if (descr == NULL)
    return -1;
  *fn = ((PyGetSetDescrObject *)descr)->d_getset->get;
  *closure = ((PyGetSetDescrObject *)descr)->d_getset->closure;
  Py_DECREF(descr);  /* the class holds it */
  return 0;
}

static int find_torch(void) {
  PyObject *torch = PyImport_ImportModule("torch");
  if (torch == NULL)
    return -1;
  PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
  PyObject *nn = tensor ? PyObject_GetAttrString(torch, "nn") : NULL;
  PyObject *parameter = nn ? PyObject_GetAttrString(nn, "Parameter") : NULL;
  Py_XDECREF(nn);
  Py_DECREF(torch);
  if (parameter == NULL) {
    Py_XDECREF(tensor);
    return -1;
  }
  if (find_getter(tensor, "dtype", &get_dtype, &get_dtype_closure) < 0 ||
      find_getter(tensor, "is_cuda", &get_is_cuda, &get_is_cuda_closure) < 0) {
    Py_DECREF(tensor);
    Py_DECREF(parameter);
    return -1;
  }
  PyObject *descr = class_attr(tensor, "data_ptr", &PyMethodDescr_Type, "C method");
  int flags = descr ? ((PyMethodDescrObject *)descr)->d_method->ml_flags : 0;
  if (descr == NULL || (flags & (METH_NOARGS | METH_VARARGS | METH_KEYWORDS | METH_FASTCALL | METH_O)) != METH_NOARGS) {
    if (descr != NULL)
      PyErr_SetString(PyExc_TypeError, "warmreg: torch.Tensor.data_ptr takes arguments");
    Py_XDECREF(descr);
    Py_DECREF(tensor);
    Py_DECREF(parameter);
    return -1;
  }
  data_ptr_fn = ((PyMethodDescrObject *)descr)->d_method->ml_meth;
  Py_DECREF(descr);
  tensor_type = (PyTypeObject *)tensor;  /* kept for the process, as the getters are */
  parameter_type = (PyTypeObject *)parameter;
  return 0;
}

/* ---- torch's C shim: a tensor read without a Python call ------------------------------------
 * torch exports a C ABI over at::Tensor (the AOTI shim, torch/csrc/inductor/aoti_torch/c/shim.h:
 * aoti_torch_get_dtype / _get_device_type / _get_data_ptr, each taking an at::Tensor*). A torch.Tensor
 * object holds its at::Tensor at a fixed offset, which tensor_abi() finds without dereferencing
 * anything: the word there equals the tensor's own `_cdata` (its TensorImpl address) for every sample,
 * and the shim then agrees with the getters on each sample's dtype, device and data pointer. Where
 * the shim or that word is not found (another torch build), entries keep torch's getters. */
typedef int32_t (*aoti_ptr_t)(void *, void **);
typedef int32_t (*aoti_i32_t)(void *, int32_t *);
typedef int32_t (*aoti_code_t)(void);
static struct {
  Py_ssize_t offset; /* of the at::Tensor in a torch.Tensor object; -1: not in use */
  aoti_ptr_t data_ptr;
  aoti_i32_t dtype, device_type;
  int32_t cuda, cpu;
} abi = {-1, NULL, NULL, NULL, 0, 0};

static int abi_symbols(void) {
  void *lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);
  if (lib == NULL)
    return 0;
  aoti_code_t cuda = (aoti_code_t)dlsym(lib, "aoti_torch_device_type_cuda");
  aoti_code_t cpu = (aoti_code_t)dlsym(lib, "aoti_torch_device_type_cpu");
  abi.data_ptr = (aoti_ptr_t)dlsym(lib, "aoti_torch_get_data_ptr");
  abi.dtype = (aoti_i32_t)dlsym(lib, "aoti_torch_get_dtype");
  abi.device_type = (aoti_i32_t)dlsym(lib, "aoti_torch_get_device_type");
  if (!cuda || !cpu || !abi.data_ptr || !abi.dtype || !abi.device_type)
    return 0;
  abi.cuda = cuda();
  abi.cpu = cpu();
  return 1;
}

/* 1: the shim reads `t` at `offset` exactly as torch's getters do; 0: it does not; -1: error set */
static int abi_agrees(PyObject *t, Py_ssize_t offset, PyObject *first_dtype, int32_t first_code) {
  PyTypeObject *type = Py_TYPE(t);
  if ((type != tensor_type && type != parameter_type) || offset + (Py_ssize_t)sizeof(void *) > type->tp_basicsize)
    return 0;
  PyObject *cdata = PyObject_GetAttrString(t, "_cdata");
  if (cdata == NULL)
    return -1;
  unsigned long long impl = PyLong_AsUnsignedLongLongMask(cdata);
  Py_DECREF(cdata);
  uintptr_t word;
  memcpy(&word, (char *)t + offset, sizeof word);
  if (PyErr_Occurred() || (unsigned long long)word != impl)
    return PyErr_Occurred() ? -1 : 0;
  void *h = (char *)t + offset, *p = NULL;
  int32_t code, dev;
  if (abi.dtype(h, &code) != 0 || abi.device_type(h, &dev) != 0 || abi.data_ptr(h, &p) != 0)
    return 0;
  PyObject *dtype = get_dtype(t, get_dtype_closure), *is_cuda = get_is_cuda(t, get_is_cuda_closure);
  PyObject *ptr = data_ptr_fn(t, NULL);
  int same = 0;
  if (dtype && is_cuda && ptr) {
    unsigned long long want = PyLong_AsUnsignedLongLongMask(ptr);
    same = (unsigned long long)(uintptr_t)p == want && (is_cuda == Py_True) == (dev == abi.cuda) &&
           (is_cuda == Py_True || dev == abi.cpu) && ((dtype == first_dtype) == (code == first_code));
  }
  Py_XDECREF(dtype);
  Py_XDECREF(is_cuda);
  Py_XDECREF(ptr);
  return PyErr_Occurred() ? -1 : same;
}

static PyObject *tensor_abi(PyObject *module, PyObject *samples) {
  if (!PyTuple_Check(samples) || PyTuple_GET_SIZE(samples) < 2) {
    PyErr_SetString(PyExc_TypeError, "tensor_abi(samples): a tuple of at least two torch.Tensor");
    return NULL;
  }
  if (tensor_type == NULL && find_torch() < 0)
    return NULL;
  abi.offset = -1;
  if (!abi_symbols())
    return PyLong_FromSsize_t(-1);
  /* after PyObject_HEAD: at::Tensor (torch 2.12+), or c10::MaybeOwned<at::Tensor> (a flag, then the tensor) */
  const Py_ssize_t candidates[] = {(Py_ssize_t)sizeof(PyObject), (Py_ssize_t)sizeof(PyObject) + 8};
  for (size_t c = 0; c < sizeof candidates / sizeof candidates[0]; c++) {
    PyObject *first = PyTuple_GET_ITEM(samples, 0);
    int32_t first_code;
    if (Py_TYPE(first) != tensor_type && Py_TYPE(first) != parameter_type)
      break;
    PyObject *first_dtype = get_dtype(first, get_dtype_closure);
    if (first_dtype == NULL)
      return NULL;
    Py_DECREF(first_dtype); /* torch keeps one object per dtype */
    uintptr_t word;
    memcpy(&word, (char *)first + candidates[c], sizeof word);
    PyObject *cdata = PyObject_GetAttrString(first, "_cdata");
    if (cdata == NULL)
      return NULL;
    int match = (unsigned long long)word == PyLong_AsUnsignedLongLongMask(cdata);
    Py_DECREF(cdata);
    if (!match || abi.dtype((char *)first + candidates[c], &first_code) != 0)
      continue;
    int all = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(samples) && all == 1; i++)
      all = abi_agrees(PyTuple_GET_ITEM(samples, i), candidates[c], first_dtype, first_code);
    if (all < 0)
      return NULL;
    if (all) {
      abi.offset = candidates[c];
      break;
    }
  }
  return PyLong_FromSsize_t(abi.offset);
}

static PyObject *dtype_code(PyObject *module, PyObject *t) {
  int32_t code;
  if (abi.offset < 0 || (Py_TYPE(t) != tensor_type && Py_TYPE(t) != parameter_type) ||
      abi.dtype((char *)t + abi.offset, &code) != 0)
    return PyLong_FromLong(-1);
  return PyLong_FromLong(code);
}

/* ---- one entry ------------------------------------------------------------------------------- */
enum { K_PTR = 0, K_INT = 1, K_F32 = 2, K_BOOL = 3, K_CONST = 4, K_NONE = 5 };
enum { A_ALIGNED = 0, A_UNALIGNED = 1, A_ANY = 2 };
enum { W_I32 = 0, W_I64_WIDE = 1, W_U64_HIGH = 2, W_I64 = 3, W_U64 = 4 };
enum { F_NE1 = 1, F_DIV16 = 2, F_NDIV16 = 4, F_EQ = 8 };
#define WR_MAX_PARAMS 128

typedef struct {
  PyObject *name;  /* kwargs key (interned str) */
  int absent;      /* a default Triton filled in: must not be in kwargs; value is the default */
  int kind, mode, flags;
  PyObject *obj;   /* PTR: the dtype; CONST: the value; INT with F_EQ: the value; absent: the default */
  PyObject *cls;   /* CONST: the value's class */
  PyObject *dflt;  /* absent: the default value */
  int32_t code;    /* PTR: torch's ScalarType number of the dtype (-1: compare through the getter) */
} arg_spec;

typedef struct {
  PyObject *mapping, *name, *value;  /* mapping.get(name) == value */
  int identity;                      /* `is` instead of == */
  int empty_calls;                   /* and value.calls is empty (a HookChain) */
  PyTypeObject *type, *value_type;   /* watched: mapping's and (empty_calls) value's types at the watch */
  PyObject *calls;                   /* watched, empty_calls: value.calls at the last full check */
} env_check;

/* ---- watched environment checks (CPython 3.12+) -----------------------------------------------
 * An entry's environment checks (the kernel's globals, Triton's knobs and launch hooks) read the same
 * bindings at every launch, and those bindings change almost never. Where every binding a check reads
 * lives in a dict or a type CPython lets us watch (PyDict_Watch, PyType_Watch), any change to any of
 * them bumps env_epoch, and an entry runs its checks only when env_epoch moved since they last passed;
 * between, a launch checks only what a watch cannot see: the owner's type (a __class__ assignment) and
 * the length of each launch hook chain's list (hooks are added by list.append). A check whose result
 * could change without its binding changing (an equality of mutable values) keeps the entry on the
 * per-launch checks. Without watchers (before 3.12, free-threaded builds, every watcher slot taken) the
 * checks run at every launch. */
#if PY_VERSION_HEX >= 0x030C0000 && !defined(Py_GIL_DISABLED)
#define WR_WATCH 1
static int dict_watcher = -1, type_watcher = -1;
static int watching = 1; /* entries made while it is 0 check at every launch (see watch()) */
static uint64_t env_epoch = 1;

static int on_dict_event(PyDict_WatchEvent event, PyObject *dict, PyObject *key, PyObject *value) {
  (void)event, (void)dict, (void)key, (void)value;
  env_epoch++;
  return 0;
}

static int on_type_event(PyTypeObject *type) {
  (void)type;
  env_epoch++;
  return 0;
}

static void add_watchers(void) {
  dict_watcher = PyDict_AddWatcher(on_dict_event);
  type_watcher = dict_watcher < 0 ? -1 : PyType_AddWatcher(on_type_event);
  if (dict_watcher < 0 || type_watcher < 0) {
    PyErr_Clear(); /* every slot taken: the checks run at every launch */
    if (dict_watcher >= 0)
      PyDict_ClearWatcher(dict_watcher);
    dict_watcher = type_watcher = -1;
  }
}

/* A value whose equality with another cannot change while both stay bound (immutable built-ins). */
static int plain(PyObject *v) {
  return v == Py_None || PyBool_Check(v) || PyLong_CheckExact(v) || PyFloat_CheckExact(v) ||
         PyUnicode_CheckExact(v) || PyBytes_CheckExact(v);
}

/* Watch what `owner.name` reads: owner's instance dict (made now where CPython keeps it lazily) and every
 * type of its MRO. 1: watched; 0: the read is not a plain attribute (a descriptor, a custom getattr,
 * no instance dict); -1: error. */
static int watch_attribute(PyObject *owner, PyObject *name, PyTypeObject **type) {
  PyTypeObject *tp = Py_TYPE(owner);
  if (tp->tp_getattro != PyObject_GenericGetAttr || tp->tp_mro == NULL)
    return 0;
  PyObject *mro = tp->tp_mro;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(mro); i++) {
    PyObject *base = PyTuple_GET_ITEM(mro, i);
    PyObject *dict = PyType_GetDict((PyTypeObject *)base);
    if (dict == NULL)
      return -1;
    PyObject *attr = PyDict_GetItemWithError(dict, name);
    Py_DECREF(dict);
    if (attr == NULL && PyErr_Occurred())
      return -1;
    if (attr != NULL) {
      if (Py_TYPE(attr)->tp_descr_get != NULL)
        return 0; /* a property, a slot, a method: computed at each read */
      break;
    }
  }
  PyObject *instance = PyObject_GenericGetDict(owner, NULL);
  if (instance == NULL) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError))
      return -1;
    PyErr_Clear();
    return 0;
  }
  int rc = PyDict_Watch(dict_watcher, instance);
  Py_DECREF(instance);
  for (Py_ssize_t i = 0; rc == 0 && i < PyTuple_GET_SIZE(mro); i++) {
    PyObject *base = PyTuple_GET_ITEM(mro, i);
    if (!PyType_HasFeature((PyTypeObject *)base, Py_TPFLAGS_IMMUTABLETYPE)) /* object: never changes */
      rc = PyType_Watch(type_watcher, base);
  }
  if (rc < 0)
    return -1;
  *type = tp;
  return 1;
}
#endif

typedef struct {
  PyObject_HEAD
  wr_function function;
  unsigned int block_x, shared;
  int num_ctas, pdl, cooperative, device, require_cuda, nparams, npresent;
  Py_ssize_t nkw;
  Py_ssize_t nargs, nchecks;
  arg_spec *args;
  env_check *checks;
  int watched;             /* every check's bindings are watched (see env_epoch) */
  uint64_t checked_epoch;  /* env_epoch when the checks last passed in full (0: not since a change) */
  PyObject *device_obj, *get_device, *get_stream, *fallback, *keep;
} Entry;

static void entry_dealloc(Entry *self) {
  for (Py_ssize_t i = 0; i < self->nargs; i++) {
    Py_XDECREF(self->args[i].name);
    Py_XDECREF(self->args[i].obj);
    Py_XDECREF(self->args[i].cls);
    Py_XDECREF(self->args[i].dflt);
  }
  for (Py_ssize_t i = 0; i < self->nchecks; i++) {
    Py_XDECREF(self->checks[i].mapping);
    Py_XDECREF(self->checks[i].name);
    Py_XDECREF(self->checks[i].value);
    Py_XDECREF(self->checks[i].calls);
  }
  PyMem_Free(self->args);
  PyMem_Free(self->checks);
  Py_XDECREF(self->device_obj);
  Py_XDECREF(self->get_device);
  Py_XDECREF(self->get_stream);
  Py_XDECREF(self->fallback);
  Py_XDECREF(self->keep);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* 1: passes; 0: fails; -1: error set */
static int int_guard(const arg_spec *a, PyObject *v, uint64_t *slot) {
  if (Py_TYPE(v) != &PyLong_Type)
    return 0;
  int overflow = 0;
  long long s = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (s == -1 && PyErr_Occurred())
    return -1;
  unsigned long long u = 0;
  int fits_i64 = overflow == 0;
  if (!fits_i64) {
    if (overflow < 0)
      return 0;
    u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
      PyErr_Clear();  /* >= 2**64: no Triton int type holds it */
      return 0;
    }
  }
  switch (a->mode) {
  case W_I32:
    if (!fits_i64 || s < INT32_MIN || s > INT32_MAX)
      return 0;
    break;
  case W_I64_WIDE:
    if (!fits_i64 || (s >= INT32_MIN && s <= INT32_MAX))
      return 0;
    break;
  case W_U64_HIGH:
    if (fits_i64)
      return 0;
    break;
  case W_I64:
    if (!fits_i64)
      return 0;
    break;
  case W_U64:
    if (fits_i64 && s < 0)
      return 0;
    break;
  default:
    return 0;
  }
  unsigned long long bits = fits_i64 ? (unsigned long long)s : u;
  if ((a->flags & F_EQ) && PyObject_RichCompareBool(v, a->obj, Py_EQ) != 1)
    return 0;
  if ((a->flags & F_NE1) && fits_i64 && s == 1)
    return 0;
  if ((a->flags & F_DIV16) && (bits & 15))
    return 0;
  if ((a->flags & F_NDIV16) && !(bits & 15))
    return 0;
  if (a->mode == W_I32) {
    int32_t narrow = (int32_t)s;
    *slot = 0;
    memcpy(slot, &narrow, sizeof narrow);
  } else {
    memcpy(slot, &bits, sizeof bits);
  }
  return 1;
}

static int ptr_guard(const Entry *self, const arg_spec *a, PyObject *v, uint64_t *slot) {
  PyTypeObject *type = Py_TYPE(v);
  if (type != tensor_type && type != parameter_type)
    return 0;
  unsigned long long p;
  if (abi.offset >= 0 && a->code >= 0) {
    /* the same three reads through torch's C shim (see tensor_abi): no Python call, no int object */
    void *h = (char *)v + abi.offset, *data = NULL;
    int32_t code, dev;
    if (abi.dtype(h, &code) != 0 || code != a->code)
      return 0;
    if (self->require_cuda && (abi.device_type(h, &dev) != 0 || dev != abi.cuda))
      return 0;
    if (abi.data_ptr(h, &data) != 0)
      return 0; /* the getter path raises the error: let the fallback reach it */
    p = (unsigned long long)(uintptr_t)data;
    goto aligned;
  }
  PyObject *dtype = get_dtype(v, get_dtype_closure);
  if (dtype == NULL)
    return -1;
  Py_DECREF(dtype);  /* torch keeps one object per dtype for the process: identity compares */
  if (dtype != a->obj)
    return 0;
  if (self->require_cuda) {
    PyObject *is_cuda = get_is_cuda(v, get_is_cuda_closure);
    if (is_cuda == NULL)
      return -1;
    Py_DECREF(is_cuda);
    if (is_cuda != Py_True)
      return 0;
  }
  PyObject *ptr = data_ptr_fn(v, NULL);
  if (ptr == NULL)
    return -1;
  p = PyLong_AsUnsignedLongLong(ptr);
  Py_DECREF(ptr);
  if (p == (unsigned long long)-1 && PyErr_Occurred())
    return -1;
aligned:
  if (a->mode == A_ALIGNED && (p & 15))
    return 0;
  if (a->mode == A_UNALIGNED && !(p & 15))
    return 0;
  *slot = p;
  return 1;
}

/* Every environment check, in full. 1: passes; 0: fails; -1: error set. Where the entry is watched and
 * every result is one only a binding change can change, a pass holds until env_epoch moves. */
static int env_checks(Entry *self) {
#ifdef WR_WATCH
  uint64_t epoch = env_epoch; /* before the reads: a change made while they run forces the next check */
  int stable = self->watched;
  self->checked_epoch = 0;
#endif
  for (Py_ssize_t i = 0; i < self->nchecks; i++) {
    env_check *c = &self->checks[i];
    PyObject *v;
    if (PyDict_Check(c->mapping)) {
      v = PyDict_GetItemWithError(c->mapping, c->name);
      if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
      Py_INCREF(v);
    } else {
      v = PyObject_GetAttr(c->mapping, c->name);
      if (v == NULL)
        return -1;
    }
    int ok = c->identity ? v == c->value : PyObject_RichCompareBool(v, c->value, Py_EQ);
#ifdef WR_WATCH
    if (!c->identity && v != c->value && !(plain(v) && plain(c->value)))
      stable = 0;
#endif
    Py_DECREF(v);
    if (ok != 1)
      return ok;
    if (c->empty_calls) {
      PyObject *calls = PyObject_GetAttr(c->value, calls_name);
      if (calls == NULL)
        return -1;
      int busy = PyObject_IsTrue(calls);
#ifdef WR_WATCH
      if (!PyList_CheckExact(calls))
        stable = 0;
      Py_XSETREF(c->calls, calls);
#else
      Py_DECREF(calls);
#endif
      if (busy != 0)
        return busy < 0 ? -1 : 0;
    }
  }
#ifdef WR_WATCH
  /* a type without a valid version tag is not notified of its next change (CPython's type cache) */
  for (Py_ssize_t i = 0; stable && i < self->nchecks; i++) {
    const env_check *c = &self->checks[i];
    if ((c->type && !PyType_HasFeature(c->type, Py_TPFLAGS_VALID_VERSION_TAG)) ||
        (c->value_type && !PyType_HasFeature(c->value_type, Py_TPFLAGS_VALID_VERSION_TAG)))
      stable = 0;
  }
  self->checked_epoch = stable ? epoch : 0;
#endif
  return 1;
}

/* The environment checks: in full, or, where a full pass still holds (nothing watched changed since),
 * only what a watch cannot see. */
static inline int env_ok(Entry *self) {
#ifdef WR_WATCH
  if (self->checked_epoch == env_epoch) {
    int same = 1;
    for (Py_ssize_t i = 0; same && i < self->nchecks; i++) {
      const env_check *c = &self->checks[i];
      same = (c->type == NULL || Py_TYPE(c->mapping) == c->type) &&
             (!c->empty_calls || (Py_TYPE(c->value) == c->value_type && PyList_GET_SIZE(c->calls) == 0));
    }
    if (same)
      return 1;
  }
#endif
  return env_checks(self);
}

/* Check every guard and pack the kernel parameters. 1: packed; 0: a guard failed; -1: error. */
static int check_and_pack(Entry *self, PyObject *kw, uint64_t *storage, int *nparams) {
  if (!PyDict_CheckExact(kw) || PyDict_GET_SIZE(kw) != self->nkw)
    return 0;
  int n = 0;
  /* kwargs are built in the same order at every call of an op: walk them in step with the arguments
   * (a key is the argument's interned name, so a pointer compare), and look up by hash from the first
   * argument out of step. With exactly nkw keys of which every present argument is one, the absent
   * arguments cannot be among them: they are looked up only where the entry saw other keys too. */
  Py_ssize_t pos = 0;
  int in_step = 1;
  for (Py_ssize_t i = 0; i < self->nargs; i++) {
    const arg_spec *a = &self->args[i];
    PyObject *v = NULL, *key, *value;
    if (a->absent) {
      if (self->nkw != self->npresent) {
        v = PyDict_GetItemWithError(kw, a->name);
        if (v != NULL || PyErr_Occurred())
          return v != NULL ? 0 : -1;
      }
      v = a->dflt;
    } else if (in_step && PyDict_Next(kw, &pos, &key, &value) && key == a->name) {
      v = value;
    } else {
      in_step = 0;
      v = PyDict_GetItemWithError(kw, a->name);
      if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    }
    int ok = 1;
    switch (a->kind) {
    case K_PTR:
      ok = ptr_guard(self, a, v, &storage[n++]);
      break;
    case K_INT:
      ok = int_guard(a, v, &storage[n++]);
      break;
    case K_F32:
      if (Py_TYPE(v) != &PyFloat_Type)
        return 0;
      {
        float f = (float)PyFloat_AS_DOUBLE(v);
        storage[n] = 0;
        memcpy(&storage[n++], &f, sizeof f);
      }
      break;
    case K_BOOL:
      if (Py_TYPE(v) != &PyBool_Type)
        return 0;
      storage[n++] = v == Py_True;
      break;
    case K_CONST:
      if ((PyObject *)Py_TYPE(v) != a->cls)
        return 0;
      ok = v == a->obj ? 1 : PyObject_RichCompareBool(v, a->obj, Py_EQ);
      break;
    case K_NONE:
      ok = v == Py_None;
      break;
    default:
      return 0;
    }
    if (ok != 1)
      return ok;
  }
  int env = env_ok(self);
  if (env != 1)
    return env;
  PyObject *dev = PyObject_CallNoArgs(self->get_device);
  if (dev == NULL)
    return -1;
  int same = PyLong_Check(dev) && PyLong_AsLong(dev) == self->device;
  Py_DECREF(dev);
  if (!same)
    return PyErr_Occurred() ? -1 : 0;
  *nparams = n;
  return 1;
}

static int grid_of(PyObject *grid, unsigned int g[3]) {
  if (!PyTuple_CheckExact(grid))
    return 0;
  Py_ssize_t n = PyTuple_GET_SIZE(grid);
  if (n < 1 || n > 3)
    return 0;
  g[0] = g[1] = g[2] = 1;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *d = PyTuple_GET_ITEM(grid, i);
    if (Py_TYPE(d) != &PyLong_Type)
      return 0;
    long v = PyLong_AsLong(d);
    if (v < 0 || v > INT32_MAX) {
      PyErr_Clear();
      return 0;
    }
    g[i] = (unsigned int)v;
  }
  return 1;
}

static PyObject *call_fallback(Entry *self, PyObject *const *argv) {
  if (self->fallback == Py_None)
    Py_RETURN_FALSE;
  return PyObject_Vectorcall(self->fallback, argv, 2, NULL);
}

static PyObject *entry_launch(Entry *self, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 2) {
    PyErr_SetString(PyExc_TypeError, "launch(grid, kwargs)");
    return NULL;
  }
  unsigned int g[3];
  uint64_t storage[WR_MAX_PARAMS + 2];
  void *params[WR_MAX_PARAMS + 2];
  int n = 0;
  if (!grid_of(argv[0], g))
    return call_fallback(self, argv);
  int ok = check_and_pack(self, argv[1], storage, &n);
  if (ok < 0)
    return NULL;
  if (ok == 0 || n != self->nparams)
    return call_fallback(self, argv);
  if ((unsigned long long)g[0] * g[1] * g[2] == 0)
    Py_RETURN_TRUE;  /* as Triton's launcher: an empty grid launches nothing */
  PyObject *stream_obj = PyObject_CallOneArg(self->get_stream, self->device_obj);
  if (stream_obj == NULL)
    return NULL;
  wr_stream stream = (wr_stream)(uintptr_t)PyLong_AsUnsignedLongLong(stream_obj);
  Py_DECREF(stream_obj);
  if (PyErr_Occurred())
    return NULL;
  if (!cu.loaded && load_driver() < 0)
    return NULL;
  storage[n] = 0;      /* global scratch: none (entries are built only for kernels without it) */
  storage[n + 1] = 0;  /* profile scratch: none */
  for (int i = 0; i < n + 2; i++)
    params[i] = &storage[i];
  wr_launch_attr attrs[4];
  memset(attrs, 0, sizeof attrs);
  wr_launch_config config;
  config.gridDimX = g[0] * (unsigned int)self->num_ctas;
  config.gridDimY = g[1];
  config.gridDimZ = g[2];
  config.blockDimX = self->block_x;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = self->shared;
  config.hStream = stream;
  config.attrs = attrs;
  unsigned int na = 0;
  if (self->pdl) {
    attrs[na].id = WR_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[na++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (self->cooperative) {
    attrs[na].id = WR_ATTR_COOPERATIVE;
    attrs[na++].value.cooperative = 1;
  }
  if (self->num_ctas != 1) {
    attrs[na].id = WR_ATTR_CLUSTER_DIMENSION;
    attrs[na].value.clusterDim.x = (unsigned int)self->num_ctas;
    attrs[na].value.clusterDim.y = 1;
    attrs[na++].value.clusterDim.z = 1;
    attrs[na].id = WR_ATTR_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attrs[na++].value.clusterSchedulingPolicyPreference = WR_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  config.numAttrs = na;
  wr_result rc;
  Py_BEGIN_ALLOW_THREADS;
  rc = cu.launch_ex(&config, self->function, params, NULL);
  if (rc == WR_ERROR_INVALID_CONTEXT) {
    /* a thread that never made the device's context current: as Triton's launcher does, make the
     * primary context current and launch again */
    wr_context ctx = NULL;
    wr_device dev;
    if (cu.ctx_get(&ctx) == 0 && ctx == NULL && cu.device_get(&dev, self->device) == 0 &&
        cu.primary_retain(&ctx, dev) == 0 && cu.ctx_set(ctx) == 0)
      rc = cu.launch_ex(&config, self->function, params, NULL);
  }
  Py_END_ALLOW_THREADS;
  if (rc != 0) {
    cuda_error(rc);
    return NULL;
  }
  Py_RETURN_TRUE;
}

static PyObject *entry_pack(Entry *self, PyObject *const *argv, Py_ssize_t argc) {
  if (argc != 2) {
    PyErr_SetString(PyExc_TypeError, "pack(grid, kwargs)");
    return NULL;
  }
  unsigned int g[3];
  uint64_t storage[WR_MAX_PARAMS];
  int n = 0;
  if (!grid_of(argv[0], g))
    Py_RETURN_NONE;
  int ok = check_and_pack(self, argv[1], storage, &n);
  if (ok < 0)
    return NULL;
  if (ok == 0 || n != self->nparams)
    Py_RETURN_NONE;
  return PyBytes_FromStringAndSize((const char *)storage, (Py_ssize_t)n * 8);
}

static int parse_args(Entry *self, PyObject *specs) {
  self->nargs = PyTuple_GET_SIZE(specs);
  self->args = PyMem_Calloc(self->nargs ? self->nargs : 1, sizeof(arg_spec));
  if (self->args == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  int passed = 0;
  for (Py_ssize_t i = 0; i < self->nargs; i++) {
    arg_spec *a = &self->args[i];
    PyObject *name, *obj, *cls, *dflt;
    int code = -1;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(specs, i), "UpiiiOOO|i", &name, &a->absent, &a->kind, &a->mode,
                          &a->flags, &obj, &cls, &dflt, &code))
      return -1;
    a->code = code;
    self->npresent += !a->absent;
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    a->name = name;
    a->obj = Py_NewRef(obj);
    a->cls = Py_NewRef(cls);
    a->dflt = Py_NewRef(dflt);
    if (a->kind < K_PTR || a->kind > K_NONE) {
      PyErr_Format(PyExc_ValueError, "argument %zd: unknown kind %d", i, a->kind);
      return -1;
    }
    passed += a->kind <= K_BOOL;
  }
  if (passed > WR_MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "%d kernel parameters: more than %d", passed, WR_MAX_PARAMS);
    return -1;
  }
  self->nparams = passed;
  return 0;
}

static int parse_checks(Entry *self, PyObject *checks) {
  self->nchecks = PyTuple_GET_SIZE(checks);
  self->checks = PyMem_Calloc(self->nchecks ? self->nchecks : 1, sizeof(env_check));
  if (self->checks == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  for (Py_ssize_t i = 0; i < self->nchecks; i++) {
    env_check *c = &self->checks[i];
    PyObject *mapping, *name, *value;
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(checks, i), "OUOpp", &mapping, &name, &value, &c->identity,
                          &c->empty_calls))
      return -1;
    c->mapping = Py_NewRef(mapping);
    Py_INCREF(name);
    PyUnicode_InternInPlace(&name);
    c->name = name;
    c->value = Py_NewRef(value);
  }
#ifdef WR_WATCH
  /* watched only where every binding the checks read is */
  self->watched = watching && dict_watcher >= 0;
  for (Py_ssize_t i = 0; self->watched && i < self->nchecks; i++) {
    env_check *c = &self->checks[i];
    int rc = PyDict_Check(c->mapping) ? (PyDict_Watch(dict_watcher, c->mapping) < 0 ? -1 : 1)
                                      : watch_attribute(c->mapping, c->name, &c->type);
    if (rc == 1 && c->empty_calls)
      rc = watch_attribute(c->value, calls_name, &c->value_type);
    if (rc < 0)
      return -1;
    self->watched = rc;
  }
#endif
  return 0;
}

static PyObject *entry_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
  static char *names[] = {"function", "num_warps", "num_ctas", "shared", "launch_pdl", "cooperative",
                          "device", "nkw", "args", "checks", "get_device", "get_stream", "fallback",
                          "keep", "require_cuda", NULL};
  unsigned long long function;
  int num_warps, num_ctas, shared, pdl, coop, device, require_cuda = 1;
  Py_ssize_t nkw;
  PyObject *specs, *checks, *get_device, *get_stream, *fallback, *keep;
  if (!PyArg_ParseTupleAndKeywords(args, kwds, "KiiippinO!O!OOOO|p", names, &function, &num_warps, &num_ctas,
                                   &shared, &pdl, &coop, &device, &nkw, &PyTuple_Type, &specs, &PyTuple_Type,
                                   &checks, &get_device, &get_stream, &fallback, &keep, &require_cuda))
    return NULL;
  if (num_warps < 1 || num_ctas < 1 || shared < 0 || device < 0) {
    PyErr_SetString(PyExc_ValueError, "num_warps, num_ctas >= 1; shared, device >= 0");
    return NULL;
  }
  if (tensor_type == NULL && find_torch() < 0)
    return NULL;
  Entry *self = (Entry *)type->tp_alloc(type, 0);
  if (self == NULL)
    return NULL;
  self->function = (wr_function)(uintptr_t)function;
  self->block_x = 32u * (unsigned int)num_warps;
  self->shared = (unsigned int)shared;
  self->num_ctas = num_ctas;
  self->pdl = pdl;
  self->cooperative = coop;
  self->device = device;
  self->require_cuda = require_cuda;
  self->nkw = nkw;
  self->device_obj = PyLong_FromLong(device);
  self->get_device = Py_NewRef(get_device);
  self->get_stream = Py_NewRef(get_stream);
  self->fallback = Py_NewRef(fallback);
  self->keep = Py_NewRef(keep);
  if (self->device_obj == NULL || parse_args(self, specs) < 0 || parse_checks(self, checks) < 0) {
    Py_DECREF(self);
    return NULL;
  }
  /* what a first launch would otherwise pay: opening the driver, the first stream query */
  if (function != 0) {
    PyObject *stream = load_driver() < 0 ? NULL : PyObject_CallOneArg(self->get_stream, self->device_obj);
    if (stream == NULL) {
      Py_DECREF(self);
      return NULL;
    }
    Py_DECREF(stream);
  }
  if (num_ctas == 16 && function != 0) {
    /* a 16-CTA cluster is non-portable: allowed once for the function, as Triton's launcher does */
    wr_result rc = cu.func_set_attr(self->function, WR_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
    if (rc != 0) {
      cuda_error(rc);
      Py_DECREF(self);
      return NULL;
    }
  }
  return (PyObject *)self;
}

static PyMethodDef entry_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))entry_launch, METH_FASTCALL,
     "launch(grid, kwargs) -> bool: check the guards and launch; else the fallback's result."},
    {"pack", (PyCFunction)(void (*)(void))entry_pack, METH_FASTCALL,
     "pack(grid, kwargs) -> bytes | None: the kernel parameters launch would pass (8 bytes each), or None "
     "where a guard fails. Launches nothing."},
    {NULL, NULL, 0, NULL}};

static PyObject *entry_watched(Entry *self, void *closure) {
  (void)closure;
  return PyBool_FromLong(self->watched);
}

static PyObject *entry_checks_hold(Entry *self, void *closure) {
  (void)closure;
#ifdef WR_WATCH
  return PyBool_FromLong(self->checked_epoch == env_epoch);
#else
  (void)self;
  Py_RETURN_FALSE;
#endif
}

static PyGetSetDef entry_getset[] = {
    {"watched", (getter)entry_watched, NULL,
     "whether the environment checks run only after a watched binding changed (CPython 3.12+), not at every launch",
     NULL},
    {"checks_hold", (getter)entry_checks_hold, NULL,
     "whether the environment checks' last full pass still holds: nothing watched changed since (the next launch "
     "skips them)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "warmreg.runtime._cdispatch.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One compile key's guarded launch (see warmreg.runtime.fast).",
    .tp_methods = entry_methods,
    .tp_getset = entry_getset,
    .tp_new = entry_new,
};

static PyObject *watch(PyObject *module, PyObject *flag) {
  (void)module;
  int on = PyObject_IsTrue(flag);
  if (on < 0)
    return NULL;
#ifdef WR_WATCH
  int previous = watching;
  watching = on;
  return PyBool_FromLong(previous);
#else
  Py_RETURN_FALSE;
#endif
}

static PyMethodDef module_methods[] = {
    {"watch", watch, METH_O,
     "watch(on) -> bool: whether entries made from now on watch their environment checks' bindings (CPython 3.12+; "
     "on by default); returns the previous setting (False where watching is not built). For comparisons."},
    {"tensor_abi", tensor_abi, METH_O,
     "tensor_abi(samples) -> int: read tensors through torch's C shim from now on, where it agrees with torch's "
     "getters on every sample; the at::Tensor offset in use, or -1 (the getters stay)."},
    {"dtype_code", dtype_code, METH_O,
     "dtype_code(tensor) -> int: torch's ScalarType number of the tensor's dtype as the shim reads it (-1: not in use)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cdispatch",
                                    "warmreg's C launch path (see warmreg.runtime.fast).", -1, module_methods};

PyMODINIT_FUNC PyInit__cdispatch(void) {
  if (PyType_Ready(&EntryType) < 0)
    return NULL;
  calls_name = PyUnicode_InternFromString("calls");
  if (calls_name == NULL)
    return NULL;
#ifdef WR_WATCH
  add_watchers();
#endif
  PyObject *m = PyModule_Create(&module);
  if (m == NULL)
    return NULL;
  Py_INCREF(&EntryType);
  if (PyModule_AddObject(m, "Entry", (PyObject *)&EntryType) < 0) {
    Py_DECREF(&EntryType);
    Py_DECREF(m);
    return NULL;
  }
  PyModule_AddIntConstant(m, "MAX_PARAMS", WR_MAX_PARAMS);
  return m;
}
