"""Packaging rules of the R3 core: it imports no engine or cache library, and the distributions ship the kernels."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "lmcache_r3" / "artifacts"
ALLOWED_TOP_LEVEL = {"numpy", "msgspec", "xxhash", "lmcache_r3"} | set(sys.stdlib_module_names)


def test_importing_the_r3_core_loads_neither_vllm_nor_lmcache_nor_torch_nor_cupy():
    code = (
        "import sys, lmcache_r3.artifacts\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'lmcache', 'torch', 'cupy'})\n"
        "print(','.join(heavy))\n"
    )

    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)

    assert loaded.stdout.strip() == "", f"lmcache_r3.artifacts pulled in: {loaded.stdout.strip()}"


def test_r3_core_modules_import_only_numpy_msgspec_xxhash_and_the_stdlib_at_module_level():
    offenders = []
    for path in sorted(ARTIFACTS.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in tree.body:  # module level only: cupy is imported lazily inside functions
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            offenders += [f"{path.name}: {name}" for name in names if name.split(".")[0] not in ALLOWED_TOP_LEVEL]

    assert offenders == []


def test_sdist_and_the_wheel_built_from_it_ship_the_cuda_kernel(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(REPO / "lmcache_r3", source / "lmcache_r3", ignore=shutil.ignore_patterns("__pycache__"))
    for pattern in ("pyproject.toml", "setup.cfg", "MANIFEST.in", "README*", "LICENSE*"):
        for path in REPO.glob(pattern):
            shutil.copy2(path, source / path.name)
    build_sdist = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", build_sdist, str(tmp_path / "sdist")], cwd=source, check=True, capture_output=True
    )
    (sdist,) = (tmp_path / "sdist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        sdist_names = archive.getnames()
        archive.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "wheel"), str(unpacked)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    wheel_names = zipfile.ZipFile(wheel).namelist()

    assert any(name.endswith("lmcache_r3/kernels/gather_narrow.cu") for name in sdist_names)
    assert "lmcache_r3/kernels/gather_narrow.cu" in wheel_names
    assert "lmcache_r3/kernels/__init__.py" in wheel_names
    assert "lmcache_r3/artifacts/codec.py" in wheel_names
