"""The learner's collective operations, driven by rank 0 and mirrored by every other rank.

Rank 0 calls ``LearnerCore.<op>`` (from the servicer, in a worker thread); each op first sends
a command on the control channel, then runs the collective part itself. Other ranks sit in
``follow()``, receive the command and run the same collective part. Validation happens on rank 0
*before* a command is sent, so a bad request never leaves the ranks out of step.
"""

from __future__ import annotations

import logging
import math
import os

from relayrl.common import logcontext
from relayrl.common import weightsync as ws
from relayrl.common.rpc import InvalidRequest, NotFound
from relayrl.learner.control import Control
from relayrl.learner.push import Sinks, send_buckets
from relayrl.learner.trainer import Sample, Trainer
from relayrl.learner.v1 import learner_pb2

logger = logging.getLogger(__name__)

MAX_ABS_ADVANTAGE = 1e6
"""Largest advantage magnitude accepted (normalised advantages are a few units; anything near
float limits makes the loss and the gradient infinite)."""
TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_TAG_CHARS = 128


def check_tag(tag: str) -> str:
    """A checkpoint tag is one plain folder name: letters, digits, ``.``, ``_``, ``-``; it starts
    with a letter or digit (so never ``..``), 128 characters at most.

    >>> check_tag("step20")
    'step20'
    >>> check_tag("../x")
    Traceback (most recent call last):
    ...
    relayrl.common.rpc.InvalidRequest: tag '../x': use 1 to 128 letters, digits, '.', '_' or '-', starting with a letter or digit
    """
    if not (
        0 < len(tag) <= MAX_TAG_CHARS and tag[0].isascii() and tag[0].isalnum() and set(tag) <= TAG_CHARS
    ):
        shown = tag if len(tag) <= 40 else tag[:40] + "..."
        raise InvalidRequest(
            f"tag {shown!r}: use 1 to {MAX_TAG_CHARS} letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return tag


def decode_samples(
    req: learner_pb2.TrainStepRequest, vocab_size: int, max_len: int, sft: bool
) -> list[Sample]:
    """Wire samples -> ``Sample``; every problem raises InvalidRequest naming the sample."""
    if not req.samples:
        raise InvalidRequest("samples is empty: nothing to train on")
    out = []
    for i, s in enumerate(req.samples):
        n = len(s.completion_token_ids)
        where = f"samples[{i}]"
        if not s.prompt_token_ids or not n:
            raise InvalidRequest(f"{where}: prompt_token_ids and completion_token_ids must be non-empty")
        if len(s.prompt_token_ids) + n > max_len:
            raise InvalidRequest(
                f"{where}: {len(s.prompt_token_ids) + n} tokens exceed the model's {max_len}"
            )
        if not (len(s.generator_logprobs) == n or (sft and not s.generator_logprobs)):
            raise InvalidRequest(
                f"{where}: {len(s.generator_logprobs)} generator_logprobs for {n} completion tokens"
            )
        if s.loss_mask and len(s.loss_mask) != n:
            raise InvalidRequest(f"{where}: {len(s.loss_mask)} loss_mask values for {n} completion tokens")
        if not all(0.0 <= x <= 1.0 for x in s.loss_mask):  # also refuses NaN
            raise InvalidRequest(f"{where}: loss_mask values must be in [0, 1]")
        if not abs(s.advantage) <= MAX_ABS_ADVANTAGE:  # also refuses NaN
            raise InvalidRequest(
                f"{where}: advantage is {s.advantage:g}; |advantage| must be <= {MAX_ABS_ADVANTAGE:g}"
            )
        if s.token_advantages and len(s.token_advantages) != n:
            raise InvalidRequest(
                f"{where}: {len(s.token_advantages)} token_advantages for {n} completion tokens"
            )
        if not all(abs(x) <= MAX_ABS_ADVANTAGE for x in s.token_advantages):  # also refuses NaN
            raise InvalidRequest(f"{where}: token_advantages must be finite, |a| <= {MAX_ABS_ADVANTAGE:g}")
        if not all(-math.inf < x <= 0.0 for x in s.generator_logprobs):
            raise InvalidRequest(f"{where}: generator_logprobs must be finite log-probabilities (<= 0)")
        ids = list(s.prompt_token_ids) + list(s.completion_token_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise InvalidRequest(f"{where}: token ids must be in [0, {vocab_size})")
        out.append(
            Sample(
                list(s.prompt_token_ids),
                list(s.completion_token_ids),
                list(s.generator_logprobs),
                float(s.advantage),
                list(s.loss_mask),
                list(s.token_advantages),
            )
        )
    return out


class LearnerCore:
    def __init__(self, trainer: Trainer, control: Control):
        self.trainer = trainer
        self.control = control
        self.sft = trainer.cfg.loss.kind == "sft"

    # -- rank 0 -------------------------------------------------------------------------
    def train(self, req: learner_pb2.TrainStepRequest, max_completion_tokens: int) -> dict:
        samples = decode_samples(req, self.trainer.vocab_size, self.trainer.max_len, self.sft)
        max_tokens = max_completion_tokens or max(len(s.completion) for s in samples)
        self.control.send({"op": "train", "max_tokens": max_tokens}, req.SerializeToString())
        m = self.trainer.train_step(samples, max_tokens)
        if not m["applied"]:  # every rank skipped it alike: they are still in step
            raise InvalidRequest(
                f"the batch gives a gradient norm of {m['grad_norm']} (loss {m['loss']}): the step was "
                "not applied; weights, optimizer and step are unchanged"
            )
        return m

    def push(
        self, bucket_bytes: int, dtype: str, sinks: Sinks, transport_only: bool = False
    ) -> tuple[int, list[int]]:
        """Gather (all ranks) and send (rank 0 -> generators, over ``sinks``) every bucket; returns
        the bytes sent and each bucket's checksum. ``transport_only``: rank 0 sends zeros of the
        same sizes, nothing is gathered (the other ranks are not involved)."""
        import torch

        buckets = ws.plan_buckets(self.trainer.param_metas(dtype), bucket_bytes)
        if transport_only:
            zeros = (torch.zeros(b.nbytes, dtype=torch.uint8) for b in buckets)
            return send_buckets(buckets, zeros, sinks)
        self.control.send({"op": "push", "bucket_bytes": bucket_bytes, "dtype": dtype})
        return send_buckets(buckets, self.trainer.gathered_buckets(buckets), sinks)

    def _check(self, op: str, path: str, tag: str) -> None:
        """Every rank says whether it can run ``op``; any problem refuses it on all of them
        before one starts (NOT_FOUND for a checkpoint to load, INVALID_ARGUMENT otherwise)."""
        self.control.send({"op": "check", "check": op, "path": path, "tag": tag})
        problems = [p for p in self.control.gather_text(self.trainer.problem(op, path, tag)) if p]
        if problems:
            raise (NotFound if op == "load" else InvalidRequest)("; ".join(problems))

    def save(self, path: str, tag: str, client_state_json: str) -> None:
        self._check("save", path, tag)
        self.control.send({"op": "save", "path": path, "tag": tag, "state": client_state_json})
        self.trainer.save(path, tag, client_state_json)

    def load(self, path: str, tag: str) -> dict:
        if not tag:  # the latest: DeepSpeed's "latest" file names it
            try:
                tag = open(os.path.join(path, "latest")).read(MAX_TAG_CHARS + 1).strip()
            except OSError:
                raise NotFound(f"no checkpoint under {path} (no 'latest' file)") from None
            try:
                check_tag(tag)
            except InvalidRequest as e:
                raise NotFound(f"{path}/latest does not name a checkpoint: {e}") from None
        self._check("load", path, tag)
        self.control.send({"op": "load", "path": path, "tag": tag})
        return {**self.trainer.load(path, tag), "tag": tag}

    def export(self, path: str, bucket_bytes: int) -> None:
        self._check("export", path, "")
        self.control.send({"op": "export", "path": path, "bucket_bytes": bucket_bytes})
        self.trainer.export(path, bucket_bytes)

    def stop(self) -> None:
        self.control.send({"op": "stop"})

    # -- shared ---------------------------------------------------------------------------
    def follow(self) -> None:
        """Other ranks: run commands from rank 0 until ``stop``."""
        while True:
            cmd, payload = self.control.recv()
            op = cmd["op"]
            if op == "stop":
                return
            if op == "train":
                req = learner_pb2.TrainStepRequest.FromString(payload)
                samples = decode_samples(req, self.trainer.vocab_size, self.trainer.max_len, self.sft)
                with logcontext.bound(run_id=req.run_id or None, step=req.step):
                    self.trainer.train_step(samples, cmd["max_tokens"])
            elif op == "push":  # gather only: rank 0 sends
                buckets = ws.plan_buckets(self.trainer.param_metas(cmd["dtype"]), cmd["bucket_bytes"])
                for _ in self.trainer.gathered_buckets(buckets):
                    pass
            elif op == "check":
                self.control.gather_text(self.trainer.problem(cmd["check"], cmd["path"], cmd["tag"]))
            elif op == "save":
                self.trainer.save(cmd["path"], cmd["tag"], cmd["state"])
            elif op == "load":
                self.trainer.load(cmd["path"], cmd["tag"])
            elif op == "export":
                self.trainer.export(cmd["path"], cmd["bucket_bytes"])
            else:
                raise RuntimeError(f"unknown learner command {op!r}")
