"""The package installs whole: its wheel holds every file of the source tree's package (the
C++ sources it compiles at first use included), and installed from that wheel into a fresh
virtual environment it builds its CPU kernels, generates, and all-reduces two ranks through
shared memory (not gloo), with nothing imported from the source tree.

The fresh environment reuses the dependencies of the one running the tests (nothing is
downloaded): a ``.pth`` file names their ``site-packages`` folders. Folders named in a
``.pth`` file are only appended to ``sys.path``, their own ``.pth`` files are not read, so
the editable install's finder there never runs in the fresh environment and the wheel's
``pagedllm`` is the only one it can import (the child checks where it came from).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from pagedllm.bench.tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
PROJECT_FILES = ("pyproject.toml", "README.md")
"""What the build reads besides the package itself."""
SKIPPED = shutil.ignore_patterns("__pycache__", "*.pyc")

CHILD = textwrap.dedent(
    """
    import json
    import multiprocessing
    import sys
    import time
    from pathlib import Path

    import torch


    def reduce_on_rank(rank, address, results):
        import torch.distributed as dist

        from pagedllm.distributed.group import TensorParallelGroup

        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
        group = TensorParallelGroup(rank, 2)
        group.use_shared_memory(slot_bytes=1 << 16, timeout_s=60.0)
        x = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        group.all_reduce(x)
        results[rank] = (group.shared is not None, x.tolist())
        dist.destroy_process_group()


    def main(model, address):
        import pagedllm
        from pagedllm import LLM, SamplingParams
        from pagedllm.cpu import extension
        from pagedllm.distributed import shm_all_reduce

        report = {"package": pagedllm.__file__}
        start = time.monotonic()
        report["kernels_built"] = extension.kernels_built()
        report["shm_built"] = shm_all_reduce.library() is not None
        report["build_s"] = time.monotonic() - start

        llm = LLM(model, dtype="float32", kv_cache_memory="8MiB", log_stats_interval=0)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
        report["tokens"] = list(outputs[0].outputs[0].token_ids)

        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager:
            results = manager.dict()
            ranks = [context.Process(target=reduce_on_rank, args=(r, address, results))
                     for r in range(2)]
            for process in ranks:
                process.start()
            for process in ranks:
                process.join(300)
            report["rank_exit_codes"] = [process.exitcode for process in ranks]
            report["ranks"] = [results.get(r) for r in range(2)]
        print(json.dumps(report))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)


def package_files(root: Path) -> set[str]:
    """Every file of ``root``'s ``pagedllm`` package (bytecode left out), as paths relative
    to ``root`` in a wheel's spelling."""
    return {
        path.relative_to(root).as_posix()
        for path in (root / "pagedllm").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of the source tree's package, built from a copy of it (a build writes
    ``build/`` and ``*.egg-info`` beside its sources, and a stale ``build/`` would slip
    removed files into the wheel) with the setuptools already installed, offline."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO / "pagedllm", source / "pagedllm", ignore=SKIPPED)
    for name in PROJECT_FILES:
        shutil.copy2(REPO / name, source / name)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--no-index", "--quiet", "-w", str(root / "dist"), str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (built,) = (root / "dist").glob("pagedllm-*.whl")
    return built


def test_the_wheel_holds_every_file_of_the_package(wheel):
    """Nothing the package reads at run time (its C++ sources and headers, in any
    subpackage) is left out of a non-editable install."""
    with zipfile.ZipFile(wheel) as archive:
        packed = {name for name in archive.namelist() if name.startswith("pagedllm/")}
    assert packed == package_files(REPO)
    assert "pagedllm/distributed/shm_all_reduce.cpp" in packed


def dependency_folders() -> list[str]:
    """The ``site-packages`` folders of the running interpreter, none holding a
    ``pagedllm`` package of its own (an editable install keeps only a finder there)."""
    folders = [
        entry
        for entry in sys.path
        if entry.endswith(("site-packages", "dist-packages")) and Path(entry).is_dir()
    ]
    return [f for f in folders if not (Path(f) / "pagedllm" / "__init__.py").exists()]


def fresh_environment(folder: Path, wheel: Path) -> Path:
    """A new virtual environment in ``folder`` with the wheel installed (no pip of its
    own: this interpreter's pip installs into it) and the running interpreter's
    dependencies visible after its own ``site-packages``; returns its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "pagedllm-test-dependencies.pth").write_text(
        "".join(f"{entry}\n" for entry in dependency_folders())
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
         "--no-index", "--quiet", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return python


def test_the_installed_wheel_builds_generates_and_shares_memory(wheel, tmp_path):
    """From the wheel alone: the C++ kernels and the shared-memory all-reduce compile (in
    a new extension cache), a tiny model generates greedily, and two ranks sum through
    shared memory."""
    from pagedllm.server.launcher import free_port

    environment = tmp_path / "env"
    python = fresh_environment(environment, wheel)
    model = write_tiny_llama(tmp_path / "model")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    work = tmp_path / "work"  # not the repository: nothing of the source tree on sys.path
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")  # a real build
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # kernel timings of a new install
    start = time.monotonic()
    done = subprocess.run(
        [str(python), "-I", str(script), str(model), f"tcp://127.0.0.1:{free_port()}"],
        cwd=work, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"child: {elapsed:.0f} s, of which building the kernels {report['build_s']:.0f} s")

    assert Path(report["package"]).resolve().is_relative_to(environment.resolve())
    assert report["kernels_built"], done.stderr[-3000:]
    assert report["shm_built"], done.stderr[-3000:]
    assert "could not be built" not in done.stderr
    assert "unavailable" not in done.stderr
    assert len(report["tokens"]) == 4
    assert all(0 <= token < 512 for token in report["tokens"])
    assert report["rank_exit_codes"] == [0, 0], done.stderr[-3000:]
    (shared0, sum0), (shared1, sum1) = report["ranks"]
    assert shared0 and shared1  # the shared-memory path, not gloo
    assert sum0 == sum1 == [3.0 * i for i in range(1000)]
