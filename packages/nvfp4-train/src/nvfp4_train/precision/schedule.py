"""Precision schedule: which preset quantizes each GEMM of each linear, step by step.

`precision.schedule` is an ordered list of `ScheduleRule`s ("these layers, these GEMMs, this
step window: this recipe"); later rules win. `nvfp4_train.precision.policy.schedule_rules` puts the older
settings in front of them as implicit rules and resolves all to `Rule`s (module paths and
concrete steps); `resolve_phases` splits the run at every window boundary into `PrecisionPhase`s,
each with one preset per (linear, GEMM) and the `nvfp4_ops.Recipe` that composes them
(`nvfp4_ops.recipe.compose`). Steps are counted as completed steps: the training step with `k`
completed steps before it, and validation of a model with `k` completed steps, use the phase
whose window holds `k`.

Example:
    >>> paths = ("layers.0.attn.qkv", "layers.1.attn.qkv")
    >>> rules = (Rule(paths, GEMMS, 0, None, "nvfp4", "precision.recipe"),
    ...          Rule(paths[1:], ("fprop",), 3, None, "bf16", "precision.schedule[0]"))
    >>> phases = resolve_phases(rules, paths, total_steps=10)
    >>> [(p.start, p.stop, p.names["layers.1.attn.qkv"]) for p in phases]
    [(0, 3, ('nvfp4', 'nvfp4', 'nvfp4')), (3, None, ('bf16', 'nvfp4', 'nvfp4'))]
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import nvfp4_ops
from nvfp4_ops.recipe import compose
from nvfp4_train.errors import ConfigError

GEMMS = ("fprop", "dgrad", "wgrad")
"""The three GEMMs of a linear, in the order of `PrecisionPhase.names` triples."""

STEP_OR_FRACTION = "a step number (int >= 0) or a fraction of train.steps (float in (0, 1])"


def check_step_or_fraction(value: object, key: str, *, nullable: bool = False) -> None:
    """Raises ValueError naming `key` unless `value` is an int >= 0 or a float in (0, 1]
    (or None when `nullable`).

    Example:
        >>> check_step_or_fraction(0.5, "from")
        >>> try:
        ...     check_step_or_fraction(-1, "from")
        ... except ValueError as err:
        ...     print(str(err).split("), ")[-1])
        got the step -1
    """
    expected = ("null, " if nullable else "") + STEP_OR_FRACTION
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be {expected}, got {value!r}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{key} must be {expected}, got the step {value}")
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        raise ValueError(f"{key} must be {expected}, got the fraction {value}")


def step_of(value: int | float, total_steps: int) -> int:
    """A step number, or a fraction of `total_steps` rounded half up.

    Example:
        >>> step_of(0.82, 1000), step_of(0.25, 6), step_of(30, 1000)
        (820, 2, 30)
    """
    if isinstance(value, float):
        return math.floor(value * total_steps + 0.5)
    return value


@dataclasses.dataclass(frozen=True)
class ScheduleRule:
    """One entry of `precision.schedule`: from step `from` until step `until`, the GEMMs
    `gemms` of the linears whose path fullmatches `layers` are quantized as the preset `recipe`.

    Attributes:
        layers: regex fullmatched against module paths such as `layers.3.mlp.down`.
        gemms: GEMMs from `GEMMS` ("fprop", "dgrad", "wgrad"); default all three.
        from_: the YAML key `from`: first completed-step count of the window, an int step >= 0
            or a float fraction in (0, 1] of `train.steps` (rounded half up).
        until: the YAML key `until`: the window ends before this count (same forms), or None
            (default): the end of the run, final validation included.
        recipe: an `nvfp4_ops.RECIPES` preset name.

    Example:
        >>> ScheduleRule(layers=r"layers\\.1\\..*", gemms=("dgrad",), from_=6, recipe="mxfp4").gemms
        ('dgrad',)
    """

    layers: str = ".*"
    gemms: tuple[str, ...] = GEMMS
    from_: int | float = dataclasses.field(default=0, metadata={"config_key": "from"})
    until: int | float | None = None
    recipe: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.layers, str):
            raise ValueError(f"layers must be a regex string, got {self.layers!r}")
        try:
            re.compile(self.layers)
        except re.error as err:
            raise ValueError(f"layers: bad regex {self.layers!r}: {err}") from None
        if isinstance(self.gemms, str) or not self.gemms:
            raise ValueError(
                f"gemms must be a non-empty list from {list(GEMMS)}, got {self.gemms!r}"
            )
        object.__setattr__(self, "gemms", tuple(self.gemms))
        unknown = [g for g in self.gemms if g not in GEMMS]
        if unknown:
            raise ValueError(
                f"gemms: unknown GEMM {unknown[0]!r}; expected names from {list(GEMMS)}"
            )
        check_step_or_fraction(self.from_, "from")
        check_step_or_fraction(self.until, "until", nullable=True)
        same_kind = type(self.from_) is type(self.until)
        if same_kind and self.from_ >= self.until:
            raise ValueError(f"from must be < until, got from={self.from_!r}, until={self.until!r}")
        if not self.recipe:
            raise ValueError(f"recipe is required: one of {sorted(nvfp4_ops.RECIPES)}")
        if self.recipe not in nvfp4_ops.RECIPES:
            raise ValueError(
                f"recipe must be one of {sorted(nvfp4_ops.RECIPES)}, got {self.recipe!r}"
            )


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule resolved for one model and run: GEMMs `gemms` of the linears `paths` use the
    preset `recipe` for completed-step counts `start <= k < stop` (`stop` None: no end).
    `source` names where it came from in the config (for messages)."""

    paths: tuple[str, ...]
    gemms: tuple[str, ...]
    start: int
    stop: int | None
    recipe: str
    source: str

    def covers(self, completed: int) -> bool:
        """Whether the window holds `completed` steps."""
        return self.start <= completed and (self.stop is None or completed < self.stop)


