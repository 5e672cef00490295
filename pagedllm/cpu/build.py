"""Builds a C++ torch extension once per CPU and installation, and loads it.

A library is compiled with ``-march=native``, so its name (also its build folder's, in
torch's extension cache: ``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) carries a tag of the CPU's instruction sets, so a home
directory shared by different CPUs never loads another CPU's build, and a tag of the
installation (the sources' folder, Python's and torch's versions), so two checkouts
never rebuild over each other and a new torch never loads a library built against the
old one.

Builds of one folder take turns under an advisory lock that the kernel drops when its
holder dies. torch's own lock file is removed by whoever dies holding it only if the
death is a Python exception; a build killed by a signal leaves it behind, and torch then
waits for it forever in every later process. The advisory lock's holder knows no build
is running, so it removes such a file first.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.utils import cpp_extension

logger = logging.getLogger("pagedllm")


def instruction_set_tag() -> str:
    """Ten hex digits naming this CPU's instruction-set flags (from ``/proc/cpuinfo``,
    else the platform's processor string)."""
    flags = platform.processor()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        flags = next((line for line in cpuinfo if line.startswith("flags")), flags)
    return hashlib.sha1(" ".join(sorted(flags.split())).encode()).hexdigest()[:10]


def installation_tag(source_folder: Path) -> str:
    """Ten hex digits naming the sources' folder and Python's and torch's versions (the
    build's commands name the first; the library links against the others)."""
    installation = f"{source_folder.resolve()}|{sys.version}|{torch.__version__}"
    return hashlib.sha1(installation.encode()).hexdigest()[:10]


def library_name(prefix: str, source_folder: Path) -> str:
    """``{prefix}_{CPU tag}_{installation tag}``: the library's name and its folder's."""
    return f"{prefix}_{instruction_set_tag()}_{installation_tag(source_folder)}"


def build_directory(name: str) -> Path:
    """Library ``name``'s build folder under ``TORCH_EXTENSIONS_DIR``, else under torch's
    default extension root."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name


@contextlib.contextmanager
def exclusive_build(directory: Path) -> Iterator[None]:
    """Holds the advisory lock on ``directory/build.flock``, creating the folder if
    needed; a torch lock file (``lock``) found there is removed (see the module's
    docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            logger.warning("Removing %s, left by a build killed midway.", stale)
            stale.unlink(missing_ok=True)
        yield


def build_failure_reason(error: BaseException) -> str:
    """One line saying why a build failed: the compiler's first error when the message
    holds the build's output (torch's does), else the message's first line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    compiler_errors = [line for line in lines if ": error:" in line or ": fatal error:" in line]
    return (compiler_errors or lines or [repr(error)])[0]


def load_library(
    prefix: str, sources: Sequence[str], cflags: Sequence[str], ldflags: Sequence[str] = ()
) -> None:
    """Builds ``sources`` (one folder's) if needed and loads them into this process as
    :func:`library_name`; raises what the build raises."""
    name = library_name(prefix, Path(sources[0]).parent)
    directory = build_directory(name)
    with exclusive_build(directory):
        cpp_extension.load(
            name=name,
            sources=list(sources),
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(directory),
            is_python_module=False,
        )
