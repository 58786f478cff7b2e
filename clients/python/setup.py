"""Generates the gRPC stubs from the repository's proto/ folder before building the package
(see scripts/generate_stubs.py); the project's metadata lives in pyproject.toml."""

import pathlib
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(HERE / "scripts"))
        from generate_stubs import generate

        proto_root = HERE.parent.parent / "proto"
        if proto_root.is_dir():
            generate(proto_root, HERE / "src")
        elif not (HERE / "src" / "levee" / "v1" / "queue_pb2.py").exists():
            raise SystemExit(f"no proto/ folder at {proto_root} and no generated stubs")
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
