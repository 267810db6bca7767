"""CUDA sources shipped with the package, compiled at run time (CuPy's RawModule / NVRTC) on a GPU.

``gather_narrow.cu`` gathers captured router rows into request order and narrows expert ids to uint8/uint16;
its Python side is :mod:`lmcache_r3.artifacts.gather`. The sources are package data, so an installed wheel
carries them.
"""

from __future__ import annotations

from importlib import resources

GATHER_NARROW = "gather_narrow.cu"


def kernel_source(name: str = GATHER_NARROW) -> str:
    """The text of the CUDA source ``name`` shipped in this package.

    Raises:
        FileNotFoundError: the installed package lacks the source (a broken wheel).
    """
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")
