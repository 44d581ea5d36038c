"""The CLIP task: contrastive loss on (image, caption, index) batches; retrieval and zero-shot
evaluation (clip_eval.py). It knows nothing about engines: it gets the model to call and the
strategy's verbs.
"""

from __future__ import annotations

import sys
from dataclasses import fields, replace

import torch

from ..data import build_image_text
from ..data.build import eval_preprocess, synthetic_pairs_stand_in
from ..data.tokenizer import get_tokenizer
from ..errors import ConfigError, UserError
from ..losses import (
    ClipLoss,
    FastClipLoss,
    StepLogs,
    build_clip_loss,
    logit_init,
    logit_init_note,
    resolve_clip,
)
from ..models import (
    CLIP,
    ClipSpec,
    TextSpec,
    ViTSpec,
    clip_forward_flops,
    count_params,
    resolve_clip_spec,
    set_drop_path_mode,
)
from ..optim import schedule
from .base import Task
from .clip_eval import evaluate_clip
from .clip_step import ClipStep
from .patch_dropout import PatchDropout, is_main


def check_init_options(m) -> None:
    """model.init (`m`: the model config) must be OpenCLIP CLIP weights a CLIP model can start
    from (interop/open_clip/convert.py's check_init reads their configuration and keys only)."""
    from .classification import INIT_ARCH_MISPLACED, init_open_clip_misplaced

    if m.init_arch:
        raise ConfigError(INIT_ARCH_MISPLACED)
    if not m.init:
        if m.init_open_clip:
            raise init_open_clip_misplaced(m)
        return
    from ..interop.open_clip.convert import check_init

    try:  # the file's configuration and keys: the real cause, in one line
        check_init(m.init, m.init_open_clip)
    except UserError as e:
        raise ConfigError(f"config: {e}") from None


def spec_from_init(cfg, image_size: int, channels: int) -> tuple[ClipSpec, dict]:
    """An OpenCLIP ViT CLIP file (model.init): the architecture from the weights and their OpenCLIP
    configuration (model.init_open_clip, or the open_clip_config.json beside them), the geometry
    from the run; (the spec, the weights adapted to it)."""
    from ..data.tokenizer import VOCAB_SIZE
    from ..interop.open_clip.convert import init_weights

    m = cfg.model
    spec, state = init_weights(
        m.init,
        image_size=image_size,
        in_chans=channels,
        context_length=m.context_length,
        vocab_size=VOCAB_SIZE,
        vision_heads=m.heads,
        text_heads=m.text_heads,
        attention=m.attention,
        drop_path=m.drop_path,
        dropout=m.dropout,
        open_clip=m.init_open_clip,
        quick_gelu=None if m.init_act == "auto" else m.init_act == "quick_gelu",
    )
    # logit_scale itself comes from the file (logit_bias too where it holds one: build_model)
    return with_logit_init(spec, cfg.clip), state


def with_logit_init(spec: ClipSpec, cfg_clip) -> ClipSpec:
    """The spec's logit parameters for the configured loss (losses.logit_init): OpenCLIP's
    logit_scale starts at 1 / init_tau (unused by FastCLIP); clip.loss=siglip adds logit_bias."""
    tau, bias = logit_init(cfg_clip)
    return replace(spec, init_tau=tau, logit_bias=bias)


