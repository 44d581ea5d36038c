"""Image classification: cross entropy on (images, labels); accuracy over the test set."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..data import build_data, synthetic_stand_in
from ..data import geometry as data_geometry
from ..data.build import eval_preprocess
from ..errors import ConfigError, UserError
from ..models import VisionTransformer, ViTSpec, resolve_spec, set_drop_path_mode, vit_forward_flops
from ..optim import block_index
from ..precision import fp8_slower
from .base import Task, padding_forwards
from .patch_dropout import PatchDropout


def freeze(model: nn.Module, what: str, blocks: int = 0) -> None:
    """model.freeze: "embed" = patch/position embeddings and class token (and the first `blocks`
    blocks); "backbone" = everything but the head (linear probing); "none"."""
    if what == "none":
        return
    for name, p in model.named_parameters():
        if what == "backbone":
            frozen = not name.startswith("head.")
        else:
            block = block_index(name)
            frozen = name.startswith(("patch_embed.", "cls_token", "pos_embed")) or (
                block is not None and block < blocks
            )
        if frozen:
            p.requires_grad_(False)


# model.init_arch given where it means nothing (no model.init, or a CLIP model.arch)
INIT_ARCH_MISPLACED = (
    "config: model.init_arch names the timm architecture of ViT classifier weights given "
    "with model.init (a ViT model.arch)"
)


def init_open_clip_misplaced(m) -> ConfigError:
    """model.init_open_clip given where it means nothing (`m`: the model config)."""
    return ConfigError(
        "config: model.init_open_clip describes CLIP weights given with model.init "
        f"(model.arch={m.arch}{'' if m.init else ', no model.init'})"
    )


def spec_from_init(m, image_size: int, channels: int, num_classes: int) -> tuple[ViTSpec, dict]:
    """model.init's weights (`m`: the model config): the architecture from the weights, the
    geometry from the data; (the spec, the weights adapted to it)."""
    from ..interop.finetune import init_arch, init_weights

    return init_weights(
        m.init,
        image_size=image_size,
        in_chans=channels,
        num_classes=num_classes,
        heads=m.heads,
        head_policy=m.init_head,
        arch=init_arch(m.init, m.init_arch),
        which=m.init_weights,
        attention=m.attention,
        drop_path=m.drop_path,
        dropout=m.dropout,
    )


def blocks_of(m) -> dict:
    """The ViTSpec block keys a recipe names (model.norm, mlp, qk_norm, layer_scale, reg_tokens,
    rope, parallel, pos_embed); the defaults are the 2021 ViT. A rope keeps the class and register tokens
    unrotated; model.head=map pools the patch tokens."""
    return dict(
        norm=m.norm,
        mlp=m.mlp,
        act="silu" if m.mlp != "mlp" else "gelu",
        qk_norm=m.qk_norm,
        layer_scale=m.layer_scale,
        reg_tokens=m.reg_tokens,
        rope="" if m.rope == "none" else m.rope,
        parallel="" if m.parallel == "none" else m.parallel,
        pos_embed=m.pos_embed,
    )


def spec_from_arch(m, image_size: int, channels: int, num_classes: int) -> ViTSpec:
    """model.arch with the model keys over its defaults; one-line refusals of shapes that do not
    fit (the patch grid, the conv stem's power of two, the heads)."""
    try:
        spec = resolve_spec(
            m.arch,
            image_size=image_size,
            in_chans=channels,
            num_classes=num_classes,
            patch_size=m.patch_size,
            dim=m.dim,
            depth=m.depth,
            heads=m.heads,
            mlp_ratio=m.mlp_ratio,
            head=m.head,
            attention=m.attention,
            stem=m.stem,
            drop_path=m.drop_path,
            dropout=m.dropout,
        )
    except KeyError as e:
        raise ConfigError(f"config: model.arch: {e.args[0]}") from None
    spec = replace(spec, **blocks_of(m))
    if spec.image_size % spec.patch_size:
        raise ConfigError(
            f"config: image size {spec.image_size} is not divisible by patch size "
            f"{spec.patch_size} (set data.image_size or model.patch_size)"
        )
    if spec.stem == "conv" and (spec.patch_size & (spec.patch_size - 1) or spec.patch_size < 2):
        raise ConfigError(
            f"config: model.stem=conv needs a power-of-two patch size >= 2, got {spec.patch_size}"
        )
    if spec.dim % spec.heads:
        raise ConfigError(f"config: model dim {spec.dim} is not divisible by heads {spec.heads}")
    return spec


class ClassificationTask(Task):
    kind, metric, sample, samples = "vit", "test_accuracy", "img", "images"
    exports = {"timm": "ViT classifiers"}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.label_smoothing = cfg.train.label_smoothing
        self.hflip_tta = cfg.train.eval_hflip_tta
        self.num_classes = cfg.model.num_classes
        self.patch_dropout = PatchDropout(
            cfg.model, cfg.train.epochs, announce=cfg.run.progress != "off"
        )

    # -- building ---------------------------------------------------------------------------------
    def check(self) -> None:
        """model.init_arch must name a timm architecture (and pretrained tag) that exists."""
        m = self.cfg.model
        if m.init_arch:
            if not m.init:
                raise ConfigError(INIT_ARCH_MISPLACED)
            from ..interop.timm.vision_transformer import arch_entry, arch_pretrained_cfg

            try:
                arch_entry(m.init_arch)
                arch_pretrained_cfg(m.init_arch)
            except UserError as e:
                raise ConfigError(f"config: {e}") from None
        if m.init_open_clip:
            raise init_open_clip_misplaced(m)
        if m.init:  # the weights carry their blocks: a block key would be another model
            named = [k for k, v in blocks_of(m).items() if v != blocks_of(ModelConfig())[k]]
            if named:
                raise ConfigError(
                    f"config: model.{named[0]} with model.init: the weights carry their own "
                    "blocks (read from them and their config.json); leave it at its default"
                )
        if self.cfg.train.fp8 != "none":  # refused where measured slower, before anything is built
            refusal = fp8_slower(self.cfg.train.fp8, resolve_spec(m.arch, dim=m.dim).dim)
            if refusal:
                raise ConfigError(refusal)

    def build_data(self, s):
        cfg = self.cfg
        dcfg = self.data_config()
        data = build_data(
            dcfg, device=s.device, seed=cfg.run.seed, rank=s.dp_rank, world_size=s.dp_size
        )
        self.preprocess = eval_preprocess(dcfg, data.mean, data.std, data.image_size)
        if cfg.model.num_classes and cfg.model.num_classes != data.num_classes:
            raise ConfigError(
                f"config: model.num_classes={cfg.model.num_classes} but the dataset has "
                f"{data.num_classes} classes (set 0 to follow the data)"
            )
        self.num_classes = data.num_classes
        return data

    def data_config(self):
        """data.normalize=auto with model.init: the normalization the weights were trained with."""
        cfg = self.cfg
        if cfg.model.init and cfg.data.normalize == "auto":
            from ..interop.finetune import init_arch, weights_normalization

            arch = init_arch(cfg.model.init, cfg.model.init_arch)
            return replace(cfg.data, normalize=weights_normalization(cfg.model.init, arch))
        return cfg.data

    def geometry(self) -> tuple[int, int, int]:
        """(image size, channels, classes): the data's (data/build.py), model.num_classes first."""
        return data_geometry(self.cfg.data, self.cfg.model.num_classes)

    def build_spec(self, image_size: int, channels: int, num_classes: int) -> ViTSpec:
        """The run's ViT: from model.init's weights (kept for build_model), or from model.arch
        and the model keys; the geometry from the run's data."""
        m = self.cfg.model
        if m.init:
            spec, self.init_state = spec_from_init(m, image_size, channels, num_classes)
            return spec
        return spec_from_arch(m, image_size, channels, num_classes)

    def spec_from_dict(self, d: dict) -> ViTSpec:
        return ViTSpec(**d)

    init_state: dict | None = None  # adapted weights of model.init (build_spec reads them)

    def export(self, fmt, model, preprocess, out, meta, run_dir):
        """timm's hub folder layout: the weights (model.safetensors when `out` is a folder) and, beside
        them, config.json: the architecture and model_args that rebuild the trained function, and the
        run's input size, mean/std, interpolation and crop as its pretrained config."""
        import json

        from ..checkpoint import export_safetensors
        from ..interop.timm.vision_transformer import hub_config_path, timm_hub_config, to_timm

        if out.is_dir() or not out.suffix:
            out = out / "model.safetensors"
        hub = timm_hub_config(
            model.spec,
            mean=preprocess["mean"],
            std=preprocess["std"],
            interpolation=preprocess["interpolation"],
            crop_pct=preprocess["crop_pct"],
        )
        meta["timm_config"] = json.dumps(hub)
        path = export_safetensors(to_timm(model), out, meta)
        hub_config_path(path).write_text(json.dumps(hub, indent=2) + "\n")
        return path

    def build_model(self, spec: ViTSpec) -> nn.Module:
        model = VisionTransformer(spec)
        if self.init_state is not None:
            missing, unexpected = model.load_state_dict(self.init_state, strict=False)
            assert not unexpected and set(missing) <= {"head.weight", "head.bias"}, (
                missing,
                unexpected,
            )
        freeze(model, self.cfg.model.freeze, self.cfg.model.freeze_blocks)
        return self.patch_dropout.build(set_drop_path_mode(model, self.cfg.model.drop_path_mode))

    def flops(self, spec: ViTSpec) -> int:
        """One image's forward; with model.patch_dropout, a training one (the kept tokens, averaged
        over the masked and unmasked epochs)."""
        pd = self.patch_dropout
        if not pd.p:
            return vit_forward_flops(spec)
        return pd.flops(vit_forward_flops(spec), vit_forward_flops(spec, pd.p))

    def describe(self, spec: ViTSpec) -> str:
        return (
            f"{spec.depth}x{spec.dim} ViT, {spec.num_tokens} tokens"
            + self.patch_dropout.describe(spec.num_patches, spec.num_prefix_tokens)
        )

    def set_epoch(self, epoch: int) -> None:
        self.patch_dropout.set_epoch(epoch)

    def info_extra(self, spec, model) -> dict:
        return {"tokens": spec.num_tokens}

    @staticmethod
    def info_line(info: dict) -> str:
        g = lambda n: f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"  # noqa: E731
        return (
            f"{info['arch']}: {info['params'] / 1e6:.2f}M parameters, {info['tokens']} tokens, "
            f"{g(info['macs_per_image'])}MACs = {g(info['flops_per_image'])}FLOPs per image "
            f"forward, {g(info['train_flops_per_image'])}FLOPs per image training "
            f"({info['image_size']}px, patch {info['patch_size']}, dim {info['dim']}, depth {info['depth']}, "
            f"heads {info['heads']}, {info['num_classes']} classes, head={info['head']})"
        )

    def synthetic_overrides(self) -> dict | None:
        return synthetic_stand_in(self.cfg.data, self.cfg.model.num_classes)

    @staticmethod
    def describe_metrics(r: dict) -> str:
        pct = lambda k: f"{100 * r[k]:.2f}%"  # noqa: E731
        best = f" (best {pct('best_test_accuracy')})" if "best_test_accuracy" in r else ""
        split = (
            "validation (data.val_fraction of the training set)"
            if r.get("eval_split") == "val"
            else "test"
        )
        return f"{split} accuracy {pct('test_accuracy')}{best} on {r['test_count']} images (loss {r['test_loss']:.4f})"

    # -- the training step ------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross entropy in fp32; y = class indices [B] or soft targets [B, K] (mixup/cutmix)."""
        logits = logits.float()
        if y.ndim == 2 and self.label_smoothing:
            y = y * (1 - self.label_smoothing) + self.label_smoothing / self.num_classes
            return F.cross_entropy(logits, y)
        return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)

    def forward_loss(self, model, batch, prepare) -> torch.Tensor:
        x, y = batch
        return self.loss(model(prepare(x)), y)

    # -- evaluation -------------------------------------------------------------------------------
    def evaluate_all(self, s, data) -> dict:
        """Accuracy and loss over the whole test set: each rank evaluates its disjoint shard (with
        the same number of forwards where forwards are collective); the counts are summed exactly."""
        batches = max(s.gather_objects(len(data.test))) if s.forward_is_collective else 0
        r = self.evaluate(s.eval_module(), data.test, s.autocast, s.prepare, batches)
        correct, count, loss_sum = s.all_reduce_dp(
            torch.tensor(
                [r["correct"], r["count"], r["loss_sum"]], dtype=torch.float64, device=s.device
            )
        ).tolist()
        return {
            "test_accuracy": correct / max(1, count),
            "test_loss": loss_sum / max(1, count),
            "test_count": int(count),
        }

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, loader, autocast, prepare=lambda x: x, batches: int = 0
    ) -> dict:
        """Sums over this process's shard: {'correct', 'count', 'loss_sum'} (exact, no averaging;
        summed on the device, read once at the end).
        `batches`: run at least this many forward passes (sharded models need every rank in every
        forward): past the end of the shard, forwards of one sample whose outputs are dropped
        (never an empty batch: flash attention on older torch refuses a batch of 0)."""
        was_training = model.training
        model.eval()

        def logits_of(x):
            with autocast():
                logits = model(x).float()
                return logits + model(x.flip(-1)).float() if self.hflip_tta else logits

        sums, count, n = None, 0, 0
        for n, (x, y) in enumerate(loader.iterate(), 1):  # noqa: B007 - n is read after the loop
            logits = logits_of(prepare(x))
            part = torch.stack(
                [
                    (logits.argmax(-1) == y).sum().double(),
                    F.cross_entropy(
                        logits if not self.hflip_tta else logits / 2, y, reduction="sum"
                    ).double(),
                ]
            )
            sums = part if sums is None else sums + part
            count += y.numel()
        padding_forwards(loader, None, batches - n, lambda b: logits_of(prepare(b[0])))
        model.train(was_training)
        correct, loss_sum = sums.tolist() if sums is not None else (0, 0.0)
        return {"correct": int(correct), "count": count, "loss_sum": loss_sum}
