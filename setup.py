"""The one build step pyproject.toml cannot declare stably: the optional C kernels.

Everything else about the package lives in pyproject.toml. ``optional=True`` lets an
install without a C compiler succeed; the codecs then run their numpy kernels
(compression/native.py), which give the same bits.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "swarmavg.compression._native",
            sources=["compression/_native.c"],
            # -ffp-contract=off: every product and sum rounded on its own, as numpy does
            # (no fused multiply-add), which keeps the kernels bit-identical to numpy.
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-trapping-math"],
            optional=True,
        )
    ]
)