def spec_from_arch(cfg, image_size: int, channels: int) -> ClipSpec:
    """model.arch with the model keys over its defaults; one-line refusals of shapes that do not
    divide."""
    m = cfg.model
    try:
        spec = resolve_clip_spec(
            m.arch,
            embed_dim=m.embed_dim,
            vision=dict(
                image_size=image_size,
                in_chans=channels,
                patch_size=m.patch_size,
                dim=m.dim,
                depth=m.depth,
                heads=m.heads,
                mlp_ratio=m.mlp_ratio,
                attention=m.attention,
                stem=m.stem,
                drop_path=m.drop_path,
                dropout=m.dropout,
            ),
            text=dict(
                dim=m.text_dim,
                depth=m.text_depth,
                heads=m.text_heads,
                attention=m.attention,
                context_length=m.context_length,
            ),
        )
    except KeyError as e:
        raise ConfigError(f"config: model.arch: {e.args[0]}") from None
    spec = with_logit_init(spec, cfg.clip)
    v, t = spec.vision, spec.text
    if v.image_size % v.patch_size:
        raise ConfigError(
            f"config: image size {v.image_size} is not divisible by patch size {v.patch_size} "
            f"(set data.image_size or model.patch_size)"
        )
    for what, d, h in (("model", v.dim, v.heads), ("model text", t.dim, t.heads)):
        if d % h:
            raise ConfigError(f"config: {what} dim {d} is not divisible by heads {h}")
    return spec


