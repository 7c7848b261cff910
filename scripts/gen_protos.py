"""Generate the Python code of relayrl's gRPC contracts, and the experiment config's JSON Schema:
the one command for both.

    protos/relayrl/<svc>/<ver>/<name>.proto
        -> services/<svc>/<ver>/<name>_pb2.py, <name>_pb2.pyi, <name>_pb2_grpc.py
    relayrl.coordinator.config.ExperimentConfig (pydantic)
        -> schemas/experiment.schema.json   (relayrl.coordinator.schema.experiment_schema())

``services/`` is installed as the import root ``relayrl``, so the generated imports
(``from relayrl.common.v1 import common_pb2``) resolve as they are. Generated files are never
edited by hand; this script rewrites them all, deletes generated files whose .proto is gone and
keeps the hand-written ``__init__.py`` of each folder (creating one where missing).

Usage (from anywhere; paths are relative to the repository)::

    python scripts/gen_protos.py                  # regenerate in place
    python scripts/gen_protos.py --check          # exit 1 listing files that differ from a fresh run
    python scripts/gen_protos.py --descriptor-set-out FILE
                                                  # only write a FileDescriptorSet, comments kept

Output is deterministic for a given grpcio-tools version: protoc sees the same sorted list of
repository-relative .proto names on every machine, and files are compared byte for byte.
grpcio-tools is pinned in pyproject.toml (dev extra); another version produces other bytes, so
``--check`` warns when the installed one differs from the pin. The schema is built by pydantic
from the config models (field docstrings become descriptions), so editing a config model means
running this command too; ``--check`` names the pydantic version when the schema differs.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PKG_ROOT = ROOT / "services"
IMPORT_ROOT = "relayrl"  # top folder under protos/; maps to services/
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
INIT_TEXT = '"""Generated from protos/ by scripts/gen_protos.py. Do not edit."""\n'


def proto_files() -> list[str]:
    """Every .proto under protos/relayrl, as sorted paths relative to protos/ (protoc's names)."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in (PROTO_ROOT / IMPORT_ROOT).rglob("*.proto"))


def protoc(*out_args: str) -> None:
    """Run grpc_tools' bundled protoc on every relayrl .proto with the given output flags."""
    try:
        from grpc_tools import protoc as _protoc
    except ImportError:
        sys.exit("gen_protos: grpcio-tools is not installed (pip install -e '.[dev]')")
    # google/protobuf/*.proto (timestamp.proto, ...) ship inside grpc_tools.
    well_known = Path(_protoc.__file__).resolve().parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *out_args, *proto_files()]
    if _protoc.main(args) != 0:
        sys.exit(f"gen_protos: protoc failed: {' '.join(args)}")


def generate() -> dict[str, bytes]:
    """Generate into a temp folder; return {path relative to services/: content}."""
    with tempfile.TemporaryDirectory(prefix="relayrl-protos-") as tmp:
        protoc(f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--pyi_out={tmp}")
        base = Path(tmp) / IMPORT_ROOT
        return {
            p.relative_to(base).as_posix(): p.read_bytes()
            for p in sorted(base.rglob("*"))
            if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
        }


def committed() -> dict[str, bytes]:
    """Generated files now in services/<svc>/<ver>/: {path relative to services/: content}."""
    return {
        p.relative_to(PKG_ROOT).as_posix(): p.read_bytes()
        for p in sorted(PKG_ROOT.glob("*/v[0-9]*/*"))
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def differences(fresh: dict[str, bytes], current: dict[str, bytes]) -> list[str]:
    """Lines "<kind>: services/<path>" for every file that is stale, missing or left over."""
    out = []
    for rel in sorted(fresh.keys() | current.keys()):
        if rel not in current:
            out.append(f"missing: services/{rel}")
        elif rel not in fresh:
            out.append(f"left over (its .proto is gone): services/{rel}")
        elif fresh[rel] != current[rel]:
            out.append(f"stale: services/{rel}")
    return out


def write(fresh: dict[str, bytes]) -> None:
    """Make services/ hold exactly the fresh generated files; keep or create __init__.py."""
    for rel in committed().keys() - fresh.keys():
        (PKG_ROOT / rel).unlink()
    for rel, data in fresh.items():
        path = PKG_ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        init = path.parent / "__init__.py"
        if not init.exists():
            init.write_text(INIT_TEXT)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def schema_files() -> dict[str, bytes]:
    """{path relative to the repository: content} of the generated JSON Schema files."""
    try:
        from relayrl.coordinator.schema import SCHEMA_PATH, schema_text
    except ImportError as e:
        sys.exit(f"gen_protos: cannot import relayrl to build the config schema ({e}); pip install -e .")
    return {SCHEMA_PATH: schema_text().encode()}


def schema_differences(fresh: dict[str, bytes]) -> list[str]:
    """Lines "<kind>: <path>" for every schema file that is stale or missing."""
    out = []
    for rel, data in sorted(fresh.items()):
        path = ROOT / rel
        if not path.exists():
            out.append(f"missing: {rel}")
        elif path.read_bytes() != data:
            out.append(f"stale: {rel}")
    return out


def write_schemas(fresh: dict[str, bytes]) -> None:
    for rel, data in fresh.items():
        path = ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def version_warning() -> str | None:
    """A warning when the installed grpcio-tools is not the version pinned in pyproject.toml."""
    match = re.search(r'"grpcio-tools==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    try:
        installed = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        return None
    if match and match.group(1) != installed:
        return f"warning: grpcio-tools {installed} is installed but {match.group(1)} is pinned"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if anything differs")
    parser.add_argument(
        "--descriptor-set-out",
        type=Path,
        metavar="FILE",
        help="only write a FileDescriptorSet (imports and source comments included) to FILE",
    )
    args = parser.parse_args(argv)

    if args.descriptor_set_out:
        protoc(
            f"--descriptor_set_out={args.descriptor_set_out.resolve()}",
            "--include_source_info",
            "--include_imports",
        )
        return 0
    fresh, schemas = generate(), schema_files()
    if args.check:
        diffs, schema_diffs = differences(fresh, committed()), schema_differences(schemas)
        if diffs:
            print("generated gRPC code is out of date; run: python scripts/gen_protos.py", file=sys.stderr)
            print("\n".join(diffs), file=sys.stderr)
            if warning := version_warning():
                print(warning, file=sys.stderr)
        if schema_diffs:
            print(
                "the experiment config schema is out of date (a config model changed); run: "
                f"python scripts/gen_protos.py (built with pydantic {metadata.version('pydantic')})",
                file=sys.stderr,
            )
            print("\n".join(schema_diffs), file=sys.stderr)
        if diffs or schema_diffs:
            return 1
        print(f"gen_protos: {len(fresh)} generated files and {len(schemas)} schema up to date")
        return 0
    write(fresh)
    write_schemas(schemas)
    print(f"gen_protos: wrote {len(fresh)} files under services/ and {', '.join(sorted(schemas))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