def resolve_rule(rule: ScheduleRule, index: int, paths: Sequence[str], total_steps: int) -> Rule:
    """`rule` (entry `index` of `precision.schedule`) on the linears `paths` of a run of
    `total_steps` steps.

    Raises:
        ConfigError: the regex matches no linear, or the window is empty once resolved.
    """
    source = f"precision.schedule[{index}]"
    pattern = re.compile(rule.layers)
    matched = tuple(p for p in paths if pattern.fullmatch(p))
    if not matched:
        raise ConfigError(
            f"{source} (layers={rule.layers!r}) matches no linear; paths look like "
            f"{list(paths[:4])}"
        )
    start = step_of(rule.from_, total_steps)
    stop = None if rule.until is None else step_of(rule.until, total_steps)
    if start >= (total_steps if stop is None else stop):
        until = "null (the end)" if rule.until is None else repr(rule.until)
        raise ConfigError(
            f"{source}: from={rule.from_!r} until={until} is the empty window "
            f"[{start}, {total_steps if stop is None else stop}) of train.steps={total_steps}; "
            "from must be < until"
        )
    return Rule(matched, rule.gemms, start, stop, rule.recipe, source)


@dataclasses.dataclass(frozen=True)
class PrecisionPhase:
    """The precision of every linear for completed-step counts `start <= k < stop` (`stop`
    None: to the end, final validation included).

    Attributes:
        start, stop: the window.
        names: module path -> (fprop, dgrad, wgrad) preset names.
        recipes: module path -> the composed `nvfp4_ops.Recipe` the model runs.
    """

    start: int
    stop: int | None
    names: dict[str, tuple[str, str, str]]
    recipes: dict[str, nvfp4_ops.Recipe]

    @property
    def label(self) -> str:
        """The window as `[start, stop)`, e.g. `[3, 6)` or `[6, end)`."""
        return f"[{self.start}, {'end' if self.stop is None else self.stop})"

    @property
    def key(self) -> tuple[nvfp4_ops.Recipe, ...]:
        """The recipes in path order: equal keys compute alike (one compiled step serves both)."""
        return tuple(self.recipes.values())


def _names_at(rules: Sequence[Rule], paths: Sequence[str], completed: int) -> dict:
    """Path -> (fprop, dgrad, wgrad) presets at `completed` steps: later rules win."""
    cells = {(p, g): None for p in paths for g in GEMMS}
    for rule in rules:
        if rule.covers(completed):
            cells.update({(p, g): rule.recipe for p in rule.paths for g in rule.gemms})
    missing = [key for key, name in cells.items() if name is None]
    if missing:
        raise ValueError(f"no rule covers {missing[0]} at step {completed}")
    return {p: tuple(cells[p, g] for g in GEMMS) for p in paths}


