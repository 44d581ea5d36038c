"""The performance lab: it drives the training core (config, tasks, trainer, strategies) and is
never imported by it. Its rooms:

  commands.py   each lab command's help, description and arguments (light: the CLI's parser)
  recipes.py    the recipe as the lab runs it: quiet, with overrides, with synthetic data
  machine.py    the machine and the software a measurement ran on
  timing.py     one trainer timed: Bench (the loop's own step), its step split, out of memory
  rounds.py     several side by side in interleaved rounds, and their paired statistics
  bench.py ladder.py tune.py sweep.py predict.py search/   the commands (each `run(args)`)
  peer.py report.py comm_model.py linkbench.py             what they use: timm's loop beside
                the recipe's, tables and plots, the communication model and its measured link

The CLI imports commands.py alone to build its parser; a command's module is imported when it
runs, and imports torch and the training core at its top."""
