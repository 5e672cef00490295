"""Building the C++ extension: builds of one folder take turns, and a build killed
midway (torch's lock file left behind) never keeps a later process waiting."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pagedllm.cpu import extension
from pagedllm.cpu.build import build_directory, exclusive_build, library_name


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
