"""What `nvfp4_ops.te_backend` uses of TransformerEngine, and whether a TE release has it.

TE's JAX package cannot be imported without CUDA, so a release is checked by parsing its sources.

`uses(source)` reads te_backend.py's syntax tree. A TransformerEngine module enters it as
`importlib.import_module("transformer_engine...")`, directly or as the sole return of a helper
function; names bound to a module, or to an attribute chain on one, are followed through plain
assignments (tuple assignments included). Every attribute chain read from such a name is a use,
and so is every keyword argument of a call of one (`**` expansions excepted: those are checked
at run time). What te_backend does with the objects TE returns cannot be seen this way; those
uses are listed by hand in `RESULT_USES`, and the CPU run of te_backend (test_te_backend_cpu.py)
would fail if that list left one out.

`missing(root, uses)` resolves each use in the sources of the release unpacked at `root`:
module attributes through definitions, `from x import name` and `from x import *` (honouring
`__all__`); class attributes through the class body and its bases (dataclass fields, enum
members, methods); keyword arguments against the parameters of the function (or of `__init__`,
or the dataclass fields of a class). A keyword that lands in a `**kwargs` counts only if the
function body names it as a string (TE reads such options with `"name" in kwargs`), or if the
keywords are forwarded to a known consumer (`FORWARDED_KEYWORDS`).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = "transformer_engine"


@dataclasses.dataclass(frozen=True)
class Use:
    """One thing te_backend needs: `module`'s attribute chain `path`, called with `keywords`."""

    module: str
    path: tuple[str, ...]
    keywords: frozenset[str] = frozenset()

    def __str__(self) -> str:
        name = ".".join((self.module, *self.path))
        return f"{name}({', '.join(sorted(self.keywords))})" if self.keywords else name


RESULT_USES = (
    # QuantizerFactory.create_set(...) returns a QuantizerSet; te_backend reads its quantizers.
    Use("transformer_engine.jax.quantize", ("QuantizerSet", "x")),
    Use("transformer_engine.jax.quantize", ("QuantizerSet", "kernel")),
    Use("transformer_engine.jax.quantize", ("QuantizerSet", "dgrad")),
    # quantize() returns a ScaledTensor2x; get_tensor(usage=...) a ScaledTensor1x, whose GEMM
    # output dtype te_backend sets with dataclasses.replace(..., dq_dtype=...).
    Use("transformer_engine.jax.quantize", ("ScaledTensor2x", "get_tensor"), frozenset({"usage"})),
    Use("transformer_engine.jax.quantize", ("ScaledTensor1x", "get_tensor"), frozenset({"usage"})),
    Use("transformer_engine.jax.quantize", ("ScaledTensor1x", "dq_dtype")),
)

FORWARDED_KEYWORDS = {
    # QuantizeMeta(**kwargs) holds quantizer options: create_set passes them to the quantizer.
    ("transformer_engine.jax.quantize", ("QuantizeMeta",)): (
        "transformer_engine.jax.quantize.quantizer",
        ("NVFP4Quantizer",),
    ),
}


def _module_literal(node: ast.AST) -> str | None:
    """ "m" for `importlib.import_module("m")` with m in TransformerEngine, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Constant)
        and str(node.args[0].value).startswith(PACKAGE)
    ):
        return node.args[0].value
    return None


class _Collector(ast.NodeVisitor):
    def __init__(self, helpers: dict[str, str]) -> None:
        self.helpers = helpers  # helper function name -> module it returns
        self.bound: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.found: dict[tuple[str, tuple[str, ...]], set[str]] = {}

    def reference(self, node: ast.AST) -> tuple[str, tuple[str, ...]] | None:
        """(module, attribute chain) that `node` denotes, or None."""
        module = _module_literal(node)
        if module is not None:
            return module, ()
        helper = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
        if helper and node.func.id in self.helpers:
            return self.helpers[node.func.id], ()
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.reference(node.value)
            if base is not None:
                return base[0], (*base[1], node.attr)
        return None

    def record(self, ref: tuple[str, tuple[str, ...]], keywords=()) -> None:
        if ref[1]:
            self.found.setdefault(ref, set()).update(keywords)

    def visit_Assign(self, node: ast.Assign) -> None:
        targets, values = node.targets[0], node.value
        pairs = [(targets, values)]
        if isinstance(targets, ast.Tuple) and isinstance(values, ast.Tuple):
            pairs = list(zip(targets.elts, values.elts, strict=True))
        for target, value in pairs:
            ref = self.reference(value)
            if isinstance(target, ast.Name) and ref is not None:
                self.bound[target.id] = ref
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        ref = self.reference(node)
        if ref is not None:
            self.record(ref)
        else:
            self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        ref = self.reference(node.func)
        if ref is not None:
            self.record(ref, {k.arg for k in node.keywords if k.arg is not None})
            for arg in (*node.args, *(k.value for k in node.keywords)):
                self.visit(arg)
        else:
            self.generic_visit(node)


def uses(source: str) -> list[Use]:
    """Every use of TransformerEngine in te_backend's `source` (see the module docstring)."""
    tree = ast.parse(source)
    helpers = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            body = [n for n in node.body if not isinstance(n, ast.Expr)]  # skip the docstring
            if len(body) == 1 and isinstance(body[0], ast.Return):
                module = _module_literal(body[0].value)
                if module is not None:
                    helpers[node.name] = module
    collector = _Collector(helpers)
    collector.visit(tree)
    return [Use(m, p, frozenset(k)) for (m, p), k in sorted(collector.found.items())]


