"""Slurm's compressed host lists (``SLURM_STEP_NODELIST``, ``SLURM_JOB_NODELIST``) expanded.

Slurm writes a list of names separated by commas; a name may hold bracket groups of numbers
and ranges, ``node[10,20-25]``, ``a[01-03],b7``, ``n[1-2]-ib,gpu[001-004]``, also several in
one name, ``rack[1-2]-node[01-02]`` (the first group varies slowest, as ``scontrol show
hostnames`` prints them). A range keeps the zero padding of its low end: ``[08-10]`` is 08, 09,
10 and ``[8-10]`` is 8, 9, 10. Names keep Slurm's order, duplicates included.
"""

from __future__ import annotations

import itertools

from collective.errors import UsageError

MAX_NAMES = 100_000  # more names than any cluster has: a typo such as n[1-9999999]


def expand_nodelist(text: str, *, what: str = "node list") -> list[str]:
    """The host names of a Slurm host list, in order. Raises ``UsageError`` naming ``what``,
    the text and the problem when it is not a host list Slurm could have written."""

    def bad(problem: str) -> UsageError:
        return UsageError(f"{what} {text!r} is not a Slurm host list: {problem}")

    if not isinstance(text, str) or not text.strip():
        raise bad("it is empty")
    names: list[str] = []
    for item in _split_top(text.strip(), bad):
        names.extend(_expand_name(item, bad))
        if len(names) > MAX_NAMES:
            raise bad(f"it names more than {MAX_NAMES} hosts")
    return names


def _split_top(text: str, bad) -> list[str]:
    """Split at the commas outside brackets; check the brackets pair up, one level deep."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        if c == "[":
            if depth:
                raise bad(f"'[' inside brackets at position {i}")
            depth = 1
        elif c == "]":
            if not depth:
                raise bad(f"']' without '[' at position {i}")
            depth = 0
        elif c == "," and not depth:
            items.append(text[start:i])
            start = i + 1
        elif c.isspace():
            raise bad(f"white space at position {i}")
    if depth:
        raise bad("a '[' is never closed")
    items.append(text[start:])
    for item in items:
        if not item:
            raise bad("an empty name (two commas in a row, or one at an end)")
    return items


def _expand_name(item: str, bad) -> list[str]:
    parts: list[list[str]] = []  # literal text and bracket groups, in order
    rest = item
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            parts.append([rest])
            break
        if open_at:
            parts.append([rest[:open_at]])
        close_at = rest.index("]", open_at)
        parts.append(_expand_group(rest[open_at + 1:close_at], item, bad))
        rest = rest[close_at + 1:]
    count = 1
    for p in parts:
        count *= len(p)
        if count > MAX_NAMES:
            raise bad(f"{item!r} names more than {MAX_NAMES} hosts")
    return ["".join(combo) for combo in itertools.product(*parts)]


def _expand_group(group: str, item: str, bad) -> list[str]:
    if not group:
        raise bad(f"empty brackets in {item!r}")
    out: list[str] = []
    for piece in group.split(","):
        lo, dash, hi = piece.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or not lo.isascii() or not hi.isascii():
            raise bad(f"{piece!r} in {item!r} is not a number or a range of numbers (like 01-04)")
        if not dash:
            out.append(lo)
            continue
        low, high = int(lo), int(hi)
        if low > high:
            raise bad(f"range {piece!r} in {item!r} runs backwards")
        if high - low >= MAX_NAMES:
            raise bad(f"range {piece!r} in {item!r} names more than {MAX_NAMES} hosts")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(low, high + 1))
    return out
