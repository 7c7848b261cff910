"""The episode warm start of a tiny model: multi-turn SFT on an env's own episodes, rendered
through the generator's own chat codec, so SFT trains on the very tokens an RL episode of the
same actions gives (``tests/unit/test_warmstart.py`` checks it against the coordinator's
episodes).

It joins two services' code, the generator's (``ChatCodec``: render and bridge; the hermes
tool-call parser) and the env's (``CalcEnv`` or ``PyExecEnv``: its first messages, tools, tool
answers and reward), so it sits on the top floor beside the commands. The coordinator runs it as
a process, as it runs the services: ``python -m relayrl.warmstart --out DIR --task calc
--sft-steps N``.

Tasks (``TASKS``): ``calc`` and ``pyexec``, both on calc's rows ("What is A * B?"), differing in
the tool: ``calc({"expression": "a * b"})``, or ``python({"code": "print(a * b)"})`` run in a
sandbox (one for the whole warm start, as an env replica has one). Traces, ``tool_share`` of
them on the tool branch: the env's first messages (Reset), one hermes call as the template
renders an assistant call, the env's answer (Step) bridged on, then "The answer is N."; the rest
answer "The answer is N." at once. The tiny model cannot multiply 3-digit numbers, so the direct branch is mostly wrong: RL
must move the policy onto the tool. Held out: episodes played against the env, greedy and
sampled at temperature 1 (tool calls per episode, accuracy by the env's reward, and accuracy
with and without a call); after a 50/50 warm start the greedy policy takes one branch
everywhere, so the sampled measure is the one that shows the mix.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.common.data.tasks import generate
from relayrl.common.modelkit.episodes import Trace, episode_trace, load, play, reproduced, train_traces
from relayrl.coordinator.config import TinyModelSpec
from relayrl.env.base import Action, ToolCall, ToolStatus
from relayrl.env.calc import CalcEnv
from relayrl.env.pyexec import PyExecEnv
from relayrl.env.tools import ToolEnv
from relayrl.generator.bridge import ChatCodec
from relayrl.generator.toolcalls import Parse, openai_tool_call, parse_tool_calls

logger = logging.getLogger(__name__)

TOOL_FORMAT = "hermes"
MAX_NEW_TOKENS = 48
"""Longest turn in the held-out episodes (a calc call is about 30 tokens, a python call 31)."""


@dataclass(frozen=True)
class ToolTask:
    """An env whose warm start is on its episodes: calc's rows, the env's one tool."""

    env: type[ToolEnv]
    tool: str
    arguments: Callable[[str], dict]
    """The call's arguments for the row's expression ("a * b")."""

    def tools(self) -> list[dict]:
        """The tools as the generator receives them from the env service (its JSON, read back)."""
        return json.loads(json.dumps(self.env.tools))

    def make_env(self, sandbox: Any) -> ToolEnv:
        env = self.env()
        env.sandbox = sandbox
        return env


TASKS: dict[str, ToolTask] = {
    "calc": ToolTask(CalcEnv, "calc", lambda expression: {"expression": expression}),
    "pyexec": ToolTask(PyExecEnv, "python", lambda expression: {"code": f"print({expression})"}),
}
"""Tasks whose warm start is multi-turn (the rest: ``relayrl model tiny --task``)."""


def tool_corpus(seed: int, task: str = "calc") -> list[str]:
    """A task's texts for the tokenizer: the env's system message and tool schema, the questions,
    calls, tool answers and final answers (ordinary text)."""
    t = TASKS[task]
    rows = generate("calc", 200, seed=seed, split="train")
    out = [t.env.SYSTEM] * 20 + [json.dumps(x, ensure_ascii=False) for x in t.env.tools] * 20
    for row in rows:
        expression, answer = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
        out += [
            row["prompt"][-1]["content"],
            f"<tool_call>\n{json.dumps({'name': t.tool, 'arguments': t.arguments(expression)})}\n</tool_call>",
            f"<tool_response>\n{answer}\n</tool_response>",
            f"The answer is {answer}.",
        ]
    return out


def tool_episode(row: dict, seed: int, tool: bool, task: str = "calc", sandbox: Any = None):
    """One episode as the env plays it: its first messages (Reset) and the turns, (assistant
    message, the env's answer): the tool branch (the call, the env's answer by Step, the final
    answer) or the direct one (final answer at once). No tokenizer: safe to run in threads."""
    t = TASKS[task]
    env = t.make_env(sandbox)
    first = env.reset(row, seed)
    final = {"role": "assistant", "content": f"The answer is {row['reward_model']['ground_truth']}."}
    if not tool:
        return first, [(final, [])]
    args = t.arguments(row["extra_info"]["expression"])
    call = {"role": "assistant", "content": "", "tool_calls": [openai_tool_call("call_0_0", t.tool, args)]}
    answer, done, results = env.step(Action("", (ToolCall("call_0_0", t.tool, json.dumps(args)),)))
    assert not done, f"{task} ended the episode on a tool call"
    assert results[0].status == ToolStatus.OK, f"{task}: the warm start's own call failed: {answer}"
    return first, [(call, answer), (final, [])]


def tool_trace(
    codec: ChatCodec, row: dict, seed: int, tool: bool, task: str = "calc", sandbox: Any = None
) -> Trace:
    """One episode's trace (``tool_episode``) through the chat codec."""
    first, turns = tool_episode(row, seed, tool, task, sandbox)
    return episode_trace(codec, first, TASKS[task].tools(), turns)


