"""``bcastbench schema FILE -o schema.yaml``: a recorded batch read safely, its schema extracted
and written as YAML (no data); errors are one line."""

from __future__ import annotations

import argparse
import os
import sys

from harness.payload.payload_schema import write
from harness.payload.recording import load
from harness.payload.schema_extract import extract
from harness.payload.user_files import SCHEMA_FLAGS, PayloadFileError


def _overwrites(out: str, source: str) -> bool:
    """Whether writing ``out`` would replace the recording or a file inside its directory."""
    out_real, source_real = os.path.realpath(out), os.path.realpath(source)
    return out_real == source_real or out_real.startswith(source_real.rstrip(os.sep) + os.sep)


def main(argv: list[str] | None = None) -> int:
    """``bcastbench schema FILE -o schema.yaml [--trust] [--max-bytes N]``: reads the file
    through ``recording.load`` (so it runs no code without ``--trust``); errors are one line and
    exit 2."""
    parser = argparse.ArgumentParser(
        prog="bcastbench schema", description="Write a recorded batch's schema (no data)."
    )
    parser.add_argument("file", help="a recorded batch (see payload=file)")
    parser.add_argument("-o", "--out", default="schema.yaml", help="where the YAML goes")
    parser.add_argument("--trust", action="store_true", help="allow arbitrary unpickling")
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="refuse a recording larger than this (default: a quarter of physical memory)",
    )
    args = parser.parse_args(argv)
    try:
        if _overwrites(args.out, args.file):
            raise PayloadFileError(f"-o {args.out} would overwrite the recording {args.file}")
        dp = load(args.file, trust=args.trust, max_bytes=args.max_bytes, flags=SCHEMA_FLAGS)
        schema = extract(dp)
    except PayloadFileError as exc:
        print(f"bcastbench schema: error: {exc}", file=sys.stderr)
        return 2
    try:
        out = write(schema, args.out)
    except OSError as exc:
        print(f"bcastbench schema: error: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    print(
        f"wrote {out}: {len(schema['leaves'])} leaves, "
        f"{len(schema['non_tensor_batch'])} non-tensor keys, {len(schema['meta_info'])} "
        f"meta_info keys (batch of {schema['batch_size']} rows; no data)"
    )
    return 0
