"""The flows the commands start in-process: the CPU smoke and the knob sweep (the plan
orchestrator, which only sequences stage processes, is pipeline/orchestrator/)."""
