"""The gateway service: an OpenAI-compatible API for black-box agents, recording token-exact trajectories."""
