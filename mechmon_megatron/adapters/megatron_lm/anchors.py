"""Locate mechmon's three edits of ``pretrain_gpt.py`` by content (AST), for any release.

The three insertion points, found on the parsed module rather than by line numbers or diff
context, so that a release with the same structure needs no new patch file:

1. **the import block**: the last top-level import statement (or ``try`` / ``if`` / ``with``
   block holding one, e.g. ``try: from megatron.post_training ... except ImportError``) before
   the first top-level ``def`` / ``class``. The two lines ``IMPORT_LINE`` and a blank line go
   before the next non-blank line after it.
2. **the parsing call** inside the ``if __name__ == "__main__":`` block: the one call passing
   ``extra_args_provider=`` (``pretrain(...)`` in core_v0.16 / 0.17,
   ``parse_and_validate_args(...)`` from core_v0.18 on); if no call passes it, the one
   ``parse_and_validate_args(...)`` call, else the one ``pretrain(...)`` call.
   ``mechmon.install()`` goes on its own line before the statement holding that call.
3. **its ``extra_args_provider`` argument**: a present value ``V`` becomes
   ``mechmon.extra_args_provider(V)``; an absent one is added as
   ``extra_args_provider=mechmon.extra_args_provider()``.

Every changed line ends with ``MARKER``; :func:`plan_revert` undoes exactly these edits from the
patched text alone. "Doubt" refuses with :class:`AnchorError` (naming the file and what was
expected): no or several ``__main__`` blocks, no or several candidate calls, a call that may pass
the provider positionally or through ``**kwargs``, the name ``mechmon`` already taken, a line
continued with ``\\``, formatting the edit cannot reproduce exactly, or a result that does not
parse or does not revert to the byte-identical original (both are checked before anything is
written).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Optional

MARKER = "  # [mechmon]"
IMPORT_LINE = "from mechmon_megatron import megatron_lm as mechmon" + MARKER
INSTALL_CALL = "mechmon.install()"
WRAP_PREFIX = "mechmon.extra_args_provider("
ADDED_VALUE = "mechmon.extra_args_provider()"
PROVIDER = "extra_args_provider"
# Functions that take the provider, and the 0-based position of their extra_args_provider parameter.
PROVIDER_SLOT = {"parse_and_validate_args": 0, "parse_args": 0, "initialize_megatron": 0, "pretrain": 5}
_INSTALL_RE = re.compile(r"^(\s*)" + re.escape(INSTALL_CALL + MARKER) + "$")


class AnchorError(Exception):
    """The edits cannot be located without doubt; nothing was changed."""


@dataclass
class Edit:
    start: int  # 0-based line index
    end: int  # exclusive; start == end: insertion before ``start``
    new: list[str]


def _apply(lines: list[str], edits: list[Edit]) -> list[str]:
    out = list(lines)
    for edit in sorted(edits, key=lambda e: (e.start, e.end), reverse=True):
        out[edit.start : edit.end] = edit.new
    return out


def _char_col(line: str, byte_col: int) -> int:
    """ast columns are UTF-8 byte offsets; the line is text."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="replace"))


def _parse(text: str, path: str) -> ast.Module:
    try:
        return ast.parse(text)
    except SyntaxError as exc:
        raise AnchorError(f"{path} does not parse as Python ({exc.msg}, line {exc.lineno})") from None


def _call_name(call: ast.Call) -> Optional[str]:
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _has_import(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return False
    children = [c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)]
    if isinstance(node, ast.Try):
        children += [s for h in node.handlers for s in h.body]
    return any(_has_import(c) for c in children)


def _main_block(tree: ast.Module, path: str) -> ast.If:
    blocks = [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and len(node.test.comparators) == 1
        and isinstance(node.test.comparators[0], ast.Constant)
        and node.test.comparators[0].value == "__main__"
    ]
    if len(blocks) != 1:
        raise AnchorError(f'{path}: expected one top-level `if __name__ == "__main__":` block, found {len(blocks)}')
    return blocks[0]