def resolve_phases(
    rules: Sequence[Rule], paths: Sequence[str], total_steps: int
) -> tuple[PrecisionPhase, ...]:
    """The phases of `rules` (later rules win) over the linears `paths` of a run of
    `total_steps` steps.

    Every window boundary up to `total_steps` starts a phase; consecutive phases with the same
    presets merge. The last phase has no end. `rules` must cover every (path, GEMM) at every
    step (a rule from 0 without end over all of them first, as `policy.schedule_rules` puts).
    """
    edges = {r.start for r in rules} | {r.stop for r in rules if r.stop is not None}
    bounds = sorted({0} | {b for b in edges if b <= total_steps})
    phases: list[tuple[int, dict]] = []
    for start in bounds:
        names = _names_at(rules, paths, start)
        if not phases or phases[-1][1] != names:
            phases.append((start, names))
    stops = [start for start, _ in phases[1:]] + [None]
    cache: dict[tuple[str, str, str], nvfp4_ops.Recipe] = {}
    return tuple(
        PrecisionPhase(start, stop, names, {p: _composed(n, cache) for p, n in names.items()})
        for (start, names), stop in zip(phases, stops, strict=True)
    )


def _composed(names: tuple[str, str, str], cache: dict) -> nvfp4_ops.Recipe:
    if names not in cache:
        cache[names] = compose(*(nvfp4_ops.get_recipe(n) for n in names))
    return cache[names]


def phase_index(phases: Sequence[PrecisionPhase], completed: int) -> int:
    """Index of the phase of the steps after `completed` ones (and of validation at `completed`).

    Example:
        >>> p = [PrecisionPhase(0, 3, {}, {}), PrecisionPhase(3, None, {}, {})]
        >>> [phase_index(p, k) for k in (0, 2, 3, 100)]
        [0, 0, 1, 1]
    """
    return max(i for i, phase in enumerate(phases) if phase.start <= completed)


def forward_weight_names(phases: Sequence[PrecisionPhase], total_steps: int) -> dict[str, str]:
    """Path -> the preset whose Fprop settings quantized the linear's weight in the forward that
    the final weights were trained with (what an export reproduces).

    Going back from the last phase that trains (start < `total_steps`), the first phase whose
    Fprop preset quantizes gives the name; a linear whose Fprop never quantizes gets its last
    Dgrad preset when that quantizes (the late BF16 forward from step 0: W is still quantized
    as Dgrad uses it), else "bf16".
    """
    trained = [phase for phase in phases if phase.start < total_steps] or list(phases[:1])
    names = {}
    for path, (_, last_dgrad, _) in trained[-1].names.items():
        fprops = (phase.names[path][0] for phase in reversed(trained))
        quantized = [n for n in fprops if not nvfp4_ops.get_recipe(n).fprop_unquantized]
        if quantized:
            names[path] = quantized[0]
        else:
            names[path] = last_dgrad if nvfp4_ops.get_recipe(last_dgrad).quantized else "bf16"
    return names


# ----------------------------------------------------------------------------- tables

_LINEAR_PATH = re.compile(r"layers\.(\d+)\.(.+)")


