"""The collectives of compiled HLO text, as executed: how many, and the bytes each moves per device.

Read by the benchmarks that compare communication designs (`bench_expert_parallel.py`,
`bench_comms.py`). A collective inside a while loop counts its loop's known trip count times, a
conditional its costliest branch (an upper bound). The buffer of a collective: an all-gather's
result, a reduce-scatter's input, an all-reduce's operand, an all-to-all's operand; a ragged
all-to-all's smaller buffer (its operand or its result), which is what each device sends on
average when every row crosses once (dropless routing: each of the T k assignments once per
exchange; its other buffer is a static worst case).
"""

from __future__ import annotations

import collections
import math
import re

COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2,
         "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}  # fmt: skip
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * BYTES.get(dtype, 0)
    return total


def _group_size(ins: dict, shapes: dict[str, str], devices: int) -> int:
    """Devices in each replica group of a collective: from its operand and result sizes (an
    all-gather or reduce-scatter), else its replica groups (`{{0,1},{2,3}}`, or the mesh form
    `mesh['axis_0'=4,'axis_1'=2] {'axis_0'}`, without the axis list: the first axis)."""
    operand = re.match(r"\s*%?([\w.\-]+)", ins["rest"])
    source = shapes.get(operand.group(1)) if operand else None
    if source and ins["op"].removesuffix("-start") in ("all-gather", "reduce-scatter"):
        a, b = _shape_bytes(ins["shape"]), _shape_bytes(source)
        return max(a, b) // max(min(a, b), 1)
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", ins["rest"])
    if listed:
        return len(listed.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(\{[^}]*\})?", ins["rest"])
    if mesh:
        sizes = re.findall(r"'(\w+)'=(\d+)", mesh.group(1))
        named = re.findall(r"'(\w+)'", mesh.group(2) or "") or [sizes[0][0]]
        return math.prod(int(dict(sizes)[a]) for a in named)
    return devices


def _dims(shape: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for _, dims in _ARRAY.findall(shape)]


def parse_hlo(text: str) -> tuple[dict, str]:
    """({computation: [instruction dicts]}, the entry computation's name) of HLO text."""
    computations, entry, current = {}, "", None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = computations.setdefault(m.group(1), [])
                entry = m.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m:
            name, shape, opcode, rest = m.groups()
            current.append({"name": name, "shape": shape, "op": opcode, "rest": rest})
    return computations, entry


def _callees(ins: dict) -> tuple[str, list[str], int]:
    """(how the callees run: "loop", "branches" or "call", their names, the trip count)."""
    rest = ins["rest"]
    if ins["op"] == "while":
        body = re.search(r"body=%?([\w.\-]+)", rest)
        trips = re.search(r'known_trip_count[^0-9]*"n":"(\d+)"', rest)
        return "loop", [body.group(1)] if body else [], int(trips.group(1)) if trips else 1
    if ins["op"] == "conditional":
        listed = re.search(r"branch_computations=\{([^}]*)\}", rest)
        names = listed.group(1).split(",") if listed else []
        names += re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", rest)
        return "branches", [n.strip().lstrip("%") for n in names if n.strip()], 1
    if ins["op"] in ("call", "async-start"):
        callee = re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", rest)
        return "call", [callee.group(1)] if callee else [], 1
    return "", [], 1


EXPERT_GATHER = "all-gather of an expert kernel"
KINDS = (*COLLECTIVES, EXPERT_GATHER)


RAGGED = "ragged-all-to-all"


def _operand_shape(ins: dict, shapes: dict[str, str]) -> str:
    operand = re.match(r"\s*%?([\w.\-]+)", ins["rest"])
    return shapes.get(operand.group(1), "") if operand else ""


def _buffer_bytes(ins: dict, kind: str, shapes: dict[str, str], n: int) -> int:
    """The bytes of a collective's buffer (module doc)."""
    if kind == RAGGED:
        return min(_shape_bytes(ins["shape"]), _shape_bytes(_operand_shape(ins, shapes)))
    return _shape_bytes(ins["shape"]) * (n if kind == "reduce-scatter" else 1)


def executed_collectives(
    text: str, kernel_dims: set[tuple[int, ...]], devices: int
) -> tuple[dict, list[dict]]:
    """({kind: {"ops": executed count, "static": in the text, "bytes": executed buffer bytes,
    "ring_bytes": what each device sends with ring algorithms}}, every collective with its
    shape, group size and how often it runs (each branch of a conditional listed)) of compiled
    HLO text. The buffer of a collective: the module doc's; ring bytes: (n - 1) / n of it (twice
    for an all-reduce) over groups of n (for an all-to-all: what it sends to the other devices
    when its rows go to each alike). An all-gather whose result has one of `kernel_dims` also counts as `EXPERT_GATHER`."""
    computations, entry = parse_hlo(text)
    shapes = {i["name"]: i["shape"] for c in computations.values() for i in c}
    listing: list[dict] = []
    static = collections.Counter()

    def cost(name: str, times: int, seen: frozenset) -> tuple[collections.Counter, ...]:
        ops, nbytes = collections.Counter(), collections.Counter()
        for ins in computations.get(name, []):
            kind = ins["op"].removesuffix("-start")
            if kind in COLLECTIVES:
                n = _group_size(ins, shapes, devices)
                size = _buffer_bytes(ins, kind, shapes, n)
                ring = size * (n - 1) / n * (2 if kind == "all-reduce" else 1)
                kinds = [kind]
                if kind == "all-gather" and set(_dims(ins["shape"])) & kernel_dims:
                    kinds.append(EXPERT_GATHER)
                for k in kinds:
                    ops[k] += 1
                    nbytes[k] += size
                    nbytes["ring " + k] += ring
                    static[k] += 1
                shape = _operand_shape(ins, shapes) + " -> " if kind == RAGGED else ""
                listing.append({"op": kind, "shape": shape + ins["shape"], "bytes": size,
                                "runs": times, "group": n})  # fmt: skip
                continue
            how, callees, trips = _callees(ins)
            callees = [c for c in callees if c in computations and c not in seen]
            if not callees:
                continue
            inner = [cost(c, times * trips, seen | {c}) for c in callees]
            if how == "branches":  # the costliest branch
                inner = [max(inner, key=lambda oc: sum(oc[1][k] for k in COLLECTIVES))]
            for o, b in inner:
                ops.update({k: v * trips for k, v in o.items()})
                nbytes.update({k: v * trips for k, v in b.items()})
        return ops, nbytes

    ops, nbytes = cost(entry, 1, frozenset({entry}))
    summary = {k: {"ops": ops[k], "static": static[k], "bytes": nbytes[k],
                   "ring_bytes": round(nbytes["ring " + k])} for k in KINDS}  # fmt: skip
    return summary, listing


def distinct(listing: list[dict]) -> list[dict]:
    """The collectives by (op, shape, group, runs), each with how many times the HLO text holds
    it ("in_text"; the branches of a conditional each hold one), largest first."""
    counts = collections.Counter()
    for c in listing:
        shape = re.sub(r"\{[^}]*\}", "", c["shape"])  # without layouts
        counts[c["op"], shape, c["group"], c["runs"], c["bytes"]] += c.get("in_text", 1)
    rows = [{"op": op, "shape": shape, "group": group, "runs": runs, "bytes": size, "in_text": n}
            for (op, shape, group, runs, size), n in counts.items()]  # fmt: skip
    return sorted(rows, key=lambda c: -c["bytes"] * c["runs"])
