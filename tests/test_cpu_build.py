"""Building the C++ extension: builds of one folder take turns, a build killed midway
(torch's lock file left behind) never keeps a later process waiting, the sources compile
as every supported torch builds them, and a failed build says why in one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from pagedllm.cpu import extension
from pagedllm.cpu.build import (
    build_directory,
    build_failure_reason,
    exclusive_build,
    library_name,
)
from pagedllm.distributed import shm_all_reduce

CXX17_TARGETS = ("native", "x86-64-v3", "sapphirerapids")
"""``-march`` values the sources must compile for: this CPU, AVX2 alone (the AVX-512
paths compiled out) and Intel's servers with AMX tiles."""


def test_a_stale_torch_lock_is_removed(tmp_path, caplog):
    folder = tmp_path / "build"
    folder.mkdir()
    (folder / "lock").touch()
    with exclusive_build(folder):
        assert not (folder / "lock").exists()
    assert "killed midway" in caplog.text


def test_builds_of_one_folder_take_turns(tmp_path):
    folder = tmp_path / "new" / "build"  # created by the first builder
    entered = threading.Event()

    def second_builder():
        with exclusive_build(folder):
            entered.set()

    with exclusive_build(folder):
        thread = threading.Thread(target=second_builder)
        thread.start()
        assert not entered.wait(0.5)
    assert entered.wait(30)
    thread.join()


def test_names_differ_by_installation(tmp_path):
    here = Path(extension.__file__).parent
    assert library_name("pagedllm_cpu", here) == library_name("pagedllm_cpu", here)
    assert library_name("pagedllm_cpu", here) != library_name("pagedllm_cpu", tmp_path)


@pytest.mark.skipif(not extension.kernels_built(), reason="the C++ kernels are not built")
def test_a_process_loads_the_kernels_past_a_lock_left_by_a_killed_build(tmp_path):
    """The library this process built, copied into another extension root beside the lock
    file torch leaves when a build is killed: a new process loads it (torch alone waits
    for that file forever)."""
    name = library_name("pagedllm_cpu", Path(extension.__file__).parent)
    shutil.copytree(build_directory(name), tmp_path / name)
    (tmp_path / name / "lock").touch()
    done = subprocess.run(
        [sys.executable, "-c",
         "from pagedllm.cpu.extension import kernels_built; print(kernels_built())"],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]
    assert "killed midway" in done.stderr
    assert not (tmp_path / name / "lock").exists()


def test_every_header_is_hashed_into_the_build():
    """torch rebuilds on a changed source or flag only: a header left out of HEADERS
    would let an edit to it load a stale library."""
    folder = Path(extension.__file__).parent
    assert set(extension.HEADERS) == set(folder.glob("*.h"))


def compiler_knows(march: str) -> bool:
    done = subprocess.run(
        ["g++", f"-march={march}", "-E", "-x", "c++", "/dev/null"], capture_output=True
    )
    return done.returncode == 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("march", CXX17_TARGETS)
def test_every_source_compiles_as_cxx17(march):
    """torch before 2.13 builds extensions as C++17, 2.13 as C++20: a C++20 feature
    builds here and fails on an older torch (the engine then falls back to torch's
    operators). Syntax and templates only, no code generated."""
    if not compiler_knows(march):
        pytest.skip(f"g++ does not know -march={march}")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    flags = ["-fsyntax-only", "-std=c++17", f"-march={march}", "-fopenmp",
             "-DTORCH_EXTENSION_NAME=syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
             *(f"-isystem{folder}" for folder in includes)]  # fmt: skip
    sources = [*extension.SOURCES, str(shm_all_reduce.SOURCE)]
    processes = [
        subprocess.Popen(["g++", *flags, source], stderr=subprocess.PIPE, text=True)
        for source in sources
    ]
    errors = {
        Path(source).name: build_failure_reason(RuntimeError(process.communicate()[1]))
        for source, process in zip(sources, processes, strict=True)
        if process.wait() != 0
    }
    assert errors == {}


def test_a_failed_build_names_the_compilers_first_error():
    message = (
        "Error building extension 'pagedllm_cpu_x': [1/2] g++ -c packed_linear.cpp\n"
        "FAILED: packed_linear.o\n"
        "packed_linear.cpp: In function 'void f()':\n"
        "packed_linear.cpp:195:28: error: 'type_identity_t' in namespace 'std' does not "
        "name a template type\n"
        "packed_linear.cpp:217:68: error: 'next_panel' was not declared in this scope\n"
    )
    assert build_failure_reason(RuntimeError(message)) == (
        "packed_linear.cpp:195:28: error: 'type_identity_t' in namespace 'std' does not "
        "name a template type"
    )
    assert build_failure_reason(OSError("g++: not found\nmore")) == "g++: not found"
    assert build_failure_reason(RuntimeError("")) == "RuntimeError('')"
