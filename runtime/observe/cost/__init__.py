"""What a run costs, in one place (docs/cost.md): the estimate, the spend as it goes, and the rules
that stop or pause a run for it. Both sides of training use it: rank 0's loop asks ``watch``, the
driver ``spend``; neither imports the other.

- ``table``: the price table (prices/instances.yaml) and the per-rank estimate
  (``rt_job_estimated_cost_dollars``).
- ``prices``: where the price per instance-hour comes from (the table, or EC2's live spot price),
  cached per TTL.
- ``meter``: ``SpendMeter`` (nodes x price x time), ``budget_reached``, ``billed_nodes``, and the
  run's ledger ``cost.json`` (``CostLedger``).
- ``watch``: rank 0's ``CostWatch``: the budget and the spot-price pause, asked at every boundary.
- ``spend``: the driver's side: the spend each report shows, the ledger across attempts, the wait
  while the spot price is high.

This package file imports nothing: the progress line and the run report import ``meter`` alone.
"""
