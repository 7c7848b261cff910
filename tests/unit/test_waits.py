"""Every wait in ``services/`` that can last forever has a deadline, or says why it may not.

Read from the source (``ast``): the awaits of the primitives that wait forever when misused must
be *bounded* (``asyncio.wait_for(...)`` with a timeout in the same expression, ``within(...)``
(``generator/engine.py``: a ``wait_for`` that does not wait for a callee that ignores its
cancellation), or an enclosing ``async with asyncio.timeout(...)`` in the same function) or carry
a ``# wait:`` comment, on the line of the await (or of its statement) or in the comment block just
above, saying why the wait may last as long as it does (``# wait: the server's lifetime; SIGTERM
ends it``).

What is checked:

* ``await x.wait()`` and ``await x.wait_for(...)``: an ``Event`` or a ``Condition`` (not
  ``asyncio.wait_for``, which is the bound);
* ``await x.get()`` with no argument: a ``Queue``;
* ``await x.acquire()``, and ``async with x`` where ``x`` is a name or an attribute (not a call):
  a ``Lock``, ``Condition`` or ``Semaphore`` taken;
* ``await x.wait_closed()``, ``await x.wait_for_termination()``;
* ``await asyncio.wait(...)`` without ``timeout=``;
* ``await asyncio.gather(...)`` when an argument is a future or task made elsewhere (a name or an
  attribute, starred or not). Narrowed on purpose: a gather of coroutine calls
  (``gather(*(self._call(r) for r in reps))``) awaits code whose own waits this test checks where
  they are written, and flagging every gather would only be answered with empty comments;
* a future or task awaited directly (``await task``, ``await self.fut``), also through
  ``asyncio.shield``;
* a gRPC stub call without ``timeout=``, awaited or not (a server-streaming call is iterated, not
  awaited): a CamelCase method called on something named ``*stub*`` (``self.stub.TrainStep``,
  ``self._stub(r).GetStatus``, ``HealthStub(ch).Check``, ``getattr(self.stub, rpc)(...)``).

Not checked: awaits of the project's own coroutines (the waits inside them are checked where they
are), ``asyncio.to_thread`` (the function's own bound), sleeps, and primitives handed to
``ensure_future`` (the await of that task is what is checked).
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "services"
MARK = "# wait:"


def _name(node: ast.AST) -> str:
    """``asyncio.wait`` for ``asyncio.wait``; the last identifier of anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{node.value.id}.{node.attr}" if isinstance(node.value, ast.Name) else node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _kw(call: ast.Call, name: str, position: int | None = None) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    if position is not None and len(call.args) > position:
        return call.args[position]
    return None


def _is_none(node: ast.expr | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is None)


def _bounding(call: ast.AST) -> bool:
    """A call that bounds what it is given: ``asyncio.wait_for(x, t)`` or ``within(x, t, ...)``
    with a timeout that is not ``None``."""
    if not isinstance(call, ast.Call):
        return False
    name = _name(call)
    if name == "asyncio.wait_for":
        return not _is_none(_kw(call, "timeout", 1))
    if name.split(".")[-1] == "within":
        return not _is_none(_kw(call, "seconds", 1))
    return False


def _is_stub(node: ast.AST) -> bool:
    return "stub" in _name(node).lower()


def stub_call_without_timeout(call: ast.Call) -> bool:
    """A gRPC call (a CamelCase method of something named ``*stub*``) with no ``timeout=``."""
    f = call.func
    if isinstance(f, ast.Attribute):
        rpc = f.attr[:1].isupper() and _is_stub(f.value)
    else:  # getattr(self.stub, name)(request, ...)
        rpc = isinstance(f, ast.Call) and _name(f) == "getattr" and bool(f.args) and _is_stub(f.args[0])
    return rpc and _kw(call, "timeout") is None


