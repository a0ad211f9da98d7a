"""The optional native kernel: everything else about the package is in pyproject.toml.

``s3kv._planes_native`` encodes a block's byte planes in one call that drops the GIL once
(see ``s3kv/_planes_native.c``). It is optional: where it cannot be compiled (no C compiler,
or a CPython older than 3.11, whose limited API lacks the buffer protocol) the install still
succeeds and s3kv encodes with the Python encoder, which writes the same bytes.
"""

import sys

from setuptools import Extension, setup

_LIMITED = sys.version_info >= (3, 11)

setup(
    ext_modules=[
        Extension(
            "s3kv._planes_native",
            ["s3kv/_planes_native.c"],
            optional=True,
            py_limited_api=_LIMITED,
            extra_compile_args=["-O3", "-std=c11"],
        )
    ]
    if _LIMITED
    else [],
    options={"bdist_wheel": {"py_limited_api": "cp311"}} if _LIMITED else {},
)
