"""The K policy: how many tokens each step proposes (docs/adaptive-k.md).

- policy.py: how K is chosen, end to end (start here): plan a step, observe its outcome
- adaptive.py: the cost model's K from per-row acceptance and the target's costs
- measured.py: committed tokens per wall-second of each K per arm class, which overrule the cost model's K where
  it is measured to lose, and explore K > 0 while it says K = 0
- acceptance.py: per-request acceptance estimates; estimates.py: what the engine has measured across requests;
  priors.py: where a request's estimate starts; shadow.py: evidence gathered at K = 0
- costs.py: forward costs per (rows, block length); calibrate.py: their start-up calibration
"""