def unbounded_wait(expr: ast.expr) -> str | None:
    """Why awaiting ``expr`` may wait forever, or None (bounded, or not a primitive checked)."""
    if _bounding(expr):
        return None
    if isinstance(expr, ast.Call) and _name(expr) in ("asyncio.shield", "asyncio.wait_for") and expr.args:
        return unbounded_wait(expr.args[0])  # a shield, or a wait_for with timeout None, bounds nothing
    if isinstance(expr, ast.Name | ast.Attribute):
        return f"a future or task awaited directly: {ast.unparse(expr)}"
    if not isinstance(expr, ast.Call):
        return None
    name, f = _name(expr), expr.func
    if name == "asyncio.wait":
        return "asyncio.wait without timeout=" if _is_none(_kw(expr, "timeout")) else None
    if name == "asyncio.gather":
        made = [
            a
            for a in expr.args
            if isinstance(a.value if isinstance(a, ast.Starred) else a, ast.Name | ast.Attribute)
        ]
        return f"asyncio.gather of futures or tasks ({', '.join(map(ast.unparse, made))})" if made else None
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "asyncio"):
        if f.attr in ("wait", "wait_for", "acquire", "wait_closed", "wait_for_termination"):
            return f".{f.attr}()"
        if f.attr == "get" and not expr.args and not expr.keywords:
            return ".get() (a queue)"
    return None


def _comments(source: str) -> dict[int, str]:
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


class _Finder(ast.NodeVisitor):
    """Unbounded waits of one module: (line, statement line, why)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, int, str]] = []
        self.bounded = False  # inside ``async with asyncio.timeout(...)`` of this function
        self.statement = 0

    def generic_visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt):
            outer, self.statement = self.statement, node.lineno
            super().generic_visit(node)
            self.statement = outer
        else:
            super().generic_visit(node)

    def _function(self, node: ast.AST) -> None:
        outer, self.bounded = self.bounded, False  # a function runs wherever it is called
        self.generic_visit(node)
        self.bounded = outer

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _report(self, node: ast.AST, why: str | None, statement: int = 0) -> None:
        """``statement``: the line of the statement the wait is in (default: the innermost one)."""
        if why and not self.bounded:
            self.found.append((node.lineno, statement or self.statement or node.lineno, why))

    def visit_Await(self, node: ast.Await) -> None:
        self._report(node, unbounded_wait(node.value))
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if stub_call_without_timeout(node):  # awaited or not (a stream is iterated)
            self._report(node, "a gRPC call without timeout=")
        outer, self.bounded = self.bounded, self.bounded or _bounding(node)
        self.generic_visit(node)
        self.bounded = outer

    def visit_AsyncWith(self, node: ast.AsyncWith) -> None:
        for item in node.items:
            e = item.context_expr
            if isinstance(e, ast.Name | ast.Attribute):
                self._report(node, f"a lock taken: async with {ast.unparse(e)}", node.lineno)
        timeout = any(
            isinstance(i.context_expr, ast.Call)
            and _name(i.context_expr) in ("asyncio.timeout", "asyncio.timeout_at")
            and not _is_none(
                _kw(i.context_expr, "delay" if _name(i.context_expr) == "asyncio.timeout" else "when", 0)
            )
            for i in node.items
        )
        outer, self.bounded = self.bounded, self.bounded or timeout
        self.generic_visit(node)
        self.bounded = outer


def _explained(line: int, lines: list[str], comments: dict[int, str]) -> bool:
    """A ``# wait:`` comment on ``line`` or in the block of comment lines just above it."""
    if MARK in comments.get(line, ""):
        return True
    k = line - 1
    while k >= 1 and lines[k - 1].strip().startswith("#"):
        if MARK in comments.get(k, ""):
            return True
        k -= 1
    return False


