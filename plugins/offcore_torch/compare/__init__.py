"""``offcore compare``: strategies measured side by side on one workload, and the planner's pieces it runs.

- :mod:`.compare_command`: the command line (registered by :mod:`offcore_torch.commands`);
- :mod:`.compare`: runs the strategies and gates their results; :mod:`.settings` (what it runs),
  :mod:`.runs` (one training run), :mod:`.strategies` (each strategy's plan and prediction),
  :mod:`.max_batch` (the largest batch each fits);
- :mod:`.profiler`: measures a training step per layer (the planner's input): :mod:`.measurement`,
  :mod:`.recording`, :mod:`.calibration`, and the link (:mod:`.link`);
- :mod:`.executor`: runs a plan of the planner on a model.

This package imports nothing itself.
"""
