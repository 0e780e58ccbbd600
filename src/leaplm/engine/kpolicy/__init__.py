"""The K policy: how many tokens each step proposes (docs/adaptive-k.md).

- policy.py: the policy as the batch step sees it (plan a step, observe its outcome)
- adaptive.py: the choice of K from per-row acceptance and the target's costs
- acceptance.py: per-request acceptance estimates; estimates.py: what the engine has measured across requests
- costs.py: forward costs per (rows, block length); calibrate.py: their start-up calibration
- probes.py: when a batch at K = 0 tries K > 0 again
- measured.py: committed tokens per wall-second of each K per arm class, which overrule the cost model's K where it
  is measured to lose (start here: how K is finally chosen)
"""