def _import_index(tree: ast.Module, lines: list[str], main: ast.If, path: str) -> int:
    """0-based line index before which ``IMPORT_LINE`` and a blank line are inserted."""
    last = None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node is main:
            break
        if _has_import(node):
            last = node
    if last is None:
        raise AnchorError(f"{path}: no top-level import block before the first function (expected `import ...` lines)")
    index = last.end_lineno or last.lineno
    while index < len(lines) and not lines[index].strip():
        index += 1
    if index > main.lineno - 1:
        raise AnchorError(f"{path}: the import block does not end before the __main__ block")
    return index


def _statement_of(main: ast.If, call: ast.Call) -> ast.stmt:
    """The innermost statement of the __main__ block holding ``call``."""
    best: Optional[ast.stmt] = None

    def visit(node: ast.AST) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) and any(n is call for n in ast.walk(child)):
                best = child
                visit(child)

    visit(main)
    assert best is not None
    return best


def _target_call(main: ast.If, path: str) -> tuple[ast.Call, Optional[ast.keyword]]:
    calls = [n for n in ast.walk(main) if isinstance(n, ast.Call)]
    with_kw = [(c, k) for c in calls for k in c.keywords if k.arg == PROVIDER]
    if len(with_kw) > 1:
        where = ", ".join(str(c.lineno) for c, _ in with_kw)
        raise AnchorError(f"{path}: {PROVIDER}= is passed by {len(with_kw)} calls (lines {where}); expected one")
    if with_kw:
        call, keyword = with_kw[0]
    else:
        keyword = None
        for name in ("parse_and_validate_args", "pretrain"):
            named = [c for c in calls if _call_name(c) == name]
            if len(named) > 1:
                where = ", ".join(str(c.lineno) for c in named)
                raise AnchorError(f"{path}: {len(named)} calls of {name}( in the __main__ block (lines {where}); "
                                  "expected one")
            if named:
                call = named[0]
                break
        else:
            raise AnchorError(f"{path}: no pretrain( or parse_and_validate_args( call in the __main__ block")
    name = _call_name(call) or "?"
    if keyword is None:
        if any(k.arg is None for k in call.keywords):
            raise AnchorError(f"{path}: the {name}( call on line {call.lineno} passes **kwargs and no "
                              f"{PROVIDER}=: the provider may be inside them")
        slot = PROVIDER_SLOT.get(name)
        if any(isinstance(a, ast.Starred) for a in call.args) or (slot is not None and len(call.args) > slot):
            raise AnchorError(f"{path}: the {name}( call on line {call.lineno} may pass {PROVIDER} positionally")
    return call, keyword


def _ends_with_continuation(line: str) -> bool:
    return line.rstrip().endswith("\\")


