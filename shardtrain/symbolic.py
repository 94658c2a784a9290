"""Shape expressions and guards as torch.export writes them, read with a small grammar instead of trusted.

A serialized program names symbolic sizes as sympy expressions (`Mul(Integer(4), Pow(Symbol('s27', ...),
Integer(2)))`), which the deserializer hands to sympy, and its guards as Python source (`(L['x'].size()[0] %
L['y'].size()[0]) == 0`). Both are parsed here with `ast` and accepted only when every node is one of a few
arithmetic forms over integers and sizes, with bounded numbers and exponents, so sympy cannot be made to
reach an attribute or compute for minutes. Guards are then evaluated by this module, never exec'd.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Sequence

from shardtrain.errors import InvalidArgument

# sympy functions export's shape expressions use (srepr form), with the ones torch defines for integer sizes.
_SYMPY_FUNCTIONS = frozenset("""
    Symbol Integer Rational Add Mul Pow Max Min Abs FloorDiv Mod PythonMod CeilToInt FloorToInt TruncToInt
    CleanDiv IntTrueDiv ModularIndexing Eq Ne Lt Le Gt Ge GreaterThan LessThan StrictGreaterThan StrictLessThan
    Equality Unequality And Or Not
""".split())
_ASSUMPTIONS = frozenset({"positive", "integer", "nonnegative", "real", "finite", "negative", "nonpositive"})
_SYMBOL_NAME = re.compile(r"[a-z]{1,2}\d{1,6}")
MAX_INTEGER = 1 << 63
MAX_EXPONENT = 16  # strides of dynamic dims are powers of sizes: small exponents of sizes, never towers

_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_FUNCTIONS = {"Max": max, "Min": min, "max": max, "min": min}
_TENSOR_SIZES = {"size", "stride"}  # L['x'].size()[i], L['x'].stride()[i]
_TENSOR_NUMBERS = {"dim", "numel", "storage_offset"}  # L['x'].dim()


def _parse(text: str, what: str) -> ast.expr:
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise InvalidArgument(f"captured program: {what} {text[:80]!r} is not an expression") from None


def check_expression(text: str) -> None:
    """InvalidArgument unless `text` is a sympy srepr of integer arithmetic on size symbols."""
    _SympyReader(text).visit(_parse(text, "shape expression"))


class _SympyReader:
    """Walks a sympy srepr: calls of known functions whose arguments are calls, bounded integers or bools."""

    def __init__(self, text: str):
        self.text = text

    def refuse(self, why: str) -> None:
        raise InvalidArgument(f"shape expression {self.text[:80]!r} is not integer arithmetic on sizes: {why}")

    def visit(self, node: ast.expr, under_power: bool = False) -> None:
        if isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            if abs(node.value) >= MAX_INTEGER:
                self.refuse("has an integer beyond 64 bits")
            return
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            self.visit(node.operand, under_power)
            return
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:  # sympy's str() form: 2*s77 + 1
            if isinstance(node.op, ast.Pow) and (under_power or not _small_integer(node.right)):
                self.refuse(f"raises to a power other than a literal of at most {MAX_EXPONENT}, or nests powers")
            self.visit(node.left, under_power or isinstance(node.op, ast.Pow))
            self.visit(node.right, under_power)
            return
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _SYMPY_FUNCTIONS):
            self.refuse(f"uses {ast.unparse(node)[:40]!r}; only {sorted(_SYMPY_FUNCTIONS)} of integers may appear")
        name = node.func.id
        if name == "Symbol":
            self._symbol(node)
            return
        if node.keywords:
            self.refuse(f"passes keywords to {name}")
        if name == "Pow":
            if under_power or len(node.args) != 2 or not _small_integer(node.args[1]):
                self.refuse(f"raises to a power other than a literal of at most {MAX_EXPONENT}, or nests powers")
        for argument in node.args:
            self.visit(argument, under_power or name == "Pow")

    def _symbol(self, node: ast.Call) -> None:
        name = node.args[0] if len(node.args) == 1 else None
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str) and _SYMBOL_NAME.fullmatch(name.value)):
            self.refuse("names a symbol other than a size symbol like 's12'")
        for keyword in node.keywords:
            if keyword.arg not in _ASSUMPTIONS or not (isinstance(keyword.value, ast.Constant)
                                                      and type(keyword.value.value) is bool):
                self.refuse(f"gives a symbol the assumption {keyword.arg!r}")


def _small_integer(node: ast.expr) -> bool:
    """Integer(k) or a literal k with |k| <= MAX_EXPONENT."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Integer" \
            and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) <= MAX_EXPONENT


