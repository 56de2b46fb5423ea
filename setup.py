"""The two build steps pyproject.toml cannot declare: the list of packages, and the optional C
kernels.

Packages: pyproject.toml's ``package-dir`` maps each source folder onto ``swarmavg.<folder>``,
a layout setuptools' automatic discovery cannot follow. The packages are every folder with an
``__init__.py`` under those folders, found here at build time, so a new subpackage is never
left out of the wheel; a folder holding modules without an ``__init__.py`` stops the build.

C kernels: ``optional=True`` lets an install without a C compiler succeed; the codecs then run
their numpy kernels (compression/native.py), which give the same bits.
"""

import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # a build requirement on 3.10 (pyproject.toml)
    import tomli as tomllib

HERE = Path(__file__).resolve().parent


def all_packages() -> list[str]:
    """Every package under every folder of pyproject.toml's package-dir, by dotted name."""
    config = tomllib.loads((HERE / "pyproject.toml").read_text(encoding="utf-8"))
    package_dir: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    packages = []
    for name, folder in package_dir.items():
        root = HERE / folder
        subpackages = find_packages(str(root))
        packages += [name, *(f"{name}.{sub}" for sub in subpackages)]
        package_paths = {root, *(root.joinpath(*sub.split(".")) for sub in subpackages)}
        stray = sorted(
            {str(path.parent.relative_to(HERE)) for path in root.rglob("*.py")}
            - {str(path.relative_to(HERE)) for path in package_paths}
        )
        if stray:
            raise SystemExit(
                f"setup.py: {', '.join(stray)} hold modules but are not packages of {name} "
                "(an __init__.py is missing in them or a folder above); the wheel would lack them"
            )
    return packages


setup(
    packages=all_packages(),
    ext_modules=[
        Extension(
            "swarmavg.compression._native",
            sources=["compression/_native.c"],
            # -ffp-contract=off: every product and sum rounded on its own, as numpy does
            # (no fused multiply-add), which keeps the kernels bit-identical to numpy.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math"],
            optional=True,
        )
    ],
)
