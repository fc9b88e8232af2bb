"""Multi-turn trajectories: what each model turn's engine saw against what the trainer scores.

shape.py holds a trajectory (its turns, the trainer's flattened sequence and loss mask) and
refuses one that does not fit; template.py is the tiny model's chat template (Qwen3's
structure) and the append-only check of a template; parting.py finds where the engine's
context and the trainer's sequence part, names the class and reproduces it with the model's
own tokenizer.
"""