class Guard:
    """One of a program's guards: a relation between its inputs' sizes that every call must satisfy."""

    def __init__(self, text: str):
        self.text = text
        self._tree = _parse(text, "guard")
        relation = isinstance(self._tree, (ast.Compare, ast.BoolOp)) or (
            isinstance(self._tree, ast.UnaryOp) and isinstance(self._tree.op, ast.Not))
        if not relation:
            self._refuse("is not a comparison")
        self._check(self._tree)

    def holds(self, inputs: dict[str, object]) -> bool:
        """Evaluates the guard on the inputs by name (L['x'] is inputs['x']; a sequence input is indexed)."""
        return bool(self._evaluate(self._tree, inputs))

    def _refuse(self, why: str) -> None:
        raise InvalidArgument(f"captured program: guard {self.text[:80]!r} is not a plain shape relation: {why}")

    def _check(self, node: ast.expr) -> None:
        if isinstance(node, ast.Compare):
            if not all(type(op) in _COMPARE for op in node.ops):
                self._refuse("compares with an operator other than ==, !=, <, <=, >, >=")
            for part in (node.left, *node.comparators):
                self._check(part)
        elif isinstance(node, ast.BoolOp):
            for part in node.values:
                self._check(part)
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            self._check(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            if isinstance(node.op, ast.Pow) and not _small_integer(node.right):
                self._refuse(f"raises to a power other than a literal of at most {MAX_EXPONENT}")
            self._check(node.left)
            self._check(node.right)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            if abs(node.value) >= MAX_INTEGER:
                self._refuse("has an integer beyond 64 bits")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            if node.keywords or not node.args:
                self._refuse(f"calls {node.func.id} with keywords or nothing")
            for part in node.args:
                self._check(part)
        elif self._size_read(node) is None:
            self._refuse(f"uses {ast.unparse(node)[:40]!r}; only sizes, strides and integer arithmetic may appear")

    def _size_read(self, node: ast.expr) -> tuple | None:
        """(source path, method, index or None) for L['x'].size()[i], L['x'][j].stride()[i], L['x'].dim()."""
        index = None
        if isinstance(node, ast.Subscript):
            index, node = _literal_index(node.slice), node.value
            if index is None:
                return None
        if not (isinstance(node, ast.Call) and not node.args and not node.keywords
                and isinstance(node.func, ast.Attribute)):
            return None
        method = node.func.attr
        if (index is None) != (method in _TENSOR_NUMBERS) or method not in _TENSOR_SIZES | _TENSOR_NUMBERS:
            return None
        path = _source_path(node.func.value)
        return None if path is None else (path, method, index)

    def _evaluate(self, node: ast.expr, inputs: dict[str, object]):
        if isinstance(node, ast.Compare):
            left = self._evaluate(node.left, inputs)
            for op, right_node in zip(node.ops, node.comparators):
                right = self._evaluate(right_node, inputs)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.BoolOp):
            values = (self._evaluate(part, inputs) for part in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.UnaryOp):
            return _UNARY[type(node.op)](self._evaluate(node.operand, inputs))
        if isinstance(node, ast.BinOp):
            return _ARITHMETIC[type(node.op)](self._evaluate(node.left, inputs), self._evaluate(node.right, inputs))
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return _FUNCTIONS[node.func.id](*(self._evaluate(part, inputs) for part in node.args))
        (name, *indexes), method, index = self._size_read(node)
        value = inputs[name]
        for position in indexes:
            value = value[position]
        result = getattr(value, method)()
        return result if index is None else result[index]


def _literal_index(node: ast.expr) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value < 64 else None


def _source_path(node: ast.expr) -> list | None:
    """['x'] for L['x'], ['dependencies', 0] for L['dependencies'][0]; None for anything else."""
    path: list = []
    while isinstance(node, ast.Subscript) and isinstance(node.value, ast.Subscript):
        index = _literal_index(node.slice)
        if index is None:
            return None
        path.insert(0, index)
        node = node.value
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "L"
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
            and node.slice.value.isidentifier()):
        return None
    return [node.slice.value, *path]


def check_layer_inputs(guards: Sequence[Guard]) -> Callable[[tuple], None]:
    """A check of a captured layer's positional inputs (x, *dependencies, as LayerAdapter takes them) against its
    guards, raising InvalidArgument naming the first guard that fails."""
    def check(arguments: tuple) -> None:
        bound = {"x": arguments[0], "dependencies": arguments[1:]}
        for guard in guards:
            if not guard.holds(bound):
                raise InvalidArgument(f"the layer's inputs break its guard {guard.text!r} (shapes "
                                      f"{[list(getattr(a, 'shape', ())) for a in arguments]})")
    return check
