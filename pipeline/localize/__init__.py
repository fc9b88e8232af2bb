"""Localisation: the first boundary (layer and op) where two engines part, verified by swapping.

`boundaries` names the points of the network that are captured, in network order; `adapters`
capture them from each engine family; `measure` turns two sides' captures into drift and a
precision floor per boundary; `verdict` names the first boundary beyond the floor; `swap` checks
that claim by running one side with the other's activations or weights; `run` sequences all of
it and writes `localize.json`; `chart` draws drift by layer.
"""
