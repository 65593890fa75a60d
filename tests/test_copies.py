"""Every faithful copy is its stock diffusers function plus marked changes only.

For each model module in the registry, each `SOURCES.copies()` entry (our copy of a
stock function) is compared with `inspect.getsource` of the installed stock function
(the one `SOURCES` pins by sha256). The rule, what diffusers' `# Copied from` +
`make fix-copies` enforce for their copies, made stricter:

- Reading each `# diffusers: <line>` comment in our copy as the stock line it
  records (the comment's indentation plus the text after "# diffusers: "), every
  line of the stock source appears in our copy, in order. So no stock line is
  changed or dropped without recording it above its replacement.
- Every line of our copy that is not stock code (a replacement, an addition) sits
  in a run that starts right after a `# diffusers:` record or with a
  `# bitfuse:` note. So no change goes unexplained.

Blank lines, docstrings and the function's own name are not compared. A model
file gets this check by declaring its copies in `SOURCES`.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import re
import textwrap
import warnings

import pytest

pytest.importorskip("diffusers")

from bitfuse import models  # noqa: E402

_MARKER = re.compile(r"^(\s*)# diffusers:(?: (.*))?$")
_NOTE = re.compile(r"^\s*# bitfuse:")


def _integrations():
    import importlib

    return {name: importlib.import_module(module) for name, module in models._REGISTRY.items()}


def _copies():
    for model, module in _integrations().items():
        stock = module.SOURCES.stock()
        for name, ours in module.SOURCES.copies().items():
            yield pytest.param(stock[name], ours, id=f"{module.__name__.rsplit('.', 1)[-1]}:{name}")


def _lines(fn) -> list[str]:
    """The source of `fn`, dedented, without its docstring, blank lines or trailing
    spaces; the `def` line's name replaced by `def <name>(` so that names compare equal."""
    source = textwrap.dedent(inspect.getsource(fn))
    tree = ast.parse(source)
    func = tree.body[0]
    drop: set[int] = set()
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(
        body[0].value.value, str
    ):
        drop.update(range(body[0].lineno, body[0].end_lineno + 1))
    out = []
    for number, line in enumerate(source.splitlines(), 1):
        if number in drop or not line.strip():
            continue
        if number == func.lineno:
            line = re.sub(r"\bdef \w+\(", "def <name>(", line)
        out.append(line.rstrip())
    return out


def _read_ours(lines: list[str]) -> list[tuple[str, str]]:
    """(line as compared with stock, kind): kind "record" for a `# diffusers:` line
    (read as the stock line it records), "note" for `# bitfuse:`, "code" otherwise."""
    out = []
    for line in lines:
        m = _MARKER.match(line)
        if m:
            if m.group(2):  # an empty record stands for a blank line: not compared
                out.append((m.group(1) + m.group(2), "record"))
        elif _NOTE.match(line):
            out.append(("\0note", "note"))
        else:
            out.append((line, "code"))
    return out


def _unexplained(stock: list[str], ours: list[tuple[str, str]]) -> list[str]:
    texts = [t for t, _ in ours]
    problems = []
    matcher = difflib.SequenceMatcher(None, stock, texts, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if i2 > i1:
            problems.append(
                "stock lines not in our copy, nor recorded by a '# diffusers:' comment:\n"
                + "\n".join(f"  - {line}" for line in stock[i1:i2])
                + ("\n  our lines there:\n" + "\n".join(f"  + {t}" for t in texts[j1:j2]) if j2 > j1 else "")
            )
            continue
        starts_explained = ours[j1][1] in ("note", "record") or (j1 > 0 and ours[j1 - 1][1] in ("note", "record"))
        if not starts_explained:
            problems.append(
                "lines of our copy neither below a '# diffusers:' record nor with a '# bitfuse:' note:\n"
                + "\n".join(f"  + {t}" for t in texts[j1:j2])
            )
    return problems


def unfaithful(stock, ours) -> list[str]:
    """What makes the function `ours` other than a faithful copy of `stock` (empty: nothing)."""
    return _unexplained(_lines(stock), _read_ours(_lines(ours)))


@pytest.mark.parametrize("stock,ours", list(_copies()))
def test_copy_is_stock_plus_marked_changes(stock, ours):
    problems = unfaithful(stock, ours)
    assert not problems, f"{ours.__qualname__} is not a faithful copy of {stock.__qualname__}:\n" + "\n".join(
        problems
    )


def test_every_model_declares_pinned_copies():
    """Each copy names a pinned stock function, so the sha check covers what it copies."""
    found = 0
    for module in _integrations().values():
        copies = module.SOURCES.copies()
        assert copies, f"{module.__name__} declares no copies"
        assert set(copies) <= set(module.SOURCES.sha256) == set(module.SOURCES.stock())
        found += len(copies)
    assert found >= 6  # LTX-2: block, model, video coords, attention, two processors


@pytest.mark.parametrize("name", sorted(models._REGISTRY))
def test_installed_diffusers_is_the_verified_one(name):
    """Fails when the installed diffusers' code behind an integration changes (its sha256
    pins): re-verify and re-copy then."""
    module = _integrations()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert module.SOURCES.check() == []


# ---------------------------------------------------------------- the rule itself


def _check(stock_src: str, ours_src: str) -> list[str]:
    stock = [line.rstrip() for line in textwrap.dedent(stock_src).splitlines() if line.strip()]
    ours = [line.rstrip() for line in textwrap.dedent(ours_src).splitlines() if line.strip()]
    return _unexplained(stock, _read_ours(ours))


STOCK = """
    x = norm(h)
    x = x * (1 + scale) + shift
    if flag:
        y = f(x)
    return y
"""


def test_rule_accepts_recorded_replacements_and_noted_additions():
    ours = """
    # diffusers: x = norm(h)
    # diffusers: x = x * (1 + scale) + shift
    x = site(norm, h, scale, shift)
    if flag:
        # bitfuse: the same value, computed once
        cached = 1
        y = f(x)
    return y
"""
    assert _check(STOCK, ours) == []


@pytest.mark.parametrize(
    "ours,why",
    [
        ("""
    x = site(norm, h, scale, shift)
    if flag:
        y = f(x)
    return y
""", "stock lines not in our copy"),  # a replacement without its record
        ("""
    # diffusers: x = norm(h)
    # diffusers: x = x * (1 + scale) + shift
    x = site(norm, h, scale, shift)
    if flag:
        y = g(x)
    return y
""", "stock lines not in our copy"),  # an unmarked change elsewhere
        ("""
    # diffusers: x = norm(h)
    # diffusers: x = x * (1 + shift) + scale
    x = site(norm, h, scale, shift)
    if flag:
        y = f(x)
    return y
""", "stock lines not in our copy"),  # a record that is not the stock line
        ("""
    x = norm(h)
    x = x * (1 + scale) + shift
    if flag:
        y = f(x)
    log(y)
    return y
""", "neither below"),  # an unexplained addition
        ("""
    x = norm(h)
    x = x * (1 + scale) + shift
    y = f(x)
    return y
""", "stock lines not in our copy"),  # a dropped line (the branch)
        ("""
    x = norm(h)
    x = x * (1 + scale) + shift
    if flag:
    y = f(x)
    return y
""", "stock lines not in our copy"),  # an indentation change
    ],
    ids=["unrecorded-replacement", "unmarked-change", "wrong-record", "unexplained-addition", "dropped-line",
         "indentation"],
)
def test_rule_rejects_unmarked_changes(ours, why):
    problems = _check(STOCK, ours)
    assert problems and why in problems[0]
