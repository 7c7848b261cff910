"""Built-in env ``pyexec``: the calc task (rows of ``relayrl data calc``: "What is A * B?"), with
a ``python(code)`` tool instead of a calculator: the model's program runs in the replica's
sandbox (``relayrl.common.sandbox``) and what it prints is the answer the model reads.

The reward is calc's (``CalcTask``): 1.0 when the last number of the final answer equals the
ground truth; components ``correctness``, ``tool_calls``, ``turns``.

Who is at fault decides what a failure becomes:
* the model's program failed (an exception, its time or memory limit, a signal): an answer
  the model reads, ``error: ...`` with the verdict and the end of its stderr, status CRASHED;
  the episode goes on (the model may fix its program). Output past ``MAX_OUTPUT_CHARS`` is cut,
  status OUTPUT_TRUNCATED. A program stopped at the sandbox's limit is answered, so it is not a
  tool TIMEOUT (that status means the model never saw an answer, and masks the episode).
* the sandbox cannot run anything (``SandboxUnavailable``): infrastructure, never a reward. The
  tool raises ``EnvUnavailable``, the episode ends and Close answers REDO
  ("sandbox_unavailable"); so does a Reset on a replica that has no sandbox.
"""

from __future__ import annotations

from relayrl.common.sandbox import RunResult, SandboxUnavailable, Verdict
from relayrl.env.base import EnvUnavailable, ToolStatus
from relayrl.env.calc import CalcTask
from relayrl.env.tools import ToolEnv, ToolReply, call_deadline, cut, tool

MAX_CODE_CHARS = 4000
"""A longer program is refused unrun (INVALID_ARGS): a multiplication takes one line."""
MAX_OUTPUT_CHARS = 2000
"""What the model reads of a program's stdout (the rest is counted, not shown)."""
MAX_STDERR_CHARS = 600
"""The end of a failed program's stderr that the model reads (a traceback's last lines)."""
_WHY = {
    Verdict.TIMEOUT: "ran past its time limit and was stopped",
    Verdict.MEMORY: "ran out of memory and was stopped",
    Verdict.KILLED: "was killed",
    Verdict.CRASHED: "failed",
}


def tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text``, saying how much was left out before them.

    >>> tail("abcdef", 3), tail("ab", 3)
    ('(3 characters before) ...def', 'ab')
    """
    return text if len(text) <= limit else f"({len(text) - limit} characters before) ...{text[-limit:]}"


def observe(r: RunResult) -> ToolReply:
    """What the model reads of a run, and its tool status.

    >>> from dataclasses import replace
    >>> ok = RunResult(Verdict.OK, 0, None, "56088\\n", "", 0.03, False)
    >>> observe(ok)
    ToolReply(text='56088\\n', status=<ToolStatus.OK: 'ok'>)
    >>> boom = replace(ok, verdict=Verdict.CRASHED, exit_code=1, stdout="",
    ...                    stderr="Traceback (most recent call last):\\nZeroDivisionError: division by zero\\n")
    >>> print(observe(boom).text)
    error: the program failed (exit status 1)
    Traceback (most recent call last):
    ZeroDivisionError: division by zero
    >>> observe(replace(ok, verdict=Verdict.TIMEOUT, exit_code=None, signal=9, wall_seconds=2.0, stdout=""))
    ToolReply(text='error: the program ran past its time limit and was stopped (after 2s, signal 9)', status=<ToolStatus.CRASHED: 'crashed'>)
    >>> observe(replace(ok, stdout="1" * 2500)).status
    <ToolStatus.OUTPUT_TRUNCATED: 'output_truncated'>
    """
    out = cut(r.stdout, MAX_OUTPUT_CHARS)
    was_cut = len(r.stdout) > MAX_OUTPUT_CHARS or r.truncated or r.verdict == Verdict.OUTPUT_TRUNCATED
    failed = r.verdict not in (Verdict.OK, Verdict.OUTPUT_TRUNCATED) or (r.exit_code or 0) != 0
    if not failed:
        note = "\n(output cut: the program printed more than the sandbox keeps)" if r.truncated else ""
        return ToolReply(out + note, ToolStatus.OUTPUT_TRUNCATED if was_cut else ToolStatus.OK)
    how = [f"exit status {r.exit_code}"] if r.exit_code not in (None, 0) else []
    if r.verdict == Verdict.TIMEOUT:
        how.append(f"after {r.wall_seconds:.3g}s")
    if r.signal:
        how.append(f"signal {r.signal}")
    head = f"error: the program {_WHY.get(r.verdict, 'failed')}" + (f" ({', '.join(how)})" if how else "")
    parts = [head, out.rstrip("\n"), tail(r.stderr, MAX_STDERR_CHARS).rstrip("\n")]
    return ToolReply("\n".join(p for p in parts if p), ToolStatus.CRASHED)


class PyExecEnv(CalcTask, ToolEnv):
    name = "pyexec"
    description = (
        "Arithmetic questions with a python(code) tool run in a sandbox; reward 1 for the right final number."
    )
    max_turns = 4
    needs_sandbox = True
    SYSTEM = (
        "You can call the python tool to run a Python program and read what it prints. "
        "When you know the answer, reply with the number."
    )

    def reset(self, task: dict, seed: int) -> list[dict]:
        if self.sandbox is None:
            raise EnvUnavailable("pyexec: this replica runs no sandbox", "sandbox_unavailable")
        return super().reset(task, seed)

    @tool
    def python(self, code: str) -> ToolReply:
        """Run a Python program and read what it prints (no network; files only under /tmp).

        Args:
            code: the program, e.g. "print(123 * 456)"
        """
        if not code.strip():
            raise ValueError("code is empty")
        if len(code) > MAX_CODE_CHARS:
            raise ValueError(f"code is longer than {MAX_CODE_CHARS} characters")
        try:
            return observe(self.sandbox.run_sync(code, deadline=call_deadline()))
        except SandboxUnavailable as e:
            raise EnvUnavailable(f"the sandbox cannot run programs: {e}", "sandbox_unavailable") from None
