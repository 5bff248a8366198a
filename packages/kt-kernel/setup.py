"""Build the ``kt_kernel._C`` extension against the torch that is installed at build time.

The wheel must be built with ``pip wheel/install --no-build-isolation`` after the runtime torch
is installed: the extension uses torch's C++ ABI, so it only loads under the torch it was built
against. ``KT_KERNEL_NO_NATIVE=1`` builds a pure-Python wheel (the reference implementation).
"""

import os
from pathlib import Path

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("KT_KERNEL_NO_NATIVE", "0") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # No -march=native: the wheel must run on any x86-64 CPU. The hot loops are compiled
    # per ISA inside the sources (GCC target pragmas) and picked at run time from CPUID.
    ext_modules = [
        CppExtension(
            name="kt_kernel._C",
            # Every csrc/*.cpp: a new weight format is one file that registers its tile loader.
            sources=sorted(str(p) for p in Path("csrc").glob("*.cpp")),
            extra_compile_args=["-O3", "-fopenmp", "-fno-math-errno"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