class ToolPlayer:
    """A held-out episode against the task's env, the model's turns read as the generator reads
    them (hermes calls out of the completion's text, special tokens kept)."""

    def __init__(self, codec: ChatCodec, row: dict, seed: int, task: str = "calc", sandbox: Any = None):
        self.codec, self.env = codec, TASKS[task].make_env(sandbox)
        self.ids = codec.render(self.env.reset(row, seed), TASKS[task].tools())
        self.tool_calls, self.turns = 0, 0

    def step(self, completion: list[int]) -> list[dict] | None:
        ended = bool(completion) and completion[-1] in self.codec.end_of_turn_ids
        _, calls = parse_tool_calls(
            self.codec.completion_text(completion), TOOL_FORMAT, f"call_{self.turns}_"
        )
        text = self.codec.tokenizer.decode(completion, skip_special_tokens=True)
        action = Action(
            text,
            tuple(ToolCall(c.id, c.name, c.arguments_json, c.parse.name.lower()) for c in calls),
            "stop" if ended else "length",
        )
        self.turns += 1
        self.tool_calls += sum(c.parse == Parse.OK for c in calls)
        answer, done, _ = self.env.step(action)
        return None if done or self.turns >= self.env.max_turns else answer

    def correct(self) -> bool:
        return self.env.reward().reward >= 1.0


def heldout(
    model,
    codec: ChatCodec,
    rows: list[dict],
    seed: int,
    sampled: bool = False,
    task: str = "calc",
    sandbox: Any = None,
) -> dict[str, float]:
    """Held-out episodes, greedy (or sampled at temperature 1, seeded): tool calls per episode,
    accuracy, and accuracy with and without a tool call (None where no episode was)."""
    import torch
    from relayrl.common.modelkit.episodes import sample_generate
    from relayrl.common.modelkit.sft import greedy_generate

    torch.manual_seed(seed)
    players = [ToolPlayer(codec, r, seed + i, task, sandbox) for i, r in enumerate(rows)]
    for start in range(0, len(players), 32):
        play(
            model,
            codec,
            players[start : start + 32],
            TASKS[task].tools(),
            codec.tokenizer.pad_token_id,
            MAX_NEW_TOKENS,
            4,
            sample_generate if sampled else greedy_generate,
        )
    used = [p for p in players if p.tool_calls]
    direct = [p for p in players if not p.tool_calls]
    share = lambda ps: round(sum(p.correct() for p in ps) / len(ps), 4) if ps else None  # noqa: E731
    return {
        "tool_calls_per_episode": sum(p.tool_calls for p in players) / max(1, len(players)),
        "accuracy": share(players),
        "accuracy_with_tool": share(used),
        "accuracy_without_tool": share(direct),
        "n": len(players),
    }


def start_sandbox(task: str) -> Any:
    """The sandbox the task's env runs its tool in (its default config, the start-up probe
    included), or None for an env that needs none."""
    if not TASKS[task].env.needs_sandbox:
        return None
    from relayrl.common.sandbox import Sandbox, SandboxConfig, probe

    sandbox = Sandbox.from_config(SandboxConfig())
    probe(sandbox)  # SandboxUnsafe: no isolation, no warm start
    return sandbox


class WarmStartShort(RuntimeError):
    """The warm start ran its most steps and the model still does not play the tool branch."""


