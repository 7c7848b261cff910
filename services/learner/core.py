"""The learner's collective operations, driven by rank 0 and mirrored by every other rank.

Rank 0 calls ``LearnerCore.<op>`` (from the servicer, in a worker thread); each op first sends
a command on the control channel, then runs the collective part itself. Other ranks sit in
``follow()``, receive the command and run the same collective part. Validation happens on rank 0
*before* a command is sent, so a bad request never leaves the ranks out of step.
"""

from __future__ import annotations

import json
import logging
import os

from relayrl.common import logcontext
from relayrl.common.rpc import FailedPrecondition, InvalidRequest, NotFound
from relayrl.common.weightsync.plan import Bucket, plan_from_plain, plan_to_plain
from relayrl.learner.control import Control
from relayrl.learner.push import Sinks, send_buckets
from relayrl.learner.samples import decode_samples, decode_sequences
from relayrl.learner.trainer import Trainer
from relayrl.learner.v1 import learner_pb2

logger = logging.getLogger(__name__)

TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
MAX_TAG_CHARS = 128
MAX_CLIENT_STATE_CHARS = 1 << 20
"""Longest ``client_state_json`` a checkpoint keeps: a caller's cursor and counters, not data
(every rank stores it in its checkpoint and LoadCheckpoint sends it back)."""


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


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def check_client_state(text: str) -> str:
    """A checkpoint's ``client_state_json``: empty, or one JSON text (RFC 8259: no NaN or
    Infinity, which other languages' parsers refuse) of at most ``MAX_CLIENT_STATE_CHARS``. It is
    given back as is by LoadCheckpoint: refused now rather than unreadable at the resume.

    >>> check_client_state('{"step": 3}')
    '{"step": 3}'
    >>> check_client_state("{step: 3}")
    Traceback (most recent call last):
    ...
    relayrl.common.rpc.InvalidRequest: client_state_json is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)
    """
    if len(text) > MAX_CLIENT_STATE_CHARS:
        raise InvalidRequest(
            f"client_state_json has {len(text)} characters; at most {MAX_CLIENT_STATE_CHARS}"
        )
    if text:
        try:
            json.loads(text, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise InvalidRequest(f"client_state_json is not JSON: {str(e)[:200]}") from None
    return text


class LearnerCore:
    def __init__(self, trainer: Trainer, control: Control):
        self.trainer = trainer
        self.control = control
        self.role = trainer.cfg.role

    def _decode(self, req: learner_pb2.TrainStepRequest):
        return decode_samples(req, self.trainer.vocab_size, self.trainer.max_len, self.trainer.cfg)

    def require(self, *roles: str, what: str) -> None:
        """Refuse an operation this learner's role does not serve (before any collective)."""
        if self.role not in roles:
            raise FailedPrecondition(f"this learner is a {self.role}: {what} needs a {' or '.join(roles)}")

    # -- rank 0 -------------------------------------------------------------------------
    def train(self, req: learner_pb2.TrainStepRequest, max_completion_tokens: int) -> dict:
        self.require("actor", "critic", what="TrainStep")
        samples = self._decode(req)
        max_tokens = max_completion_tokens or max(len(s.completion) for s in samples)
        self.control.send({"op": "train", "max_tokens": max_tokens}, req.SerializeToString())
        m = self.trainer.train_step(samples, max_tokens)
        if not m["applied"]:  # every rank skipped it alike: they are still in step
            raise InvalidRequest(
                f"the batch gives a gradient norm of {m['grad_norm']} (loss {m['loss']}): the step was "
                "not applied; weights, optimizer and step are unchanged"
            )
        return m

    def score(self, sequences, what: str) -> list[list[float]]:
        """Per-token log-probs (``what`` "logprobs": actor, reference) or values ("values":
        critic) of the sequences (TokenSequence messages), computed by every rank."""
        if what == "values":
            self.require("critic", what="ComputeValues")
        else:
            self.require("actor", "reference", what="ComputeLogprobs")
        samples = decode_sequences(sequences, self.trainer.vocab_size, self.trainer.max_len)
        payload = learner_pb2.ComputeValuesRequest(sequences=sequences).SerializeToString()
        self.control.send({"op": "score"}, payload)
        return self.trainer.score(samples)

    def push(
        self, buckets: list[Bucket], sinks: Sinks, transport_only: bool = False
    ) -> tuple[int, list[int]]:
        """Gather (all ranks) and send (rank 0 -> generators, over ``sinks``) every bucket of the
        push's plan (``WeightSync.push`` made it; the other ranks get it with the command);
        returns the bytes sent and each bucket's checksum. ``transport_only``: rank 0 sends zeros
        of the same sizes, nothing is gathered (the other ranks are not involved)."""
        import torch

        if transport_only:
            zeros = (torch.zeros(b.nbytes, dtype=torch.uint8) for b in buckets)
            return send_buckets(buckets, zeros, sinks)
        self.control.send({"op": "push", "plan": plan_to_plain(buckets)})
        return send_buckets(buckets, self.trainer.gathered_buckets(buckets), sinks)

    def _check(self, op: str, path: str, tag: str) -> None:
        """Every rank says whether it can run ``op``; any problem refuses it on all of them
        before one starts (NOT_FOUND for a checkpoint to load, INVALID_ARGUMENT otherwise)."""
        self.control.send({"op": "check", "check": op, "path": path, "tag": tag})
        problems = [p for p in self.control.gather_text(self.trainer.problem(op, path, tag)) if p]
        if problems:
            raise (NotFound if op == "load" else InvalidRequest)("; ".join(problems))

    def save(self, path: str, tag: str, client_state_json: str) -> None:
        self.require(
            "actor", "critic", what="SaveCheckpoint (a reference is frozen: its model folder is its state)"
        )
        self._check("save", path, tag)
        self.control.send({"op": "save", "path": path, "tag": tag, "state": client_state_json})
        self.trainer.save(path, tag, client_state_json)

    def load(self, path: str, tag: str) -> dict:
        self.require(
            "actor", "critic", what="LoadCheckpoint (a reference is frozen: its model folder is its state)"
        )
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

    def export(self, path: str, bucket_bytes: int, adapter: bool = False) -> None:
        self.require("actor", "reference", what="ExportModel (a critic is kept as checkpoints)")
        if adapter and self.trainer.peft is None:
            raise FailedPrecondition(
                "ExportModel(adapter): this learner trains no LoRA adapter (learner.lora)"
            )
        self._check("export", path, "")
        self.control.send({"op": "export", "path": path, "bucket_bytes": bucket_bytes, "adapter": adapter})
        self.trainer.export(path, bucket_bytes, adapter)

    def stop(self, timeout: float | None = None) -> None:
        """Release the other ranks from ``follow``; within ``timeout`` seconds when given (a
        rank that does not take it within that is left to its heartbeat)."""
        self.control.send({"op": "stop"}, timeout=timeout)

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
                samples = self._decode(req)
                with logcontext.bound(run_id=req.run_id or None, step=req.step):
                    self.trainer.train_step(samples, cmd["max_tokens"])
            elif op == "score":
                seqs = learner_pb2.ComputeValuesRequest.FromString(payload).sequences
                self.trainer.score(decode_sequences(seqs, self.trainer.vocab_size, self.trainer.max_len))
            elif op == "push":  # gather only: rank 0 sends
                for _ in self.trainer.gathered_buckets(plan_from_plain(cmd["plan"])):
                    pass
            elif op == "check":
                self.control.gather_text(self.trainer.problem(cmd["check"], cmd["path"], cmd["tag"]))
            elif op == "save":
                self.trainer.save(cmd["path"], cmd["tag"], cmd["state"])
            elif op == "load":
                self.trainer.load(cmd["path"], cmd["tag"])
            elif op == "export":
                self.trainer.export(cmd["path"], cmd["bucket_bytes"], cmd.get("adapter", False))
            else:
                raise RuntimeError(f"unknown learner command {op!r}")
