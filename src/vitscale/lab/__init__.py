"""The performance lab: timing harness, bench, ladder, tune, sweep, predict, reports and the
communication model. It drives the training core (config, tasks, trainer, strategies) and is
never imported by it.

Each command module (bench, ladder, tune, sweep, predict) imports torch and the training core
inside its functions, not at the top: the CLI imports every command module to build its parser,
and `vitscale --help` or `vitscale config` must not pay for importing torch, which only the
commands that build models need."""


def add_synthetic_argument(p) -> None:
    """`--synthetic`, one definition for bench, ladder, tune and sweep (which passes it to bench)."""
    p.add_argument("--synthetic", action="store_true",
                   help="synthetic images of the dataset's shape, one batch reused: no dataset needed, no data cost")