def warm_start_episodes(
    out: Path,
    task: str,
    seed: int,
    steps: int,
    lr: float,
    batch_size: int,
    tool_share: float,
    n_heldout: int,
    tool_bar: float = 0.0,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Train the model folder ``out`` in place on the task's traces; save it; the held-out
    measure. The traces' tool calls run as the env runs them (pyexec's in a sandbox, a few at
    once). With ``tool_bar``, training goes on past ``steps`` (100 at a time, up to
    ``max_steps``) until the model reproduces that share of held-out tool episodes
    (``episodes.reproduced``: every token after the first, teacher-forced); WarmStartShort when
    it never does: RL from such a model gets no reward on either branch, so no signal."""
    import torch

    torch.manual_seed(seed)
    model, tokenizer = load(out)
    codec = ChatCodec(tokenizer)
    sandbox = start_sandbox(task)
    # The steps past ``steps`` draw from the same traces: a build that passes at ``steps`` is the
    # build a fixed count made.
    rows = generate("calc", min(steps * batch_size, 8192), seed=seed, split="train")
    pick = random.Random(seed)
    branches = [pick.random() < tool_share for _ in rows]
    test = generate("calc", n_heldout, seed=seed, split="test")
    with ThreadPoolExecutor(4) as pool:  # pyexec's calls wait on the sandbox, not the GIL
        episodes = list(
            pool.map(lambda i: tool_episode(rows[i], seed + i, branches[i], task, sandbox), range(len(rows)))
        )
        checks = list(
            pool.map(lambda i: tool_episode(test[i], seed + i, True, task, sandbox), range(len(test)))
        )
    traces = [episode_trace(codec, first, TASKS[task].tools(), turns) for first, turns in episodes]
    held = [episode_trace(codec, first, TASKS[task].tools(), turns) for first, turns in checks]
    measured: list[float] = []

    def passed() -> bool:
        measured.append(reproduced(model, held, tokenizer.pad_token_id))
        logger.info("held-out tool episodes reproduced: %.3f (bar %.2f)", measured[-1], tool_bar)
        return measured[-1] >= tool_bar

    # Bar 0 passes at the first check, after exactly ``steps``.
    loss, ran = train_traces(
        model, traces, tokenizer.pad_token_id, steps, seed, lr, batch_size, passed, max_steps
    )
    if not (measured and measured[-1] >= tool_bar) and not passed():  # the model of the last steps, unchecked
        raise WarmStartShort(
            f"after {ran} warm-start steps the model reproduces {measured[-1]:.2f} of held-out {task} tool "
            f"episodes, under the bar of {tool_bar:.2f}: RL would get no reward to learn from. Raise "
            "model.tiny.sft_max_steps, try another model.tiny.seed, or set model.tiny.sft_tool_bar: 0 to keep it"
        )
    model.save_pretrained(out, safe_serialization=True)
    greedy = heldout(model, codec, test, seed, task=task, sandbox=sandbox)
    sampled = heldout(model, codec, test, seed, sampled=True, task=task, sandbox=sandbox)
    return {
        "final_loss": loss,
        "steps": ran,
        "tool_reproduced": measured[-1],
        **greedy,
        "sampled": sampled,
    }


def main(argv: list[str] | None = None) -> int:
    from relayrl.common.modelkit.tiny import update_card, write_tiny_model

    p = argparse.ArgumentParser(prog="python -m relayrl.warmstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="model folder to write (created)")
    p.add_argument("--task", choices=sorted(TASKS), default="calc")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, tokenizer corpus and SFT data")
    p.add_argument("--sft-steps", type=int, default=500)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--tool-share", type=float, default=0.5, help="share of traces on the tool branch")
    p.add_argument("--heldout", type=int, default=64, help="held-out episodes played after SFT")
    p.add_argument(
        "--tool-bar",
        type=float,
        default=TinyModelSpec.model_fields["sft_tool_bar"].default,  # one default: the experiment's
        help="train past --sft-steps until this share of held-out tool episodes is reproduced (0: never)",
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="most steps with --tool-bar (default 4 x --sft-steps)"
    )
    args = p.parse_args(argv)
    if not 0 <= args.tool_bar <= 1 or args.sft_steps < 0 or (args.max_steps or 0) < 0:
        p.error("--tool-bar must be in [0, 1], --sft-steps and --max-steps >= 0")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    t0 = time.monotonic()
    out = write_tiny_model(
        args.out, seed=args.seed, tools=True, extra_corpus=tool_corpus(args.seed, args.task)
    )
    try:
        res = warm_start_episodes(
            out,
            args.task,
            args.seed,
            args.sft_steps,
            args.sft_lr,
            args.batch_size,
            args.tool_share,
            args.heldout,
            args.tool_bar,
            4 * args.sft_steps if args.max_steps is None else args.max_steps,
        )
    except WarmStartShort as e:
        print(f"warm start failed: {e}", file=sys.stderr, flush=True)
        return 3
    update_card(
        out,
        sft_task=args.task,
        sft_steps=res["steps"],
        sft_tool_share=args.tool_share,
        sft_final_loss=res["final_loss"],
        sft_heldout_exact=res["accuracy"],
        sft_heldout=res,
    )
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731  (None: no such episode)
    line = lambda r: (  # noqa: E731
        f"{r['tool_calls_per_episode']:.2f} tool calls per episode, accuracy {f(r['accuracy'])} (with a "
        f"tool {f(r['accuracy_with_tool'])}, without {f(r['accuracy_without_tool'])}; n={r['n']})"
    )
    print(
        f"warm-started on {args.task} episodes: {res['steps']} steps, loss {res['final_loss']:.4f}, held-out tool "
        f"episodes reproduced {res['tool_reproduced']:.3f}; held-out "
        f"greedy: {line(res)}; sampled: {line(res['sampled'])} ({time.monotonic() - t0:.1f}s)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
