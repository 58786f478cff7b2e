"""Generates the protobuf and gRPC stubs of `levee.v1` from the repository's proto/ folder.

The stubs land in src/levee/v1/ (ignored by git): proto/ is the single source of truth and
generated code is never committed. Run by scripts/test and by the package build (setup.py).
"""

from __future__ import annotations

import pathlib
import sys

PACKAGE_FILES = ("errors", "common", "admin", "hotkey", "queue", "topic", "limits", "cluster")


def generate(proto_root: pathlib.Path, source_root: pathlib.Path) -> pathlib.Path:
    """Compiles levee/v1/*.proto under proto_root into source_root/levee/v1/; returns that folder."""
    from grpc_tools import protoc  # imported here: only the build needs grpcio-tools

    output = source_root / "levee" / "v1"
    output.mkdir(parents=True, exist_ok=True)
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    files = [str(proto_root / "levee" / "v1" / f"{name}.proto") for name in PACKAGE_FILES]
    arguments = [
        "grpc_tools.protoc",
        f"--proto_path={proto_root}",
        f"--proto_path={include}",
        f"--python_out={source_root}",
        f"--pyi_out={source_root}",
        f"--grpc_python_out={source_root}",
        *files,
    ]
    if protoc.main(arguments) != 0:
        raise SystemExit(f"protoc failed on {proto_root}; see the messages above")
    (output / "__init__.py").write_text('"""Generated from proto/levee/v1 at build time."""\n')
    return output


def main() -> None:
    here = pathlib.Path(__file__).resolve().parent.parent
    proto_root = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else here.parent.parent / "proto"
    output = generate(proto_root.resolve(), here / "src")
    print(f"generated stubs in {output}")


if __name__ == "__main__":
    main()
