"""The http rollout engine: rollouts from a fleet behind one URL (OpenAI-compatible or SGLang's /generate)."""
