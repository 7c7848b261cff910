"""The environment service: sessions of multi-turn episodes with tools (relayrl.env.v1)."""
