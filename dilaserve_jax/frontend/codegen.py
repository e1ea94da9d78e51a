"""Regenerate the committed gRPC stubs: `python -m dilaserve_jax.frontend.codegen` (from the repo root)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROTO = "dilaserve_jax/frontend/dilaserve.proto"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m dilaserve_jax.frontend.codegen",
                            description=f"Regenerate the Python gRPC stubs from {PROTO}.").parse_args(argv)
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    code = protoc.main(["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}",
                        f"--grpc_python_out={root}", str(root / PROTO)])
    if code:
        print(f"protoc failed with status {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
