"""``mfsdp-checkpoint``: convert and inspect checkpoints from the shell (usage and exit status:
the package README, "Command line")."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from mfsdp_checkpoint.convert import FORMATS, convert, describe
from mfsdp_checkpoint.errors import CheckpointError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mfsdp-checkpoint",
        description="Convert and inspect megatron-fsdp / torch DCP checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    conv = commands.add_parser(
        "convert", help="convert between a DCP directory, a torch file and safetensors"
    )
    conv.add_argument("src", help="DCP directory, torch file or safetensors file")
    conv.add_argument("dst", help="output path (a directory for --to dcp)")
    conv.add_argument("--to", required=True, choices=FORMATS, help="output format")
    conv.add_argument(
        "--select",
        metavar="SECTION",
        help="keep one top-level section (e.g. 'model') and drop it from the names",
    )
    conv.add_argument(
        "--strip-prefix",
        "--hf-prefix-strip",
        dest="strip_prefixes",
        action="append",
        default=[],
        metavar="PREFIX",
        help="remove PREFIX from names (repeatable), e.g. 'module.' for Hugging Face",
    )
    insp = commands.add_parser(
        "inspect",
        aliases=["describe"],
        help="list keys, shapes, dtypes, sizes, world size, and which writer named the keys",
    )
    insp.add_argument("src")
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.add_argument("--verify", action="store_true", help="also check the recorded CRC32s")
    for command in (conv, insp):
        command.add_argument(
            "--allow-pickle",
            action="store_true",
            help="read torch files with arbitrary pickled objects (only for files you trust)",
        )
    return parser


def _print_report(report: dict[str, Any]) -> None:
    print(f"path:        {report['path']}")
    print(f"format:      {report['format']}")
    print(f"world size:  {report['world_size'] if report['world_size'] is not None else 'n/a'}")
    print(f"complete:    {report['complete']}")
    if "writer" in report:
        naming = report["naming"]
        prefix = repr(naming["model_prefix"]) if naming["model_prefix"] else "none"
        print(f"writer:      {report['writer']}")
        print(f"naming:      model prefix {prefix}, optimizer state {naming['optimizer_state']}")
    print(f"tensors:     {len(report['tensors'])}")
    print(f"total bytes: {report['total_bytes']}")
    if "verified" in report:
        print(f"verified:    {report['verified']}")
    width = max((len(t["key"]) for t in report["tensors"]), default=0)
    for tensor in report["tensors"]:
        shape = "x".join(str(d) for d in tensor["shape"]) or "scalar"
        print(f"  {tensor['key']:<{width}}  {tensor['dtype']:<9} {shape:<14} {tensor['bytes']}")
    for key in report["objects"]:
        print(f"  {key:<{width}}  object")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "convert":
            out = convert(
                args.src,
                args.dst,
                args.to,
                select=args.select,
                strip_prefixes=args.strip_prefixes,
                allow_pickle=args.allow_pickle,
            )
            print(f"wrote {out} ({args.to})")
        else:
            report = describe(args.src, verify=args.verify, allow_pickle=args.allow_pickle)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                _print_report(report)
    except CheckpointError as error:
        print(f"mfsdp-checkpoint: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
