"""`vitscale` with its final evaluation held (tests/integration/test_preemption.py, issue 52): run as
torchrun's script, each rank entering the evaluation after the run's last step writes
HOLD_DIR/rank<N> and waits there, up to 60 s, until its stop request has a signal; then evaluates.
So a test signals the launcher while every rank is inside the final evaluation, whatever the
machine's speed."""

import os
import sys
import time
from pathlib import Path

from vitscale import loop
from vitscale.cli import main

real = loop.Trainer.evaluate


def held(self):
    if self.step == self.total_steps:
        hold = Path(os.environ["HOLD_DIR"])
        (hold / f"rank{self.strategy.rank}").write_text(str(self.step))
        deadline = time.time() + 60
        while self.agreement.stop.signal is None and time.time() < deadline:
            time.sleep(0.05)
    return real(self)


loop.Trainer.evaluate = held
sys.exit(main(sys.argv[1:]))