def table_rows(
    cells: dict[tuple[str, str], tuple[str, ...]], paths: Sequence[str]
) -> list[tuple[str, str, tuple[str, ...]]]:
    """(linears, GEMMs, values) rows of a (path, GEMM) -> values table, compressed: consecutive
    blocks with the same values share a row (`layers.1-4`), so do a block's linears (`.*`) and
    GEMMs (`dgrad,wgrad`; `*` = all three). (path, GEMM) pairs absent from `cells` are left out.

    Example:
        >>> paths = [f"layers.{i}.{n}" for i in range(3) for n in ("attn.qkv", "mlp.down")]
        >>> cells = {(p, g): ("nvfp4",) for p in paths for g in GEMMS}
        >>> cells["layers.2.mlp.down", "fprop"] = ("bf16",)
        >>> for row in table_rows(cells, paths): print(row)
        ('layers.0-1.*', '*', ('nvfp4',))
        ('layers.2.attn.qkv', '*', ('nvfp4',))
        ('layers.2.mlp.down', 'fprop', ('bf16',))
        ('layers.2.mlp.down', 'dgrad,wgrad', ('nvfp4',))
    """
    blocks: dict[str, list[str]] = {}
    for path in paths:
        block, linear = _LINEAR_PATH.fullmatch(path).groups()
        blocks.setdefault(block, []).append(linear)

    def grid(block: str) -> tuple:
        return tuple(
            (linear, tuple(cells.get((f"layers.{block}.{linear}", g)) for g in GEMMS))
            for linear in blocks[block]
        )

    groups: list[list[str]] = []
    for block in blocks:
        if groups and grid(groups[-1][0]) == grid(block):
            groups[-1].append(block)
        else:
            groups.append([block])
    rows = []
    for group in groups:
        name = group[0] if len(group) == 1 else f"{group[0]}-{group[-1]}"
        linears = dict(grid(group[0]))
        if len(set(linears.values())) == 1:
            linears = {"*": next(iter(linears.values()))}
        for linear, values in linears.items():
            rows += [(f"layers.{name}.{linear}", gemms, v) for gemms, v in _gemm_groups(values)]
    return rows


def _gemm_groups(values: tuple) -> list[tuple[str, tuple]]:
    """[(GEMM names joined by commas, or "*" for all three, values)] of the GEMMs with values."""
    by_value: dict[tuple, list[str]] = {}
    for gemm, value in zip(GEMMS, values, strict=True):
        if value is not None:
            by_value.setdefault(value, []).append(gemm)
    return [
        ("*" if len(gemms) == len(GEMMS) else ",".join(gemms), value)
        for value, gemms in by_value.items()
    ]


def format_schedule(phases: Sequence[PrecisionPhase], paths: Sequence[str]) -> str:
    """The resolved schedule as YAML comment lines: one column of presets per phase (headed by
    its window of completed steps), one row per linear and GEMM (compressed: `table_rows`).

    Example:
        >>> paths = ("layers.0.attn.qkv",)
        >>> rules = (Rule(paths, GEMMS, 0, None, "nvfp4", "precision.recipe"),
        ...          Rule(paths, ("fprop",), 3, None, "bf16", "precision.schedule[0]"))
        >>> print(format_schedule(resolve_phases(rules, paths, 10), paths), end="")
        # precision schedule: the preset of each linear and GEMM per phase of completed steps
        # (2 phases, 2 distinct: one compiled train step each)
        #   linears           gemms        [0, 3)  [3, end)
        #   layers.0.*        fprop        nvfp4   bf16
        #   layers.0.*        dgrad,wgrad  nvfp4   nvfp4
    """
    cells = {
        (p, g): tuple(phase.names[p][j] for phase in phases)
        for p in paths
        for j, g in enumerate(GEMMS)
    }
    header = ("linears", "gemms", *(phase.label for phase in phases))
    rows = [header] + [(name, gemms, *values) for name, gemms, values in table_rows(cells, paths)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    widths[0] = max(widths[0], 16)
    distinct = len({phase.key for phase in phases})
    lines = [
        "# precision schedule: the preset of each linear and GEMM per phase of completed steps",
        f"# ({len(phases)} phase{'s' * (len(phases) != 1)}, {distinct} distinct: one compiled "
        "train step each)",
    ]
    for row in rows:
        text = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        lines.append(f"#   {text.rstrip()}")
    return "\n".join(lines) + "\n"


def phase_changes(before: PrecisionPhase, after: PrecisionPhase, paths: Sequence[str]) -> str:
    """What `after` changes from `before`, e.g. `layers.1.* dgrad nvfp4 -> nvfp4-no-sr`."""
    cells = {
        (p, g): (before.names[p][j], after.names[p][j])
        for p in paths
        for j, g in enumerate(GEMMS)
        if before.names[p][j] != after.names[p][j]
    }
    rows = table_rows(cells, paths)
    return "; ".join(f"{name} {gemms} {old} -> {new}" for name, gemms, (old, new) in rows)