# ----------------------------------------------------------------------------- the release side


@dataclasses.dataclass(frozen=True)
class _Definition:
    node: ast.AST  # ClassDef, FunctionDef, or an assignment (a value)
    module: str  # where it is defined


class Release:
    """The parsed sources of one unpacked TransformerEngine release."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._parsed: dict[str, ast.Module | None] = {}

    def module(self, name: str) -> ast.Module | None:
        """The parsed source of module `name`, or None if the release has no such module."""
        if name not in self._parsed:
            path = self.root.joinpath(*name.split("."))
            files = [p for p in (path / "__init__.py", path.with_suffix(".py")) if p.is_file()]
            self._parsed[name] = ast.parse(files[0].read_text()) if files else None
        return self._parsed[name]

    def _is_package(self, name: str) -> bool:
        return (self.root.joinpath(*name.split(".")) / "__init__.py").is_file()

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if self._is_package(module) else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join([*base, *([node.module] if node.module else [])])

    def lookup(self, module: str, name: str, depth: int = 0) -> _Definition | None:
        """The definition of `name` as an attribute of `module`, following imports."""
        tree = self.module(module)
        if tree is None or depth > 20:
            return None
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                return _Definition(node, module)
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return _Definition(node, module)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                source = self._absolute(module, node)
                for alias in node.names:
                    if alias.name == "*" and self._exports(source, name):
                        found = self.lookup(source, name, depth + 1)
                        if found is not None:
                            return found
                    elif (alias.asname or alias.name) == name:
                        found = self.lookup(source, alias.name, depth + 1)
                        if found is None and self.module(f"{source}.{alias.name}") is not None:
                            return _Definition(ast.Module(body=[], type_ignores=[]), source)
                        return found
        if self.module(f"{module}.{name}") is not None:  # a submodule
            return _Definition(self.module(f"{module}.{name}"), f"{module}.{name}")
        return None

    def _exports(self, module: str, name: str) -> bool:
        """Whether `from module import *` brings `name` (its __all__, or any public name)."""
        tree = self.module(module)
        if tree is None:
            return False
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                try:
                    return name in ast.literal_eval(node.value)
                except ValueError:
                    return True
        return not name.startswith("_")

    def member(self, definition: _Definition, name: str, depth: int = 0) -> _Definition | None:
        """`name` in a class body (method, field, enum member) or its bases; a submodule's name."""
        node = definition.node
        if isinstance(node, ast.Module):
            return self.lookup(definition.module, name)
        if not isinstance(node, ast.ClassDef) or depth > 10:
            return None
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.ClassDef) and item.name == name:
                return _Definition(item, definition.module)
            targets = item.targets if isinstance(item, ast.Assign) else []
            if isinstance(item, ast.AnnAssign):
                targets = [item.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return _Definition(item, definition.module)
        for base in node.bases:
            if isinstance(base, ast.Name):
                parent = self.lookup(definition.module, base.id)
                if parent is not None:
                    found = self.member(parent, name, depth + 1)
                    if found is not None:
                        return found
        return None

    def fields(self, definition: _Definition, depth: int = 0) -> set[str]:
        """Annotated class-body names of a class and its bases (dataclass fields)."""
        node = definition.node
        if not isinstance(node, ast.ClassDef) or depth > 10:
            return set()
        names = {i.target.id for i in node.body if isinstance(i, ast.AnnAssign)}
        for base in node.bases:
            if isinstance(base, ast.Name):
                parent = self.lookup(definition.module, base.id)
                if parent is not None:
                    names |= self.fields(parent, depth + 1)
        return names

    def accepts(self, definition: _Definition, keyword: str) -> bool:
        """Whether calling the definition with `keyword=` reaches something that reads it."""
        node = definition.node
        if isinstance(node, ast.ClassDef):
            init = self.member(definition, "__init__")
            if init is not None and isinstance(init.node, ast.FunctionDef):
                return self.accepts(init, keyword) or keyword in self.fields(definition)
            return keyword in self.fields(definition)
        if not isinstance(node, ast.FunctionDef):
            return False
        args = node.args
        names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
        if keyword in names:
            return True
        if args.kwarg is None:
            return False
        return any(
            isinstance(n, ast.Constant) and n.value == keyword for n in ast.walk(node)
        )  # read as kwargs["name"] / "name" in kwargs


def resolve(release: Release, module: str, path: tuple[str, ...]) -> _Definition | None:
    """The definition of `module.path[0].path[1]...` in the release, or None."""
    if release.module(module) is None:
        return None
    definition = _Definition(release.module(module), module)
    for name in path:
        definition = release.member(definition, name)
        if definition is None:
            return None
    return definition


def missing(root: Path, needed: list[Use]) -> list[str]:
    """Each use the release at `root` lacks, as a sentence; [] when it has them all."""
    release = Release(root)
    problems = []
    for use in needed:
        definition = resolve(release, use.module, use.path)
        if definition is None:
            problems.append(f"{use.module}.{'.'.join(use.path)} does not exist")
            continue
        consumer = FORWARDED_KEYWORDS.get((use.module, use.path))
        for keyword in sorted(use.keywords):
            target = definition
            if consumer is not None:
                target = resolve(release, *consumer) or definition
            if not release.accepts(target, keyword):
                problems.append(f"{use} does not take the keyword {keyword!r}")
    return problems
