"""The logprob-server scoring engine: a fixture scored by a running `lpx serve` or any server with its /score schema."""
