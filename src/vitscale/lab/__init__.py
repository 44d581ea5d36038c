"""The performance lab: timing harness, bench, ladder, tune, sweep, predict, reports and the
communication model. It drives the training core (config, tasks, trainer, strategies) and is
never imported by it."""
