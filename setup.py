"""The one C extension of warmreg: its launch path below Triton's launcher (``warmreg/runtime/_cdispatch.c``).

Optional: where no C compiler or no Python headers exist the install goes on without it and warmreg
launches through its Python fast path (``warmreg.runtime.fast``). Everything else is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "warmreg.runtime._cdispatch",
            ["warmreg/runtime/_cdispatch.c"],
            depends=["warmreg/runtime/_cdispatch_abi.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-missing-field-initializers"],
            libraries=["dl"],
            optional=True,
        )
    ]
)
