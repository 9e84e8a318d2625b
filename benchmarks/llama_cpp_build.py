"""Build llama.cpp's ``llama-server`` and ``llama-quantize`` from the llama-cpp-python sdist on PyPI.

llama-cpp-python's source distribution vendors llama.cpp (``vendor/llama.cpp``), so the version the
comparison runs against is pinned by one PyPI version (``LLAMA_CPP_PYTHON``). This script:

1. finds the sdist in the cache folder, or downloads it with ``pip download --no-deps --no-binary
   :all: llama-cpp-python==VERSION`` (a ``--sdist PATH`` already on disk is used as it is);
2. unpacks it there and builds the two targets with CMake (Release, ``GGML_NATIVE=ON`` so the build
   uses every instruction set of the CPU it is built on, OpenMP, no curl, no OpenSSL, no web UI
   download, no tests or examples), ``nice -n 19``;
3. ``f32_gguf(source)``: converts a GGUF to F32 with ``llama-quantize --allow-requantize`` (cached
   beside the build by the source file's name and size).

Everything lives under ``~/.cache/berth-bench/llama.cpp-VERSION/`` (``BERTH_BENCH_CACHE`` overrides
the parent folder); a second call finds the binaries and returns at once. The build records the
CPU it was built on and its flags in ``build-info.json``: a native build is for that CPU only.

    python benchmarks/llama_cpp_build.py                      # build (or find) the binaries
    python benchmarks/llama_cpp_build.py --f32 MODEL.gguf     # and the F32 copy of a GGUF
    python benchmarks/llama_cpp_build.py --jobs 2 --sdist /tmp/llama_cpp_python-0.3.36.tar.gz
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.machine import machine_info

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-server", "llama-quantize")
CMAKE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "GGML_NATIVE": "ON",
    "GGML_OPENMP": "ON",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "BUILD_SHARED_LIBS": "OFF",
}


def cache_dir(version: str = LLAMA_CPP_PYTHON) -> Path:
    root = Path(os.environ.get("BERTH_BENCH_CACHE", Path.home() / ".cache" / "berth-bench"))
    return root / f"llama.cpp-{version}"


def binary(name: str, version: str = LLAMA_CPP_PYTHON) -> Path:
    return cache_dir(version) / "build" / "bin" / name


def built(version: str = LLAMA_CPP_PYTHON) -> bool:
    return all(binary(name, version).is_file() for name in TARGETS)


def fetch_sdist(version: str, sdist: str | None = None) -> Path:
    """The sdist: ``sdist`` if given, else the cached one, else ``pip download`` into the cache."""
    if sdist:
        return Path(sdist)
    folder = cache_dir(version)
    found = sorted(folder.glob(f"llama_cpp_python-{version}.tar.gz"))
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(folder), f"llama-cpp-python=={version}"], check=True)
    return folder / f"llama_cpp_python-{version}.tar.gz"


def unpack(sdist: Path, version: str) -> Path:
    """The vendored llama.cpp source folder, unpacked from the sdist once."""
    source = cache_dir(version) / "src"
    vendored = source / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not (vendored / "CMakeLists.txt").is_file():
        source.mkdir(parents=True, exist_ok=True)
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
            archive.extractall(source, members=members, filter="data")
    return vendored


def build(version: str = LLAMA_CPP_PYTHON, sdist: str | None = None, jobs: int = 2, force: bool = False) -> dict:
    """Builds the targets once; returns build-info (where the binaries are, how long it took)."""
    folder = cache_dir(version)
    info_path = folder / "build-info.json"
    if built(version) and not force and info_path.is_file():
        return json.loads(info_path.read_text())
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is needed to build llama.cpp (apt-get install cmake build-essential)")
    source = unpack(fetch_sdist(version, sdist), version)
    build_dir = folder / "build"
    started = time.perf_counter()
    configure = ["cmake", "-S", str(source), "-B", str(build_dir)]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    configure += [f"-D{key}={value}" for key, value in CMAKE_OPTIONS.items()]
    subprocess.run(configure, check=True)
    subprocess.run(["nice", "-n", "19", "cmake", "--build", str(build_dir), "--config", "Release",
                    "-j", str(jobs), "--target", *TARGETS], check=True)
    seconds = time.perf_counter() - started
    info = {"llama_cpp_python": version, "source": str(source), "cmake_options": CMAKE_OPTIONS,
            "build_seconds": round(seconds, 1), "jobs": jobs, "built_on": machine_info(),
            "binaries": {name: str(binary(name, version)) for name in TARGETS},
            "version_line": _version_line(version)}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return info


def _version_line(version: str) -> str | None:
    """llama-server's own --version line (its build number and commit, as the sdist vendors it)."""
    try:
        out = subprocess.run([str(binary("llama-server", version)), "--version"], capture_output=True, text=True,
                             timeout=30)
        return (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr).strip() else None
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def f32_gguf(source: str | Path, version: str = LLAMA_CPP_PYTHON, out_type: str = "F32") -> Path:
    """``source`` requantised to ``out_type`` (F32, BF16, F16) with llama-quantize, cached."""
    source = Path(source)
    out = cache_dir(version) / "models" / f"{source.stem}-{source.stat().st_size}-{out_type.lower()}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    with open(out.with_suffix(".log"), "w") as log:  # a line per tensor: kept beside the file, not printed
        subprocess.run(["nice", "-n", "19", str(binary("llama-quantize", version)), "--allow-requantize",
                        str(source), str(partial), out_type], check=True, stdout=log, stderr=subprocess.STDOUT)
    partial.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON, help="llama-cpp-python version on PyPI")
    parser.add_argument("--sdist", help="an sdist already on disk (else the cache, else pip download)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rebuild even if the binaries exist")
    parser.add_argument("--f32", metavar="GGUF", help="also write the F32 copy of this GGUF")
    args = parser.parse_args(argv)
    info = build(args.version, args.sdist, args.jobs, args.force)
    print(json.dumps(info, indent=2))
    if args.f32:
        print(f32_gguf(args.f32, args.version))


if __name__ == "__main__":
    main()
