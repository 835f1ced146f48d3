"""Hostfiles and ``--include`` / ``--exclude`` filters, with DeepSpeed's syntax and meaning.

A hostfile lists the machines of a job and how many slots (accelerators, or ranks on a CPU
host) each offers, one ``HOST slots=N`` per line, as DeepSpeed's and MPI's do::

    # the two boxes under my desk
    worker-0 slots=4
    worker-1 slots=4    # a trailing comment is fine too

A filter selects slots from that table (DeepSpeed's ``parse_resource_filter``)::

    NODE_SPEC[@NODE_SPEC ...]      NODE_SPEC = HOST[:SLOT[,SLOT ...]]

``worker-0@worker-1:0,2`` as ``--include`` selects every slot of ``worker-0`` and slots 0
and 2 of ``worker-1``; as ``--exclude`` it selects everything except those. A host named
several times gets the union of its mentions (a bare ``HOST`` mention means all its slots).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "HostfileError",
    "parse_hostfile",
    "read_hostfile",
    "parse_filter",
    "select_slots",
]

# Characters the filter syntax reserves, so a host containing them could not be named.
_RESERVED = "@:,"
_SLOTS = re.compile(r"slots=(\S*)")


class HostfileError(ValueError):
    """A malformed hostfile or filter; the message names the file and line, or the host."""


def parse_hostfile(text: str, *, source: str = "hostfile") -> dict[str, int]:
    """Parse hostfile text into ``{host: slots}``, in file order.

    Args:
        text: the file's contents.
        source: how errors name the file (its path).

    Returns:
        An insertion-ordered dict; the order is the node-rank order.

    Raises:
        HostfileError: a line that is not ``HOST slots=N [# comment]``, a host listed twice,
            ``N`` not a positive integer, or no host at all. The message names
            ``source`` and the 1-based line number.

    Example:
        >>> parse_hostfile("# lab\\nw0 slots=2\\n\\nw1 slots=4  # big one\\n")
        {'w0': 2, 'w1': 4}
    """
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {lineno}"
        fields = line.split()
        if len(fields) != 2 or not _SLOTS.fullmatch(fields[1]):
            raise HostfileError(f"{where}: expected 'HOST slots=N', got {raw.strip()!r}")
        host, count = fields[0], _SLOTS.fullmatch(fields[1]).group(1)
        bad = [c for c in _RESERVED if c in host]
        if bad:
            raise HostfileError(
                f"{where}: host name {host!r} contains {bad[0]!r}, which --include/--exclude "
                f"reserve ('{_RESERVED}')"
            )
        if not count.isdigit() or int(count) < 1:
            raise HostfileError(f"{where}: slots must be a positive integer, got slots={count!r} for host {host!r}")
        if host in hosts:
            raise HostfileError(f"{where}: host {host!r} is listed twice (first on line {first_line[host]})")
        hosts[host], first_line[host] = int(count), lineno
    if not hosts:
        raise HostfileError(f"{source}: no hosts (expected lines 'HOST slots=N')")
    return hosts


def read_hostfile(path: str | Path) -> dict[str, int]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile`).

    Raises:
        HostfileError: the file cannot be read, or is malformed.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostfileError(f"hostfile {str(path)!r} cannot be read: {e.strerror or e}") from None
    return parse_hostfile(text, source=f"hostfile {str(path)!r}")


def parse_filter(spec: str, *, option: str = "--include") -> dict[str, set[int] | None]:
    """Parse ``HOST[:SLOT,...][@HOST[:SLOT,...]...]`` into ``{host: slots or None}``.

    ``None`` means "the whole host". Mentions of one host merge (union; a whole-host
    mention wins). Hosts and slots are not checked against any hostfile here.

    Raises:
        HostfileError: an empty node spec, an empty or non-integer slot; the message
            starts with ``option`` and quotes the offending part.

    Example:
        >>> parse_filter("w0@w1:0,2@w1:3")
        {'w0': None, 'w1': {0, 2, 3}}
    """
    out: dict[str, set[int] | None] = {}
    for node in spec.split("@"):
        node = node.strip()
        if not node:
            raise HostfileError(f"{option} {spec!r}: empty node spec (expected HOST[:SLOT,...] between '@')")
        host, sep, slot_text = node.partition(":")
        host = host.strip()
        if not host:
            raise HostfileError(f"{option} {spec!r}: node spec {node!r} has no host name")
        if not sep:
            out[host] = None
            continue
        slots: set[int] = set()
        for item in slot_text.split(","):
            item = item.strip()
            if not item.isdigit():
                raise HostfileError(
                    f"{option} {spec!r}: slot {item!r} of host {host!r} is not a non-negative integer"
                )
            slots.add(int(item))
        if host not in out:
            out[host] = slots
        elif out[host] is not None:
            out[host] |= slots
    return out


def select_slots(hosts: dict[str, int], *, include: str = "", exclude: str = "") -> dict[str, list[int]]:
    """The slots of each host that a job uses, after ``include`` or ``exclude``.

    Args:
        hosts: ``{host: slot count}``, as :func:`parse_hostfile` returns; slots are
            numbered ``0 .. count-1``.
        include: keep only these (DeepSpeed's ``--include``).
        exclude: keep all but these (DeepSpeed's ``--exclude``).

    Returns:
        ``{host: sorted slot list}`` in hostfile order, hosts left with no slot dropped.

    Raises:
        HostfileError: both filters given; a host not in ``hosts``; a slot the host does not
            have; a filter that leaves no slot at all. The message names the host or slot.

    Example:
        >>> select_slots({"w0": 4, "w1": 4}, include="w0@w1:0,2")
        {'w0': [0, 1, 2, 3], 'w1': [0, 2]}
        >>> select_slots({"w0": 4, "w1": 4}, exclude="w0:1@w1")
        {'w0': [0, 2, 3]}
    """
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive; give one of them")
    option, spec = ("--include", include) if include else ("--exclude", exclude)
    full = {h: list(range(n)) for h, n in hosts.items()}
    if not spec:
        return full
    named = parse_filter(spec, option=option)
    for host, slots in named.items():
        if host not in hosts:
            known = ", ".join(hosts) if len(hosts) <= 8 else ", ".join(list(hosts)[:8]) + ", ..."
            raise HostfileError(f"{option} {spec!r}: host {host!r} is not in the hostfile (hosts: {known})")
        for s in sorted(slots or ()):
            if s >= hosts[host]:
                raise HostfileError(
                    f"{option} {spec!r}: host {host!r} has no slot {s} (it has slots 0-{hosts[host] - 1})"
                )
    out: dict[str, list[int]] = {}
    for host, all_slots in full.items():
        if include:
            chosen = all_slots if host in named and named[host] is None else sorted(named.get(host) or ())
        else:
            gone = set(all_slots) if host in named and named[host] is None else (named.get(host) or set())
            chosen = [s for s in all_slots if s not in gone]
        if chosen:
            out[host] = chosen
    if not out:
        raise HostfileError(f"{option} {spec!r} leaves no slot to run on")
    return out
