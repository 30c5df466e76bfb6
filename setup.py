"""The Rust half of the wheel (see pyproject.toml for the rest).

setuptools-rust builds three artifacts into the `streamalloc` package: the C ABI library
and the LD_PRELOAD interposer (two crates: one maturin project could ship only one) and
the command-line program. The version is Cargo's workspace version, the one source.

With `STREAMALLOC_GLIBC=2.28` in the environment, the artifacts are linked by zig
against glibc 2.28's symbols (`cargo zigbuild --target x86_64-unknown-linux-gnu.2.28`;
`pip install cargo-zigbuild` brings both programs) and the wheel is tagged
`manylinux_2_28_x86_64`, so that it installs on any x86-64 Linux with glibc 2.28 or
newer. Without it, the wheel is linked against the building machine's glibc and tagged
`linux_x86_64`.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import stat
import sys
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


def glibc_floor() -> str | None:
    """The glibc version asked for through STREAMALLOC_GLIBC ("2.28"), if any."""
    value = os.environ.get("STREAMALLOC_GLIBC", "").strip()
    if not value:
        return None
    if not re.fullmatch(r"2\.\d+", value):
        raise SystemExit(f"setup.py: STREAMALLOC_GLIBC must read like 2.28, not {value!r}")
    if platform.machine() != "x86_64":
        raise SystemExit("setup.py: STREAMALLOC_GLIBC is supported on x86_64 only")
    zigbuild = shutil.which("cargo-zigbuild")
    if zigbuild is None:
        raise SystemExit(
            "setup.py: STREAMALLOC_GLIBC needs cargo-zigbuild on PATH (pip install cargo-zigbuild)"
        )
    # pip builds in an environment of its own, which hides the ziglang package that
    # `pip install cargo-zigbuild` put beside cargo-zigbuild: hand its zig over by path.
    if shutil.which("zig") is None and "CARGO_ZIGBUILD_ZIG_PATH" not in os.environ:
        venv = Path(zigbuild).resolve().parent.parent
        shipped = sorted(venv.glob("lib/python3*/site-packages/ziglang/zig"))
        if shipped:
            os.environ["CARGO_ZIGBUILD_ZIG_PATH"] = str(shipped[-1])
    return value


GLIBC = glibc_floor()

# setuptools-rust runs `$CARGO build` (the program) and `$CARGO rustc` (the libraries);
# cargo-zigbuild names the first `zigbuild`. This forwards each to it.
ZIGBUILD_FORWARDER = """#!{python}
import os, sys
command = {{"build": "zigbuild"}}.get(sys.argv[1], sys.argv[1])
os.execvp("cargo-zigbuild", ["cargo-zigbuild", command, *sys.argv[2:]])
"""


class BuildRust(build_rust):
    """Keeps the libraries' own names (libstreamalloc.so rather than a Python extension's
    libstreamalloc.cpython-311-x86_64-linux-gnu.so): the door links -lstreamalloc and users
    LD_PRELOAD libstreamalloc_preload.so by name. Links through zig when STREAMALLOC_GLIBC
    asks for an older glibc."""

    def run(self):
        if GLIBC is not None:
            # Set here, not in finalize_options: build_ext hands its own target to this
            # command just before running it.
            self.target = f"x86_64-unknown-linux-gnu.{GLIBC}"
            build_temp = Path(self.get_finalized_command("build").build_temp)
            build_temp.mkdir(parents=True, exist_ok=True)
            forwarder = build_temp / "cargo-via-zigbuild"
            forwarder.write_text(ZIGBUILD_FORWARDER.format(python=sys.executable))
            forwarder.chmod(forwarder.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            self.cargo = str(forwarder)
        super().run()

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
    """Nothing in the wheel is a CPython extension: one wheel serves every Python 3. Linked
    against the glibc STREAMALLOC_GLIBC names, it is tagged manylinux for that glibc."""

    def get_tag(self):
        _, _, plat = super().get_tag()
        if GLIBC is not None:
            plat = f"manylinux_{GLIBC.replace('.', '_')}_x86_64"
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
