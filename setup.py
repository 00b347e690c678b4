"""Builds pdkv and its messenger extension.

pdkv._messenger is Cython over C transports in pdkv/csrc/. The verbs transport is compiled in
when the libibverbs headers are present (Debian: libibverbs-dev), the libfabric transport when the
libfabric headers are (Debian: libfabric-dev); a transport whose headers are missing is left out and
asking for it is a clear error at run time. The tcp transport's sealed data streams
(messenger.tls_data) need libcrypto's headers (Debian: libssl-dev), likewise.
"""

import os
import sys

from setuptools import Extension, find_packages, setup


def have_verbs() -> bool:
    if os.environ.get("PDKV_NO_VERBS"):
        return False
    return any(os.path.exists(os.path.join(d, "infiniband", "verbs.h"))
               for d in ("/usr/include", "/usr/local/include"))


def have_crypto() -> bool:
    """libcrypto's headers (Debian: libssl-dev): the tcp transport's sealed streams (messenger.tls_data)."""
    if os.environ.get("PDKV_NO_CRYPTO"):
        return False
    return any(os.path.exists(os.path.join(d, "openssl", "evp.h")) for d in ("/usr/include", "/usr/local/include"))


def have_libfabric() -> bool:
    if os.environ.get("PDKV_NO_LIBFABRIC"):
        return False
    return any(os.path.exists(os.path.join(d, "rdma", "fabric.h"))
               for d in ("/usr/include", "/usr/local/include"))


def extensions():
    from Cython.Build import cythonize

    sources = ["pdkv/_messenger.pyx"]
    csrc = sorted(f for f in os.listdir("pdkv/csrc") if f.endswith(".c"))
    # verbs*.c need libibverbs, fabric*.c libfabric; every other C file is transport-blind or tcp/fake.
    sources += [os.path.join("pdkv/csrc", f) for f in csrc if not f.startswith(("verbs", "fabric"))]
    macros, libraries = [], ["pthread"]
    if have_verbs() and "verbs.c" in csrc:
        sources += [os.path.join("pdkv/csrc", f) for f in csrc if f.startswith("verbs")]
        macros.append(("PDKV_HAVE_VERBS", "1"))
        libraries.append("ibverbs")
    if have_crypto():
        macros.append(("PDKV_HAVE_CRYPTO", "1"))
        libraries.append("crypto")
    if have_libfabric() and "fabric.c" in csrc:
        sources += [os.path.join("pdkv/csrc", f) for f in csrc if f.startswith("fabric")]
        macros.append(("PDKV_HAVE_LIBFABRIC", "1"))
        # not linked: fabric_dl.c loads libfabric when a libfabric transport is made, so
        # importing pdkv loads no provider library (nor the system libibverbs through them)
        libraries.append("dl")
    ext = Extension(
        "pdkv._messenger",
        sources=sources,
        include_dirs=["pdkv/csrc"],
        # headers and .pxi includes: editing one rebuilds (a NEW .c file needs build_ext --force)
        depends=sorted(os.path.join("pdkv/csrc", f) for f in os.listdir("pdkv/csrc") if f.endswith(".h"))
        + ["pdkv/_messenger.pxd", "pdkv/_messenger_errors.pxi", "pdkv/_messenger_wire.pxi"],
        define_macros=macros,
        libraries=libraries,
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function", "-Wno-format-truncation"],
    )
    # pdkv._kernels: the CPU kernels of small decode steps (models/cpu_kernels.py,
    # models/attention/cpu_decode.py). Baseline x86-64 flags: the AVX2 kernels carry their own
    # target attributes and are picked at run time.
    kernels = Extension(
        "pdkv._kernels",
        sources=["pdkv/_kernels.pyx"] + sorted(os.path.join("pdkv/kernels", f)
                                              for f in os.listdir("pdkv/kernels") if f.endswith(".c")),
        include_dirs=["pdkv"],
        depends=sorted(os.path.join("pdkv/kernels", f) for f in os.listdir("pdkv/kernels") if f.endswith(".h")),
        # no fused multiply-adds but the kernels' explicit ones: the MoE sums must round like torch's
        # -fopenmp: the kernels split a call over OpenMP threads (pdkv/kernels/pool.c), torch's
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-ffp-contract=off", "-fopenmp"],
        extra_link_args=["-fopenmp"],
        libraries=["m"],
    )
    return cythonize([ext, kernels], language_level=3, compiler_directives={"embedsignature": True})


setup(
    name="pdkv",
    version="0.1.0",
    description="LLM serving with disaggregated prefill and decode",
    # models/ and server/ stay at the top of the repository (the layout the project was asked
    # for) but install as pdkv.models and pdkv.server: top-level names that generic would collide with
    # anything else on a user's path. In a checkout, pdkv/models and pdkv/server are links to them.
    packages=find_packages(include=["pdkv", "pdkv.*"], exclude=["pdkv.models*", "pdkv.server*"])
    + [f"pdkv.{p}" for p in find_packages(include=["models", "models.*", "server", "server.*"])],
    package_dir={"pdkv.models": "models", "pdkv.server": "server"},
    # data/pdkv-stdlib-coder: the trained default model (pdkv.default_model), so an installed pdkv has it
    package_data={"pdkv": ["_messenger.pyi", "_messenger.pxd", "csrc/*.h", "data/pdkv-stdlib-coder/*"]},
    python_requires=">=3.10",
    ext_modules=extensions() if "egg_info" not in sys.argv else [],
    entry_points={"console_scripts": ["pdkv=pdkv.cli:main"]},
)
