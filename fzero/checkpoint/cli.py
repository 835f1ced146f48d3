"""``fzero checkpoint inspect|verify|export PATH``: look at, check and export checkpoints.

``main(argv)`` takes the arguments after ``fzero checkpoint``::

    fzero checkpoint inspect ckpt/step_100 [--json]   # what is in it (or: the checkpoints in a dir)
    fzero checkpoint verify ckpt/step_100             # every byte against its checksum
    fzero checkpoint export ckpt/step_100 model.safetensors [--dtype fp32|bf16|fp16|keep]

Exit codes: 0 success (``verify``: the checkpoint is intact); 1 the checkpoint is
corrupted, incomplete or does not fit; 2 a usage error or no such path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["add_arguments", "main", "run"]

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "keep": None}


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the checkpoint command's arguments to ``p`` (``fzero checkpoint``'s parser)."""
    p.add_argument("action", choices=("inspect", "verify", "export"),
                   help="inspect: print what a checkpoint holds (or list the checkpoints in a directory); "
                        "verify: check every byte against its checksum; export: write the parameters to "
                        "one safetensors file")
    p.add_argument("path", metavar="PATH", help="a checkpoint directory (inspect: or a directory of them)")
    p.add_argument("out", metavar="OUT", nargs="?", help="export: the .safetensors file to write")
    p.add_argument("--json", action="store_true", help="inspect: print the manifest as JSON")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="fp32",
                   help="export: cast floating parameters to this dtype (default fp32; keep: as saved)")
    p.add_argument("--no-verify", action="store_true", help="export: skip checksums")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``fzero checkpoint`` with ``argv`` (the arguments after ``checkpoint``); the exit code."""
    parser = add_arguments(argparse.ArgumentParser(
        prog="fzero checkpoint", description="Inspect, verify or export an fzero checkpoint."))
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2)
        return int(e.code or 0)
    return run(args, parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Carry out parsed arguments (see :func:`add_arguments`); returns the exit code."""
    from fzero.checkpoint import CheckpointError

    prog = parser.prog if parser is not None else "fzero checkpoint"
    if args.action == "export" and not args.out:
        print(f"{prog}: error: export needs OUT, the .safetensors file to write", file=sys.stderr)
        return 2
    if not os.path.exists(args.path):
        print(f"{prog}: error: no such file or directory: {args.path}", file=sys.stderr)
        return 2
    try:
        if args.action == "inspect":
            return _inspect(args.path, as_json=args.json)
        if args.action == "verify":
            return _verify(args.path)
        return _export(args.path, args.out, _DTYPES[args.dtype], not args.no_verify)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"{prog} {args.action}: {e}", file=sys.stderr)
        return 1


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _stages(stages) -> str:
    if not isinstance(stages, list) or not stages:
        return "ZeRO stage ?"
    return "ZeRO stage " + " or ".join(str(s) for s in stages)


