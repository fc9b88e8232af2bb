"""The contracts between stages: what each file holds, as typed models that write and read.

On the ground (pydantic and the standard library only), so every stage, the history and the
report can import them:
- `base.py`: what every model shares (strict types, unknown fields kept);
- `files.py`: the names of the files stages leave for each other;
- `metrics.py`: every metric compare writes, with the range it can take;
- `causes.py`: the causes a diagnosis can name, and a finding's status and severity;
- `report.py`: report.json (metrics, sequences, worst tokens, findings, the policy's verdict);
- `manifest.py`: lpx-run.json, as `lpx record` reads it;
- `localize.py`: localize.json;
- `bisect.py`: bisect.json, as `lpx bisect` writes it and `lpx record` reads it;
- `problems.py`: a validation error said the way lpx says bad input.

A field lpx does not know is kept (a newer lpx may write more); a field it reads is held to a
type and a range.
"""
