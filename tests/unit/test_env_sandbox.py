"""The env service starts (and probes) a sandbox only when an env it serves needs one, hands it to
those envs, reports its tier in ListEnvs, and refuses to start when the probe fails."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
from relayrl.common.grpc_server import start
from relayrl.common.sandbox import SandboxUnsafe
from relayrl.env.config import EnvConfig
from relayrl.env.server import build, run
from relayrl.env.v1 import env_pb2 as e
from relayrl.env.v1 import env_pb2_grpc

from tests.kit.serving import client

PLUGIN = "tests.kit.sandbox_env:SandboxedEnv"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


async def _listed_and_reset(config: EnvConfig) -> tuple[str, str]:
    handle = build(config)
    await start(handle, ready=True)
    try:
        async with client(handle, env_pb2_grpc.EnvServiceStub) as s:
            listed = await s.stub.ListEnvs(e.ListEnvsRequest(), timeout=5)
            if PLUGIN not in config.plugins:
                return listed.sandbox_tier, ""
            task = json.dumps({"code": "print(6 * 7)"})
            r = await s.stub.Reset(
                e.ResetRequest(env="test/sandboxed", task_json=task, episode_id="ep/0"), timeout=10
            )
            return listed.sandbox_tier, r.messages[0].content
    finally:
        await handle.stop(0)


async def test_no_sandbox_without_an_env_that_needs_one():
    assert await _listed_and_reset(EnvConfig(sandbox={"bwrap": "/usr/bin/no-such-bwrap"})) == ("", "")


@needs_bwrap
@pytest.mark.parametrize("tier", ["full", "rlimits-only"])
async def test_an_env_that_needs_one_gets_the_probed_sandbox(tier):
    config = EnvConfig(plugins=[PLUGIN], sandbox={"tier": tier, "workers": 1})
    assert await _listed_and_reset(config) == (tier, "ok: 42\n")


async def test_refuses_to_start_when_isolation_is_missing():
    folder = tempfile.mkdtemp(prefix="relayrl-fake-bwrap-")
    try:
        os.chmod(folder, 0o755)
        fake = os.path.join(folder, "bwrap")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
        os.chmod(fake, 0o755)
        config = EnvConfig(plugins=[PLUGIN], sandbox={"bwrap": fake})
        with pytest.raises(SandboxUnsafe, match="No permissions to creating new namespace"):
            build(config)
        with pytest.raises(SystemExit, match="env: sandbox tier full cannot run code"):
            await run(config)
    finally:
        shutil.rmtree(folder)
