#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for Pounce and builds it into ./build (or $POUNCE_BUILD_DIR).
# Installs only Debian packages the project uses; CUDA (nvcc, NCCL) is used when present.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(cmake ninja-build g++ libgtest-dev libcli11-dev nlohmann-json3-dev libdlpack-dev python3-dev python3-venv)
missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The Python module (pounce._C) and its tests need nanobind, numpy and pytest: from PyPI into a venv
# ($POUNCE_PYTHON_VENV, default .venv). Without them (no network) the module is not built and its ctest
# test reports itself skipped, saying why.
venv="${POUNCE_PYTHON_VENV:-.venv}"
python_args=()
if [ ! -x "$venv/bin/python" ] && ! python3 -m venv "$venv" >/dev/null 2>&1; then
  rm -rf "$venv"
fi
if [ -x "$venv/bin/python" ]; then
  if "$venv/bin/python" -c "import nanobind, numpy, pytest" 2>/dev/null ||
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --retries 2 --timeout 20 \
      "nanobind>=2" numpy pytest; then
    python_args=("-DPython_EXECUTABLE=$(cd "$venv" && pwd)/bin/python")
  else
    echo "setup: nanobind, numpy or pytest could not be installed: the Python module is skipped" >&2
  fi
  # torch and transformers for the torch layer's CPU tests and the transformers backend's tests. PyPI has
  # no CPU-only torch wheel for Linux: its torch pulls the CUDA libraries (about 3 GB down, 5 GB installed,
  # about a minute here), which the CPU tests load but never use. POUNCE_SETUP_TORCH=0 skips them (those
  # tests then report themselves skipped).
  if [ "${POUNCE_SETUP_TORCH:-1}" != 0 ] && [ ${#python_args[@]} -gt 0 ] &&
    ! "$venv/bin/python" -c "import torch, transformers.integrations.moe" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q --disable-pip-version-check --retries 2 --timeout 60 \
      torch "transformers>=5" ||
      echo "setup: torch or transformers could not be installed: the torch and transformers tests skip" >&2
  fi
fi

export PATH="$PATH:/usr/local/cuda/bin"
build_dir="${POUNCE_BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "${python_args[@]}" >/dev/null
cmake --build "$build_dir" --parallel "$(nproc)"