def offenders(source: str, label: str = "<source>") -> list[str]:
    """``label:line: why`` for each unbounded wait of ``source`` that says nothing of why."""
    finder = _Finder()
    finder.visit(ast.parse(source))
    lines, comments = source.splitlines(), _comments(source)
    out = []
    for line, stmt, why in sorted(set(finder.found)):
        if not (_explained(line, lines, comments) or _explained(stmt, lines, comments)):
            out.append(f"{label}:{line}: {why}: {lines[line - 1].strip()}")
    return out


def service_modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if "_pb2" not in p.name)


def test_every_wait_that_can_last_forever_is_bounded_or_says_why():
    found = [o for p in service_modules() for o in offenders(p.read_text(), str(p.relative_to(ROOT.parent)))]
    for line in found:
        print(line)
    assert not found, f"{len(found)} wait(s) without a deadline or a '# wait:' reason:\n" + "\n".join(found)


# -- the detector itself: what it must flag, and what it must let pass ---------------------------


def _one(body: str) -> list[str]:
    return offenders("async def f(self, stub, ch, task, q, ev):\n" + body)


def test_the_detector_flags_each_primitive_awaited_without_a_bound():
    for body in (
        "    await ev.wait()\n",
        "    await self.cond.wait_for(lambda: True)\n",
        "    await q.get()\n",
        "    await self.lock.acquire()\n",
        "    async with self.lock:\n        pass\n",
        "    await server.wait_for_termination()\n",
        "    await writer.wait_closed()\n",
        "    await asyncio.wait({task})\n",
        "    await asyncio.wait({task}, return_when=asyncio.FIRST_COMPLETED)\n",
        "    await asyncio.wait({task}, timeout=None)\n",
        "    await asyncio.gather(*self.tasks, return_exceptions=True)\n",
        "    await asyncio.gather(task, self.call())\n",
        "    await task\n",
        "    await self.fut\n",
        "    await asyncio.shield(task)\n",
        "    await stub.TrainStep(req)\n",
        "    await self._stub(r).GetStatus(req, metadata=m)\n",
        "    await gg.GeneratorServiceStub(ch).Generate(req)\n",
        "    await getattr(self.stub, rpc)(req)\n",
        "    async for r in stub.Generate(req):\n        pass\n",
        "    await asyncio.wait_for(ev.wait(), None)\n",
        "    async with asyncio.timeout(None):\n        await ev.wait()\n",
        "    async with asyncio.timeout(5):\n        async def g():\n            await ev.wait()\n",
        "    # wait: a comment above an enclosing statement explains nothing inside it\n"
        "    try:\n        async with self.lock:\n            pass\n    finally:\n        pass\n",
    ):
        assert len(_one(body)) == 1, body


def test_the_detector_lets_bounded_or_explained_waits_pass():
    for body in (
        "    await asyncio.wait_for(ev.wait(), 5)\n",
        "    await asyncio.wait_for(asyncio.shield(task), timeout=t)\n",
        "    await within(task, 5.0, 'x')\n",
        "    async with asyncio.timeout(5):\n        await ev.wait()\n        async with self.lock:\n            pass\n",
        "    await asyncio.wait({task}, timeout=3)\n",
        "    await asyncio.gather(*(self.call(r) for r in rs))\n",
        "    await stub.TrainStep(req, timeout=3)\n",
        "    await getattr(self.stub, rpc)(req, timeout=self.deadline)\n",
        "    await self.stubs.get(name)\n",  # not an RPC (lower case), and get() with an argument
        "    await self.work()\n",
        "    await asyncio.sleep(1)\n",
        "    async with self.connect():\n        pass\n",
        "    # wait: the server's lifetime; SIGTERM ends it\n    await ev.wait()\n",
        "    # wait: why, at length\n    # and more\n    await task\n",
        "    await ev.wait()  # wait: the producer is bounded\n",
        "    x = (\n        # wait: a long statement\n        await task\n    )\n",
        "    # wait: on the statement\n    results = await asyncio.gather(\n        *futures,\n    )\n",
    ):
        assert _one(body) == [], body
