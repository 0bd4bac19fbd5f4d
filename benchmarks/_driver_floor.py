"""The driver floor: a bare ``cuLaunchKernelEx`` of a compiled Triton kernel, with every parameter prepared once.

The cheapest launch Python can make: one call (``METH_NOARGS``) into a small C function that hands a launch
configuration and a parameter array, both built at :func:`prepare` time, to the driver. No argument is read, no
pointer is checked, no context is queried: what is left is the Python call, the driver's launch and nothing else.
``benchmarks/launch_floor.py`` times it beside Triton's launcher and warmreg's fast launch (issue 41's
``launch_driver_us``).

The parameters are those Triton's own launcher passes, in its order (``triton/backends/nvidia/driver.py`` of
3.6.0, ``driver.c`` of 3.8.0): every argument whose specialization is not ``constexpr``, then the global and the
profile scratch pointers (NULL where the kernel needs no scratch; :func:`prepare` refuses a kernel that does).
Built with Triton's own ``compile_module_from_src`` and its bundled ``cuda.h``; ``libcuda.so.1`` is opened at
:func:`prepare`, so building works on a machine without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["build", "prepare"]

_SRC = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include "cuda.h"

#define MAX_PARAMS 64
typedef CUresult (*launch_t)(const CUlaunchConfig *, CUfunction, void **, void **);

static launch_t launch_ex = NULL;
static CUlaunchConfig config;
static CUlaunchAttribute attrs[1];
static CUfunction function;
static uint64_t storage[MAX_PARAMS];
static void *params[MAX_PARAMS];
static int prepared = 0;

/* prepare(function, grid(3), block_x, shared, stream, pdl, types, values): types is one char per parameter:
   'p' a 64-bit pointer, 'i' int32, 'l' int64, 'f' float32 (Triton's launcher packs fp32 as float). */
static PyObject *prepare(PyObject *self, PyObject *args) {
  unsigned long long fn, stream;
  unsigned int gx, gy, gz, block_x, shared;
  int pdl;
  const char *types;
  PyObject *values;
  if (!PyArg_ParseTuple(args, "K(III)IIKpsO", &fn, &gx, &gy, &gz, &block_x, &shared, &stream, &pdl, &types,
                        &values))
    return NULL;
  Py_ssize_t n = (Py_ssize_t)strlen(types);
  if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != n || n > MAX_PARAMS) {
    PyErr_SetString(PyExc_ValueError, "values must be a tuple with one value per type (at most 64)");
    return NULL;
  }
  if (launch_ex == NULL) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL || (launch_ex = (launch_t)dlsym(lib, "cuLaunchKernelEx")) == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "cuLaunchKernelEx not found in libcuda.so.1");
      return NULL;
    }
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *v = PyTuple_GET_ITEM(values, i);
    storage[i] = 0;
    switch (types[i]) {
      case 'p': case 'l': { uint64_t x = (uint64_t)PyLong_AsUnsignedLongLongMask(v); memcpy(&storage[i], &x, 8); break; }
      case 'i': { int32_t x = (int32_t)PyLong_AsLong(v); memcpy(&storage[i], &x, 4); break; }
      case 'f': { float x = (float)PyFloat_AsDouble(v); memcpy(&storage[i], &x, 4); break; }
      default: PyErr_Format(PyExc_ValueError, "unknown parameter type %c", types[i]); return NULL;
    }
    if (PyErr_Occurred()) return NULL;
    params[i] = &storage[i];
  }
  memset(&config, 0, sizeof(config));
  config.gridDimX = gx; config.gridDimY = gy; config.gridDimZ = gz;
  config.blockDimX = block_x; config.blockDimY = 1; config.blockDimZ = 1;
  config.sharedMemBytes = shared;
  config.hStream = (CUstream)stream;
  config.attrs = attrs;
  config.numAttrs = 0;
  if (pdl) {
    attrs[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attrs[0].value.programmaticStreamSerializationAllowed = 1;
    config.numAttrs = 1;
  }
  function = (CUfunction)fn;
  prepared = 1;
  Py_RETURN_NONE;
}

static PyObject *launch(PyObject *self, PyObject *unused) {
  CUresult err = launch_ex(&config, function, params, NULL);
  if (err != CUDA_SUCCESS) {
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernelEx failed: CUresult %d", (int)err);
    return NULL;
  }
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
  {"prepare", prepare, METH_VARARGS, "prepare the launch"},
  {"launch", launch, METH_NOARGS, "launch it"},
  {NULL, NULL, 0, NULL},
};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "warmreg_driver_floor", NULL, -1, methods};
PyMODINIT_FUNC PyInit_warmreg_driver_floor(void) { return PyModule_Create(&module); }
"""

#: Triton's parameter types as the C function stores them.
_TYPES = {"i1": "i", "i8": "i", "i16": "i", "i32": "i", "u1": "i", "u8": "i", "u16": "i", "u32": "i",
          "i64": "l", "u64": "l", "fp32": "f", "f32": "f"}  # fmt: skip


def build() -> Any:
    """Compile the C module with Triton's build helper and its bundled ``cuda.h`` (no GPU needed)."""
    import triton.backends.nvidia as nvidia
    from triton.runtime.build import compile_module_from_src

    include = os.path.join(os.path.dirname(nvidia.__file__), "include")
    return compile_module_from_src(_SRC, "warmreg_driver_floor", include_dirs=[include])


def param_types(specialization: Sequence[tuple[str, Any]], values: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
    """The C types and values of the parameters Triton's launcher passes, from the binder's specialization
    (``(type, spec)`` per argument): constexprs dropped, tensors as their data pointers, then the two scratch
    pointers (0).

    :raises ValueError: for an argument type the floor does not pass (a tensor descriptor, fp16 or fp64 scalars).
    """
    types, out = [], []
    for (ty, _), value in zip(specialization, values, strict=True):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            types.append("p")
            out.append(value.data_ptr() if hasattr(value, "data_ptr") else int(value or 0))
        elif ty in _TYPES:
            types.append(_TYPES[ty])
            out.append(value)
        else:
            raise ValueError(f"the driver floor does not pass a {ty!r} argument")
    return "".join(types) + "pp", (*out, 0, 0)


def prepare(
    module: Any, compiled: Any, grid: Sequence[int], stream: int, specialization: Sequence[tuple[str, Any]],
    values: Sequence[Any], *, launch_pdl: bool,
) -> None:
    """Prepare ``module.launch()`` to launch ``compiled`` (a loaded ``CompiledKernel``) on ``grid``.

    :raises ValueError: where the kernel needs scratch memory, clusters or more than one CTA, which the floor
        does not set up.
    """
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0) or getattr(md, "num_ctas", 1) != 1:
        raise ValueError("the driver floor takes kernels without scratch memory and with one CTA per cluster")
    types, params = param_types(specialization, values)
    g = (*grid, 1, 1)[:3]
    module.prepare(compiled.function, g, 32 * md.num_warps, md.shared, stream, launch_pdl, types, params)
