"""Capture adapters, one per engine family, found like the scoring engines.

An adapter is named in a SPEC, `ENGINE[:knob=value,...]` (`hf:dtype=bf16`,
`megatron:tensor_parallel_size=2,dtype=bf16`). `open_side(spec, model_dir)` returns a session with:

- `name`, `dtype` (declared), `reference_dtype` (the precision its floor is measured against),
  `layout` (a dict written into localize.json), `boundaries` (names, in network order);
- `capture(token_ids, precision, sink, replace=None)`: one forward of one sequence at
  `precision` ("declared" or "reference"), calling `sink(boundary, rows)` with each boundary's
  rows in the HF layout (see `pipeline.localize.boundaries`) as soon as they exist; `replace`
  maps boundary names to rows to use in place of the engine's own (an activation swap);
  adapters that cannot swap set `can_replace = False`;
- optionally `module_swap(boundary, donor)`: a context manager running with the donor
  session's weights (in the donor's dtype) for the module that computes `boundary`;
- `close()`.

Third-party adapters register in the entry-point group `lpx.capture_engines`.
"""

from __future__ import annotations

from pipeline.localize.adapters.registry import GROUP, REFUSED, engine_names, open_side, parse_spec

__all__ = ["GROUP", "REFUSED", "engine_names", "open_side", "parse_spec"]
