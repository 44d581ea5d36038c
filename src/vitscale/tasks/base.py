"""What every kind of model provides to the trainer, `vitscale eval / info / export` and the lab.

A task is built from the config alone (`tasks.build_task(cfg)`); it then builds its data, its
model spec and model, and, for training, its loss (`setup_training`). The trainer only calls the
verbs below and never asks which task it runs. Classification (tasks/classification.py) and
CLIP (tasks/clip.py) are the two implementations; a third kind (fine-tuning, distillation, MAE)
is a new subclass registered in tasks/__init__.py.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from torch import nn

from ..config import Config
from ..data.build import dataset_normalization, eval_preprocess
from ..errors import DataError
from ..models import count_params
from ..optim import optimizer_split


@torch.no_grad()
def padding_forwards(loader, first: tuple | None, n: int, forward) -> None:
    """`n` calls of `forward(batch)` on a one-sample batch of this rank's shard (`first`: a batch
    already read, else the shard's first), outputs dropped: a rank whose evaluation shard ended keeps
    the collective forwards of the others (FSDP2, ZeRO-3) company, never with an empty batch (flash
    attention on older torch refuses a batch of 0)."""
    if n <= 0:
        return
    first = first if first is not None else next(iter(loader.iterate()), None)
    if first is None:
        raise DataError(
            "the test set is too small to give every process a batch (use fewer processes "
            "or a larger test split)"
        )
    one = tuple(t[:1] for t in first)
    for _ in range(n):
        forward(one)


class Task:
    kind: str = ""  # saved in checkpoints ("vit", "clip"): picks the task that reads them back
    metric: str = ""  # the metric whose best value a run keeps
    sample: str = "img"  # one training sample, in log lines ("img", "pair")
    samples: str = "images"
    pairs: bool = False  # its data are image-text pairs (data/build.py's build_image_text)
    exports: dict = {}  # `vitscale export --format` -> the models its layout is for ("ViT classifiers")
    preprocess: dict | None = (
        None  # how the test images reached the model (build_data); checkpoints keep it
    )
    # why its training step cannot be replayed as one captured unit (train.capture=step); "" = it can
    uncapturable: str = ""
    # why train.capture=auto leaves a step that capture=step takes uncaptured; "" = auto takes it
    capture_not_auto: str = ""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # -- building ---------------------------------------------------------------------------------
    def check(self) -> None:
        """The config's checks that depend on the kind of model (its model.init options and files),
        before anything is built: a one-line "config: ..." ConfigError (tasks.check_config calls it)."""

    def build_data(self, strategy):
        """This rank's data bundle (train / test loaders, sizes, image geometry)."""
        raise NotImplementedError

    def data_config(self):
        """The data config the task builds its data from."""
        return self.cfg.data

    def run_preprocess(
        self, spec: dict, recorded: dict | None = None, task_state: dict | None = None
    ) -> dict:
        """How the test images of a checkpoint's run reached its model (mean/std, size, resize,
        interpolation, crop), from what the checkpoint holds (state.SavedRun: its `spec`, its
        preprocessing record, its task state): the run's own record, `recorded`, where there is
        one; else (checkpoints from before the record; classification runs kept their mean and
        std in their task state, under normalization) derived from its config as build_data did
        (data/build.py), for a model of `spec`."""
        if recorded:
            return recorded
        d = self.data_config()
        old = (task_state or {}).get("normalization")
        mean, std = (
            (old["mean"], old["std"])
            if old
            else dataset_normalization(d, self.cfg.run.seed, self.pairs)
        )
        return eval_preprocess(d, mean, std, self.image_size(self.spec_from_dict(spec)))

    def export(self, fmt: str, model, preprocess: dict, out, meta: dict, run_dir):
        """`vitscale export --format fmt` (one of `exports`) of a rebuilt model: the written path."""
        raise NotImplementedError

    def geometry(self) -> tuple[int, int, int]:
        """(image size, channels, classes) the model will see, without loading the data."""
        raise NotImplementedError

    def build_spec(self, image_size: int, channels: int, num_classes: int):
        """The model's spec from the config and the data's geometry (ConfigError if it cannot be built)."""
        raise NotImplementedError

    def spec_for(self, data):
        """The model's spec for a built data bundle."""
        return self.build_spec(data.image_size, data.channels, getattr(data, "num_classes", 0))

    def spec_from_dict(self, d: dict):
        """The spec saved in a checkpoint (`asdict(spec)`) as a spec again."""
        raise NotImplementedError

    def image_size(self, spec) -> int:
        """The side of the images a model of `spec` takes."""
        return spec.image_size

    def build_model(self, spec) -> nn.Module:
        raise NotImplementedError

    def flops(self, spec) -> int:
        """Forward FLOPs per training sample (training = 3x)."""
        raise NotImplementedError

    def describe(self, spec) -> str:
        """The model in a few words, for the run's first log line."""
        raise NotImplementedError

    def meta_model(self):
        """(spec, model) of the recipe's model on the meta device: structure and parameter
        counts without memory or initialization."""
        spec = self.build_spec(*self.geometry())
        # model.init's weights (build_spec read them): a meta model holds no values to copy them into
        # (torch would warn once per tensor), and its structure and counts do not depend on them
        state, self.init_state = getattr(self, "init_state", None), None
        try:
            with torch.device("meta"):
                return spec, self.build_model(spec)
        finally:
            self.init_state = state

    def arch_label(self) -> str:
        """What `vitscale info` calls the model: model.arch, or where model.init's architecture came
        from (the name given or the file itself), since the weights decide it then."""
        m = self.cfg.model
        return f"{m.init_arch or m.init_open_clip or 'model.init'} ({m.init})" if m.init else m.arch

    def info(self) -> dict:
        """Parameters and FLOPs of the recipe's model (`vitscale info --json`)."""
        spec, model = self.meta_model()
        flops = self.flops(spec)
        return {
            "arch": self.arch_label(),
            "kind": self.kind,
            **asdict(spec),
            "params": count_params(model),
            "macs_per_image": flops // 2,
            "flops_per_image": flops,
            "train_flops_per_image": 3 * flops,
            **self.info_extra(spec, model),
            **optimizer_split(model, self.cfg.optim),
        }

    def info_extra(self, spec, model) -> dict:
        return {}

    @staticmethod
    def info_line(info: dict) -> str:
        """`vitscale info` without --json."""
        raise NotImplementedError

    def synthetic_overrides(self) -> dict | None:
        """Config overrides that swap the dataset for synthetic data of the same shape (the lab's
        `--synthetic`), or None where the task keeps its own data (one batch of it reused)."""
        return None

    def setup_training(
        self,
        *,
        lr: float,
        dataset_size: int,
        total_steps: int,
        steps_per_epoch: int,
        device: torch.device,
        group=None,
        lr_factor=None,
    ) -> None:
        """Build what training needs beyond the model (losses with their own state); `group`: the
        data-parallel ranks' process group (None: the world); `lr_factor(step)`: the run's
        schedule factor (its LambdaLR's, on its clock), which any other schedule follows."""

    # -- the training step ------------------------------------------------------------------------
    def forward_loss(self, model, batch, prepare) -> torch.Tensor:
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        pass

    def after_step(self, step: int | torch.Tensor | None = None) -> None:
        """After each optimizer step (per-sample state updates, temperature steps)."""

    def logs(self) -> dict:
        """Extra values for the train log record."""
        return {}

    def state_dict(self) -> dict:
        """The task's own state for checkpoints (FastCLIP's per-sample tables)."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def state_bytes(self) -> int:
        return 0

    def summary_extra(self, lr: float) -> dict:
        """Task settings for summary.json."""
        return {}

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate_all(self, strategy, data) -> dict:
        """The task's metrics over the whole test set (every rank gets the same numbers)."""
        raise NotImplementedError

    def describe_eval(self, ev: dict, best: float | None) -> str:
        m = self.metric
        return f"{m.replace('_', ' ')} {100 * ev.get(m, float('nan')):.2f}% (best {100 * (best or 0):.2f}%)"

    @staticmethod
    def describe_metrics(r: dict) -> str:
        """One line for a run's or a checkpoint's final metrics."""
        raise NotImplementedError