class ClipTask(Task):
    kind, sample, samples, pairs = "clip", "pair", "pairs", True
    exports = {"open_clip": "CLIP models"}
    metric = "retrieval_r1"  # mean of image->text and text->image recall@1 on the held-out pairs
    # train.capture=step takes CLIP's step (tasks/clip_step.py); auto leaves it until it is timed
    capture_not_auto = (
        "CLIP's captured step is not measured on a GPU yet (train.capture=step takes it)"
    )

    def __init__(self, cfg):
        super().__init__(cfg)
        self.loss_module: ClipLoss | FastClipLoss | None = None  # setup_training's (eval: none)
        self.step: ClipStep | None = None  # the training forward (compiled or not), with the loss
        self.context_length = cfg.model.context_length
        self.prompt_templates = cfg.clip.prompt_templates
        self.last_logs: dict | StepLogs = {}
        self.patch_dropout = PatchDropout(
            cfg.model, cfg.train.epochs, announce=cfg.run.progress != "off"
        )

    # -- building ---------------------------------------------------------------------------------
    def check(self) -> None:
        """model.init's options and file; a whole batch per step; the [clip] keys' own refusals
        (resolve_clip: e.g. clip.tau_init below the temperature clamp)."""
        cfg = self.cfg
        check_init_options(cfg.model)
        if cfg.train.accum_steps > 1:
            raise ConfigError(
                "config: train.accum_steps > 1 is not supported for CLIP: contrastive losses "
                "need the whole batch at once (lower data.batch_size or add processes)"
            )
        resolve_clip(cfg.clip, lr=cfg.optim.lr, epochs=cfg.train.epochs)

    def build_data(self, s):
        cfg = self.cfg
        get_tokenizer()  # the vocabulary, read here: a missing file is one line before anything starts
        data = build_image_text(
            cfg.data,
            device=s.device,
            seed=cfg.run.seed,
            rank=s.dp_rank,
            world_size=s.dp_size,
            context_length=cfg.model.context_length,
        )
        self.preprocess = eval_preprocess(cfg.data, data.mean, data.std, data.image_size)
        return data

    def geometry(self) -> tuple[int, int, int]:
        from .classification import (
            ClassificationTask,  # the image side is the same as a classifier's
        )

        size, channels, _ = ClassificationTask(self.cfg).geometry()
        return size, channels, 0

    def synthetic_overrides(self) -> dict | None:
        """--synthetic for an image-text recipe: synthetic images of its geometry captioned from their
        labels (data/build.py), so that `vitscale bench configs/clip_vit_b16.toml --synthetic` needs
        no shards."""
        return synthetic_pairs_stand_in(self.cfg.data)

    init_state: dict | None = (
        None  # model.init's weights, adapted to the run (build_spec reads them)
    )

    def build_spec(self, image_size: int, channels: int, num_classes: int = 0) -> ClipSpec:
        """The run's CLIP: from model.init's OpenCLIP weights (kept for build_model), or from
        model.arch and the model keys; the geometry from the run's data."""
        if self.cfg.model.init:
            spec, self.init_state = spec_from_init(self.cfg, image_size, channels)
            return spec
        return spec_from_arch(self.cfg, image_size, channels)

    def spec_from_dict(self, d: dict) -> ClipSpec:
        """Checkpoints from before the OpenCLIP options (ln_pre, ...) lack them: the defaults."""
        rest = {
            f.name: d[f.name]
            for f in fields(ClipSpec)
            if f.name not in ("vision", "text") and f.name in d
        }
        return ClipSpec(vision=ViTSpec(**d["vision"]), text=TextSpec(**d["text"]), **rest)

    def image_size(self, spec: ClipSpec) -> int:
        return spec.vision.image_size

    def export(self, fmt, model, preprocess, out, meta, run_dir):
        """OpenCLIP's layout: the weights and open_clip_config.json (model and preprocess config) in a folder."""
        from ..interop.open_clip.convert import export_run

        return export_run(model, out, meta, run_dir, preprocess)

    def build_model(self, spec: ClipSpec):
        model = CLIP(spec)
        if self.init_state is not None:
            state = self.init_state
            if spec.logit_bias is not None and "logit_bias" not in state:  # SigLIP's init
                state = {**state, "logit_bias": model.logit_bias.detach().clone()}
            model.load_state_dict(state, strict=True)
        return self.patch_dropout.build(set_drop_path_mode(model, self.cfg.model.drop_path_mode))

    def flops(self, spec: ClipSpec) -> int:
        """One (image, caption) pair's forward; with model.patch_dropout, a training one (the kept
        image tokens, averaged over the masked and unmasked epochs)."""
        pd = self.patch_dropout
        if not pd.p:
            return clip_forward_flops(spec)
        return pd.flops(clip_forward_flops(spec), clip_forward_flops(spec, patch_dropout=pd.p))

    def describe(self, spec: ClipSpec) -> str:
        v, t = spec.vision, spec.text
        return (
            f"CLIP (image {v.depth}x{v.dim} ViT, {v.num_tokens} tokens; text {t.depth}x{t.dim}, "
            f"{t.context_length} tokens; embedding {spec.embed_dim})"
        ) + self.patch_dropout.describe(v.num_patches, v.num_prefix_tokens)

    def info_extra(self, spec, model) -> dict:
        params, vision = count_params(model), count_params(model.visual)
        logit = 1 if spec.logit_bias is None else 2  # logit_scale (and SigLIP's logit_bias)
        return {
            "vision_params": vision,
            "text_params": params - vision - logit,
            "tokens": spec.vision.num_tokens,
            "context_length": spec.text.context_length,
        }

    @staticmethod
    def info_line(info: dict) -> str:
        g = lambda n: f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"  # noqa: E731
        v, t = info["vision"], info["text"]
        return (
            f"{info['arch']}: {info['params'] / 1e6:.2f}M parameters (image {info['vision_params'] / 1e6:.2f}M, "
            f"text {info['text_params'] / 1e6:.2f}M), embedding {info['embed_dim']}; image {v['image_size']}px "
            f"patch {v['patch_size']} dim {v['dim']} depth {v['depth']} ({info['tokens']} tokens); text dim "
            f"{t['dim']} depth {t['depth']} heads {t['heads']}, {t['context_length']} tokens; "
            f"{g(info['flops_per_image'])}FLOPs per (image, caption) forward"
        )

    def setup_training(
        self, *, lr, dataset_size, total_steps, steps_per_epoch, device, group=None, lr_factor=None
    ) -> None:
        cfg = self.cfg
        note = logit_init_note(cfg.clip)
        if note and cfg.run.progress != "off" and is_main():
            print(note, file=sys.stderr, flush=True)
        self.loss_module = build_clip_loss(
            cfg.clip,
            cfg.optim,
            lr=lr,
            dataset_size=dataset_size,
            epochs=cfg.train.epochs,
            device=device,
            # v0's temperature on the run's own schedule (its clock), else the recipe's steps
            lr_factor=lr_factor or schedule(cfg.optim, total_steps, steps_per_epoch),
            group=group,  # the data-parallel ranks (a mesh dimension under tensor parallelism)
            total_steps=total_steps,
        )
        self.step = ClipStep(self.loss_module, cfg.train, group)

    def summary_extra(self, lr: float) -> dict:
        return {"clip": resolve_clip(self.cfg.clip, lr=lr, epochs=self.cfg.train.epochs)}

    def describe_eval(self, ev: dict, best) -> str:
        zs = [
            f"{k[len('zeroshot_') : -len('_top1')]} zero-shot {100 * v:.2f}%"
            for k, v in ev.items()
            if k.startswith("zeroshot_") and k.endswith("_top1")
        ]
        return ", ".join([super().describe_eval(ev, best)] + zs)

    @staticmethod
    def describe_metrics(r: dict) -> str:
        pct = lambda k: f"{100 * r[k]:.2f}%"  # noqa: E731
        parts = []
        if "test_i2t_r1" in r:
            parts.append(
                f"held-out retrieval ({r['test_pairs']} pairs) image->text R@1 {pct('test_i2t_r1')} "
                f"R@5 {pct('test_i2t_r5')}, text->image R@1 {pct('test_t2i_r1')} R@5 {pct('test_t2i_r5')}"
            )
        parts += [
            f"{k[len('zeroshot_') : -len('_top1')]} zero-shot top-1 {pct(k)}"
            for k in r
            if k.startswith("zeroshot_") and k.endswith("_top1")
        ]
        return "; ".join(parts) or "no held-out data"

    # -- training ---------------------------------------------------------------------------------
    @property
    def contrastive(self) -> ClipLoss | FastClipLoss:
        """The loss setup_training built (an error before it: evaluation builds none)."""
        if self.loss_module is None:
            raise RuntimeError("clip task: setup_training() builds the loss; not called yet")
        return self.loss_module

    def forward_loss(self, model, batch, prepare) -> torch.Tensor:
        """Both towers and the loss (tasks/clip_step.py: compiled whole with train.compile in one
        process); the loss's state updates are inside."""
        images, tokens, index = batch
        if self.step is None:  # a loss set without setup_training (tests): built once
            self.step = ClipStep(self.contrastive, self.cfg.train)
        step = self.step
        loss, self.last_logs = step(model, prepare(images), tokens, index)
        return loss

    def set_epoch(self, epoch: int) -> None:
        self.contrastive.set_epoch(epoch)
        self.patch_dropout.set_epoch(epoch)

    def after_step(self, step: int | torch.Tensor | None = None) -> None:
        """The temperatures' step; `step` a device counter under train.capture=step."""
        self.contrastive.after_step(step)

    def logs(self) -> dict:
        """The last step's loss logs, and the loss's own collectives per step since the last call
        (elements sent per worker: features, and per-sample scalars for the global losses)."""
        logs = self.last_logs
        out = logs.read() if isinstance(logs, StepLogs) else dict(logs)
        comm = dict(getattr(self.loss_module, "comm_elements", {}))
        last, self._comm_seen = getattr(self, "_comm_seen", {}), comm
        steps = comm.get("steps", 0) - last.get("steps", 0)
        if steps and (comm.get("features") or comm.get("scalars")):
            for k in ("features", "scalars"):
                out[f"loss_comm_{k}_per_step"] = (comm[k] - last.get(k, 0)) / steps
        return out

    def state_dict(self) -> dict:
        return self.contrastive.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.contrastive.load_state_dict(sd)

    def state_bytes(self) -> int:
        return self.contrastive.state_bytes()

    # -- evaluation (clip_eval.py) ---------------------------------------------------------------
    def evaluate_all(self, s, data) -> dict:
        """Metrics over the whole held-out set and every zero-shot set (all ranks get them)."""
        return evaluate_clip(s, data, self.prompt_templates, self.context_length)
