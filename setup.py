"""Builds pounce._C with CMake for `pip install .` (the rest of the metadata is in pyproject.toml).

setuptools drives the project's own CMake build with POUNCE_PYTHON_ONLY=ON (the library and the module,
none of the CLI's or the tests' dependencies), so the build needs only what is installed: cmake, a C++20
compiler, nanobind, and nvcc when the CUDA toolkit is there (found by the top-level CMakeLists.txt). No
scikit-build-core: setuptools is present wherever pip is, also offline with --no-build-isolation.

Environment:
  POUNCE_CMAKE_ARGS           extra CMake arguments, e.g. "-DPOUNCE_ENABLE_CUDA=OFF"
  POUNCE_BUILD_DIR            the CMake build folder, kept between installs (default build-py/pip-<python>)
  POUNCE_NCCL_ROOT            NCCL to build against (include/, lib/); default: the nvidia-nccl wheel that
                              torch loads, when installed, else the CUDA toolkit's
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: every core)
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def wheel_nccl_root() -> str | None:
    """The folder of the nvidia-nccl-cu* wheel (include/nccl.h, lib/libnccl.so.2), if installed."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "include" / "nccl.h").exists() and glob.glob(f"{location}/lib/libnccl.so*"):
            return location
    return None


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = target.parent
        tag = f"{sys.implementation.cache_tag}"
        build_dir = Path(os.environ.get("POUNCE_BUILD_DIR", ROOT / "build-py" / f"pip-{tag}")).resolve()
        args = [
            f"-DPython_EXECUTABLE={sys.executable}",
            "-DPOUNCE_PYTHON_ONLY=ON",
            f"-DPOUNCE_PYTHON_OUTPUT_DIR={out_dir}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if not (build_dir / "CMakeCache.txt").exists() and shutil.which("ninja"):
            args += ["-G", "Ninja"]
        nccl = os.environ.get("POUNCE_NCCL_ROOT") or wheel_nccl_root()
        if nccl:
            args.append(f"-DPOUNCE_NCCL_ROOT={nccl}")
        args += shlex.split(os.environ.get("POUNCE_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        print(f"pounce: cmake {' '.join(args)} (build folder {build_dir})", flush=True)
        subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *args], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "pounce_python", "--parallel", jobs],
                       check=True)
        built = sorted(out_dir.glob("_C*" + (sysconfig.get_config_var("SHLIB_SUFFIX") or ".so")))
        if not built:
            raise RuntimeError(f"pounce: the CMake build left no _C module in {out_dir}")
        if target not in built:
            shutil.copyfile(built[0], target)


setup(
    ext_modules=[Extension("pounce._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own build folder next to CMake's, not inside the project's build/ (which is carried
    # to the GPU machines and must stay small).
    options={"build": {"build_base": str(Path("build-py") / "setuptools")}},
)
