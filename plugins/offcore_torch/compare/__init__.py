"""``offcore compare``: strategies measured side by side on one workload, and the planner's pieces it runs.

- :mod:`.compare_command`: the command line (registered by :mod:`offcore_torch.commands`);
- :mod:`.compare`: runs the strategies and gates their results;
- :mod:`.profiler`: measures a training step per layer (the planner's input) and the links;
- :mod:`.executor`: runs a plan of the planner on a model.

This package imports nothing itself.
"""