def _inspect(path: str, *, as_json: bool) -> int:
    from fzero.checkpoint import _format, _leaves, manifest

    if not os.path.exists(os.path.join(path, _format.MARKER)) and not os.path.exists(
            os.path.join(path, _format.MANIFEST)) and os.path.isdir(path):
        return _list(path)
    man = manifest(path)
    if as_json:
        print(json.dumps(man, indent=1))
        return 0
    total = sum(f["bytes"] for f in man["files"].values())
    tensors = [r for r in man["leaves"] if r["kind"] == "tensor"]
    numel = sum(_numel(r["shape"]) for r in tensors)
    print(f"checkpoint {os.path.abspath(path)} (committed)")
    # The manifest's descriptive fields are shown as written (or "?"): reading does not need them.
    info = {k: man.get(k, "?") for k in ("step", "tp", "stages", "fzero_version", "torch_version", "created")}
    tp = f" | tp {info['tp']}" if info["tp"] not in (1, "?") else ""
    print(f"  step {info['step']} | saved by {man['world_size']} rank{'s' if man['world_size'] != 1 else ''} | "
          f"{_stages(info['stages'])}{tp} | fzero {info['fzero_version']} | torch {info['torch_version']} | "
          f"{info['created']}")
    print(f"  files: {len(man['files'])}, {_size(total)}")
    for name, f in sorted(man["files"].items()):
        print(f"    {name}  {_size(f['bytes'])}  crc32-of-blocks {f['crc32']}")
    parts = man.get("parts") or []
    if not (isinstance(parts, list) and all(isinstance(p, dict) and isinstance(p.get("ranks"), list) and p["ranks"]
                                            and all(type(q) is int for q in p["ranks"])
                                            for p in parts)):
        parts = []  # not what a save writes: not shown
    if len(parts) > 1:  # ranks that held different trees: the stages of a pipeline
        print(f"  parts: {len(parts)} (ranks holding different leaves, e.g. pipeline stages)")
        for i, part in enumerate(parts):
            print(f"    part {i}: rank{'s' if len(part['ranks']) != 1 else ''} {_ranks(part['ranks'])}, "
                  f"{part.get('leaves', '?')} leaves")
    print(f"  leaves: {len(man['leaves'])} ({len(tensors)} tensors, {numel:,} elements)")
    width = max((len(r["path"]) for r in man["leaves"]), default=0)
    for r in man["leaves"]:
        held = ""
        if len(parts) > 1 and isinstance(r.get("parts"), list) and r["parts"]:
            held = f"  [part{'s' if len(r['parts']) != 1 else ''} {', '.join(map(str, r['parts']))}]"
        if r["kind"] == "value":
            print(f"    {r['path']:<{width}}  {r['type']:<9} {r['value']!r}{held}")
            continue
        real = _leaves.whole_shape(r)
        shape = "(" + ", ".join(map(str, real)) + ("," if len(real) == 1 else "") + ")"
        sh = r.get("sharding")
        where = (f"replicated, in {r['pieces'][0]['file'] if r['pieces'] else 'no file'}" if sh is None else
                 f"{len(r['pieces'])} piece{'s' if len(r['pieces']) != 1 else ''} over {sh['world']} ranks")
        if r.get("tp"):  # shape is the whole tensor's; each tp slice replicated or in ZeRO pieces
            split = f"dim {r['tp']['dim']} split over tp={r['tp']['size']}"
            where = (f"{split}, in {', '.join(sorted({p['file'] for p in r['pieces']}))}" if sh is None else
                     f"{split}, each slice over {sh['world']} ranks, {len(r['pieces'])} pieces")
        print(f"    {r['path']:<{width}}  {r['dtype']:<9} {shape:<14} {where}{held}")
    if man.get("metadata") is not None:
        print(f"  metadata: {json.dumps(man['metadata'])}")
    return 0


def _list(root: str) -> int:
    from fzero.checkpoint import _save

    found = _save._committed(os.path.abspath(root))
    debris = [n for n in os.listdir(root) if n.startswith(".") and ".tmp-" in n]
    if not found:
        print(f"{root}: no committed checkpoints" + (f" ({len(debris)} unfinished saves)" if debris else ""))
        return 0
    print(f"{os.path.abspath(root)}: {len(found)} committed checkpoint{'s' if len(found) != 1 else ''}"
          + (f", {len(debris)} unfinished saves (ignored)" if debris else ""))
    for i, ((step, _, name), _p) in enumerate(found):
        print(f"  {name}  step {step if step >= 0 else '?'}{'  <- latest' if i == len(found) - 1 else ''}")
    return 0


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _verify(path: str) -> int:
    from fzero.checkpoint import verify

    res = verify(path)
    print(f"OK: {path}: {res['files']} files, {_size(res['bytes'])} verified")
    return 0


def _export(path: str, out: str, dtype_name: str | None, verify: bool) -> int:
    import torch

    from fzero.checkpoint import export

    dtype = None if dtype_name is None else getattr(torch, dtype_name)
    names = export(path, out, dtype=dtype, verify=verify)
    print(f"wrote {len(names)} parameters to {out}")
    return 0