def plan_apply(text: str, path: str = "pretrain_gpt.py") -> list[str]:
    """The patched lines of an unpatched ``text`` (``text`` split on '\\n', no final empty item)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    tree = _parse(text, path)
    if any(isinstance(n, ast.Name) and n.id == "mechmon" for n in ast.walk(tree)) or any(
        isinstance(n, ast.alias) and (n.asname or n.name) == "mechmon" for n in ast.walk(tree)
    ):
        raise AnchorError(f"{path}: the name `mechmon` is already used; it would clash with the mechmon import")
    main = _main_block(tree, path)
    at = _import_index(tree, lines, main, path)
    edits = [Edit(at, at, [IMPORT_LINE, ""])]

    call, keyword = _target_call(main, path)
    statement = _statement_of(main, call)
    first = lines[statement.lineno - 1]
    col = _char_col(first, statement.col_offset)
    if first[:col].strip():
        raise AnchorError(
            f"{path}: line {statement.lineno} holds another statement before the {_call_name(call)}( call"
        )
    edits.append(Edit(statement.lineno - 1, statement.lineno - 1, [first[:col] + INSTALL_CALL + MARKER]))

    if keyword is not None:  # wrap the present value
        value = keyword.value
        s_line, e_line = value.lineno - 1, (value.end_lineno or value.lineno) - 1
        block = lines[s_line : e_line + 1]
        if _ends_with_continuation(block[-1]):
            raise AnchorError(f"{path}: line {e_line + 1} ends with '\\'; cannot mark it")
        s_col = _char_col(lines[s_line], value.col_offset)
        e_col = _char_col(lines[e_line], value.end_col_offset or 0)
        block[-1] = block[-1][:e_col] + ")" + block[-1][e_col:] + MARKER
        block[0] = block[0][:s_col] + WRAP_PREFIX + block[0][s_col:]
        edits.append(Edit(s_line, e_line + 1, block))
    else:  # add the keyword
        edits.append(_add_keyword(lines, call, path))

    patched = _apply(lines, edits)
    _verify(text, patched, path)
    return patched


def _add_keyword(lines: list[str], call: ast.Call, path: str) -> Edit:
    name = _call_name(call)
    end_line = (call.end_lineno or call.lineno) - 1
    args = list(call.args) + list(call.keywords)
    last = max(args, key=lambda a: (a.end_lineno or 0, a.end_col_offset or 0)) if args else None
    if call.lineno - 1 == end_line:  # one line: f(a, b) -> f(a, b, extra_args_provider=...)
        line = lines[end_line]
        if _ends_with_continuation(line):
            raise AnchorError(f"{path}: line {end_line + 1} ends with '\\'; cannot mark it")
        if last is None:
            at = _char_col(line, call.func.end_col_offset or 0) + 1
            if line[at - 1 : at] != "(":
                raise AnchorError(f"{path}: cannot find the '(' of {name}( on line {end_line + 1}")
            new = line[:at] + f"{PROVIDER}={ADDED_VALUE}" + line[at:] + MARKER
        else:
            at = _char_col(line, last.end_col_offset or 0)
            new = line[:at] + f", {PROVIDER}={ADDED_VALUE}" + line[at:] + MARKER
        return Edit(end_line, end_line + 1, [new])
    # several lines, one argument per line with a trailing comma, ')' on its own line
    closing = lines[end_line]
    if last is None or closing[: _char_col(closing, call.end_col_offset or 0) - 1].strip():
        raise AnchorError(f"{path}: cannot add {PROVIDER}= to the {name}( call on line {call.lineno}: expected its "
                          "arguments one per line and ')' on a line of its own (add it by hand)")
    last_end = (last.end_lineno or last.lineno) - 1
    tail = lines[last_end][_char_col(lines[last_end], last.end_col_offset or 0) :]
    first = lines[last.lineno - 1]
    col = _char_col(first, last.col_offset)  # a keyword's position is that of its name
    if not tail.strip().startswith(",") or tail.strip()[1:].strip()[:1] not in ("", "#") or first[:col].strip():
        raise AnchorError(f"{path}: cannot add {PROVIDER}= to the {name}( call on line {call.lineno}: expected the "
                          "last argument on its own line, followed by a comma (add it by hand)")
    return Edit(last_end + 1, last_end + 1, [first[:col] + f"{PROVIDER}={ADDED_VALUE}," + MARKER])


def _verify(original: str, patched: list[str], path: str) -> None:
    text = "\n".join(patched) + "\n"
    _parse(text, path)
    reverted = "\n".join(plan_revert(text, path, verify=False)) + ("\n" if original.endswith("\n") else "")
    if reverted != original:
        raise AnchorError(f"{path}: the located edit would not revert to the byte-identical file; refusing")


def plan_revert(text: str, path: str = "pretrain_gpt.py", verify: bool = True) -> list[str]:
    """The original lines of a ``text`` patched by :func:`plan_apply` (exactly its three edits)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    marked = [i for i, line in enumerate(lines) if line.endswith(MARKER)]
    imports = [i for i in marked if lines[i] == IMPORT_LINE]
    installs = [i for i in marked if _INSTALL_RE.match(lines[i])]
    if len(imports) != 1 or len(installs) != 1 or len(marked) != 3:
        raise AnchorError(f"{path}: expected exactly three '{MARKER.strip()}' lines (import, install, provider), "
                          f"found {len(marked)} ({len(imports)} import, {len(installs)} install)")
    i = imports[0]
    if i + 1 >= len(lines) or lines[i + 1] != "":
        raise AnchorError(f"{path}: the mechmon import on line {i + 1} is not followed by the blank line it added")
    edits = [Edit(i, i + 2, []), Edit(installs[0], installs[0] + 1, [])]
    provider_line = next(m for m in marked if m not in (i, installs[0]))

    tree = _parse(text, path)
    found = [
        k
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        for k in n.keywords
        if k.arg == PROVIDER
        and isinstance(k.value, ast.Call)
        and isinstance(k.value.func, ast.Attribute)
        and isinstance(k.value.func.value, ast.Name)
        and k.value.func.value.id == "mechmon"
        and k.value.func.attr == PROVIDER
    ]
    if len(found) != 1 or (found[0].value.end_lineno or 0) - 1 != provider_line:
        raise AnchorError(f"{path}: expected one {PROVIDER}=mechmon.extra_args_provider(...) ending on the marked "
                          f"line {provider_line + 1}")
    value = found[0].value
    assert isinstance(value, ast.Call)
    s_line, e_line = value.lineno - 1, provider_line
    block = lines[s_line : e_line + 1]
    block[-1] = block[-1][: -len(MARKER)]
    s_col = _char_col(lines[s_line], value.col_offset)
    e_col = _char_col(lines[e_line], value.end_col_offset or 0)
    if value.args:  # wrapped: mechmon.extra_args_provider(V) -> V
        if len(value.args) != 1 or value.keywords or block[0][s_col : s_col + len(WRAP_PREFIX)] != WRAP_PREFIX \
                or block[-1][e_col - 1 : e_col] != ")":
            raise AnchorError(
                f"{path}: line {s_line + 1}: the provider is not mechmon.extra_args_provider(<one value>)"
            )
        block[-1] = block[-1][: e_col - 1] + block[-1][e_col:]
        block[0] = block[0][:s_col] + block[0][s_col + len(WRAP_PREFIX) :]
        edits.append(Edit(s_line, e_line + 1, block))
    else:  # added: remove the keyword
        keyword = found[0]
        line = block[-1]
        k_col = _char_col(line, keyword.col_offset)
        own_line = line[:k_col].strip() == "" and line[e_col:] == ","
        if own_line and s_line == e_line:
            edits.append(Edit(s_line, s_line + 1, []))
        elif s_line == e_line and line[k_col - 2 : k_col] == ", ":
            edits.append(Edit(s_line, s_line + 1, [line[: k_col - 2] + line[e_col:]]))
        elif s_line == e_line and line[k_col - 1 : k_col] == "(":
            edits.append(Edit(s_line, s_line + 1, [line[:k_col] + line[e_col:]]))
        else:
            raise AnchorError(
                f"{path}: line {s_line + 1}: the added {PROVIDER}= is not in the form mechmon-patch writes"
            )
    original = _apply(lines, edits)
    if verify:
        restored = "\n".join(original) + ("\n" if text.endswith("\n") else "")
        if "\n".join(plan_apply(restored, path)) != "\n".join(lines):
            raise AnchorError(f"{path}: reverting would not give back a file that patches to this one; refusing")
    return original


def state(text: str, path: str = "pretrain_gpt.py") -> tuple[str, str]:
    """(``applied`` | ``not applied`` | ``modified``, why) for the text of ``pretrain_gpt.py``."""
    if MARKER.strip() in text:
        try:
            plan_revert(text, path)
            return "applied", "the three marked mechmon edits are present"
        except AnchorError as exc:
            return "modified", f"{exc} (partially patched, or edited after patching)"
    if "mechmon" in text:
        return "modified", (f"{path} mentions mechmon without the '{MARKER.strip()}' marks (edited by hand?); "
                            "mechmon-patch leaves it alone")
    try:
        plan_apply(text, path)
        return "not applied", "the three insertion points were located"
    except AnchorError as exc:
        return "modified", str(exc)
