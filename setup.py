"""The optional compiled module: `cachemap/_native.pyx` (see cachemap/native.py).

Built where Cython (a build requirement in pyproject.toml) and a C compiler are at hand; a failed
build is a warning and leaves the pure-Python install, which is the definition either way.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext whose failures (no compiler, a compile error) leave the module out."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as error:  # the pure install is the fallback
            print(f"cachemap._native not built ({error}): the pure-Python forms are used")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as error:
            print(f"{ext.name} not built ({error}): the pure-Python forms are used")


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    native = Extension("cachemap._native", ["cachemap/_native.pyx"], extra_compile_args=["-O2"])
    try:
        return list(cythonize([native], language_level=3, quiet=True))
    except Exception as error:
        print(f"cachemap._native not built ({error}): the pure-Python forms are used")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
