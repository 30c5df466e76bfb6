"""The Rust half of the wheel (see pyproject.toml for the rest).

setuptools-rust builds three artifacts into the `streamalloc` package: the C ABI library
and the LD_PRELOAD interposer (two crates: one maturin project could ship only one) and
the command-line program. The version is Cargo's workspace version, the one source.
"""

import re
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools_rust import Binding, RustExtension, build_rust

ROOT = Path(__file__).resolve().parent


def cargo_version() -> str:
    text = (ROOT / "Cargo.toml").read_text()
    m = re.search(r'^\[workspace\.package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not m:
        raise SystemExit("setup.py: no version in Cargo.toml's [workspace.package]")
    return m.group(1)


VERSION = cargo_version()


class BuildRust(build_rust):
    """Keeps the libraries' own names (libstreamalloc.so rather than a Python extension's
    libstreamalloc.cpython-311-x86_64-linux-gnu.so): the door links -lstreamalloc and users
    LD_PRELOAD libstreamalloc_preload.so by name."""

    def get_dylib_ext_path(self, ext, target_fname):
        path = Path(super().get_dylib_ext_path(ext, target_fname))
        return str(path.with_name(target_fname.rsplit(".", 1)[-1] + ".so"))


class BuildPy(build_py):
    """Writes the version into the package, so that `streamalloc.__version__` needs no
    Cargo.toml once installed."""

    def run(self):
        super().run()
        out = Path(self.build_lib) / "streamalloc" / "_version.py"
        out.write_text(f'version = "{VERSION}"\n')


class BdistWheel(bdist_wheel):
    """Nothing in the wheel is a CPython extension: one wheel serves every Python 3."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


setup(
    version=VERSION,
    rust_extensions=[
        # The program first: its build also compiles the library crate the others reuse.
        RustExtension(
            {"streamalloc": "streamalloc.bin.streamalloc"},
            path="Cargo.toml",
            binding=Binding.Exec,
            args=["--bin", "streamalloc"],
        ),
        RustExtension("streamalloc.libstreamalloc_preload", path="preload/Cargo.toml", binding=Binding.NoBinding),
        RustExtension("streamalloc.libstreamalloc", path="Cargo.toml", binding=Binding.NoBinding),
    ],
    cmdclass={"build_rust": BuildRust, "build_py": BuildPy, "bdist_wheel": BdistWheel},
    zip_safe=False,
)
