"""The compiled decoder of fetched records (common/_cdecode.c), and nothing else: the
rest of the build is in pyproject.toml. The extension is optional: on a machine without
a C compiler or Python's headers the install goes on, and clmq uses the pure-Python
decoder (common/_many.py), which gives the same records."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("clmq.common._cdecode", sources=["common/_cdecode.c"], optional=True, extra_compile_args=["-O2"])
    ]
)
