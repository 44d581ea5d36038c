"""Typed configuration: TOML recipes + `--set section.key=value` overrides, validated.

Every section is a dataclass; a field's metadata may carry `choices` or `min`/`max`.
Errors are one line: an unknown key names the closest valid key, a bad value names
the key and what it accepts.
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import ConfigError, did_you_mean

RECIPES = Path(__file__).parent / "configs"
DEFAULT_RECIPE = RECIPES / "fashion_mnist.toml"


def choice(default, *choices, doc=""):
    return field(default=default, metadata={"choices": choices, "doc": doc})


def num(default, min=None, max=None, doc=""):
    return field(default=default, metadata={"min": min, "max": max, "doc": doc})


@dataclass
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"  # run folder = out_dir/name unless --out is given
    seed: int = num(0, min=0)
    device: str = choice("auto", "auto", "cpu", "cuda")
    threads: int = num(0, min=0, doc="torch intra-op threads; 0 = leave torch's default")
    log_every: int = num(50, min=1, doc="optimizer steps between metric lines")
    eval_every: int = num(1, min=0, doc="epochs between test-set evaluations (0 = end only)")
    checkpoint_every: int = num(
        0, min=0, doc="optimizer steps between checkpoints (0 = each epoch)"
    )
    keep_last: int = num(2, min=1)
    max_steps: int = num(0, min=0, doc="stop after this many optimizer steps (0 = all epochs)")
    progress: str = choice("auto", "auto", "bar", "plain", "off")
    tensorboard: bool = True


@dataclass
class DataConfig:
    name: str = choice(
        "fashion_mnist",
        "fashion_mnist",
        "cifar10",
        "cifar100",
        "folder",
        "synthetic",
        "openclipart",
        "csv",
        "webdataset",
        doc="openclipart/csv/webdataset are image-text pairs (CLIP models)",
    )
    root: str = ""  # "" = the dataset's default location
    test_root: str = field(
        default="",
        metadata={
            "doc": "image-text data: held-out CSV or shards "
            '("" = hold out data.test_fraction of root)'
        },
    )
    test_fraction: float = num(
        0.1,
        min=0.0,
        max=0.9,
        doc="image-text data: held-out share when "
        "there is no test_root (a fixed split by sample key)",
    )
    captions: bool = False  # classification data as image-text pairs for CLIP (caption_template)
    caption_template: str = "a photo of a {}."
    csv_image_key: str = "filepath"  # csv/tsv columns (OpenCLIP's defaults)
    csv_caption_key: str = "title"
    image_size: int = num(0, min=0, doc="0 = the dataset's native size")
    channels: int = num(3, min=1, max=4, doc="synthetic only")
    num_classes: int = num(10, min=2, doc="synthetic only")
    train_size: int = num(1024, min=1, doc="synthetic only")
    test_size: int = num(256, min=1, doc="synthetic only")
    batch_size: int = num(
        256,
        min=1,
        doc="global batch per optimizer step (data.batch_rule=min_steps: the largest one; naming "
        "it with --set sets the rule to fixed: a batch you name is never changed)",
    )
    batch_rule: str = choice(
        "fixed",
        "fixed",
        "min_steps",
        doc="min_steps = the batch follows the data (datafit.py): the largest of data.batch_size, "
        "its half, quarter, ... (not below data.min_batch_size) whose epochs give train.min_steps "
        "optimizer steps; where even that one gives fewer, train.epochs grows to train.min_steps; "
        "resolved once at the start, announced, saved as fixed in the run's config.toml",
    )
    min_batch_size: int = num(
        32, min=1, doc="data.batch_rule=min_steps: the smallest global batch it takes"
    )
    eval_batch_size: int = num(1024, min=1)
    num_workers: int = num(2, min=0, doc="decoding workers (folder, csv and webdataset data)")
    decoder: str = choice(
        "auto",
        "auto",
        "pil",
        "simplejpeg",
        doc="JPEG decoding (folder, csv, webdataset): "
        "pil = Pillow with draft mode; simplejpeg = libjpeg-turbo, scaled in the DCT domain "
        "to what the crop needs; auto = simplejpeg when installed",
    )
    reader: str = choice(
        "auto",
        "auto",
        "seek",
        "stream",
        doc="webdataset shards: seek = exact epochs by "
        "seeking in local uncompressed .tar files; stream = the webdataset library (local "
        "paths, brace patterns, pipe:, http(s)/s3 URLs, .tar.gz; shard order and a shuffle "
        "buffer per epoch and rank); auto = seek for local .tar files, stream otherwise",
    )
    val_fraction: float = num(
        0.0,
        min=0.0,
        max=0.5,
        doc="fashion_mnist, cifar10/100, synthetic: hold out this "
        "share of the TRAINING set (seeded by data.val_seed, stratified by class) and "
        "evaluate on it instead of the test set, which is then not read (0 = off: the "
        "test set); what `vitscale search` scores trials on",
    )
    val_seed: int = num(
        0,
        min=0,
        doc="the seed of the data.val_fraction split (not run.seed: every seed of a "
        "recipe sees the same split)",
    )
    shuffle_buffer: int = num(
        1000,
        min=0,
        doc="reader=stream: samples in each worker's shuffle buffer (0 = shard order only)",
    )
    on_device: bool = True  # keep small datasets whole on the training device
    normalize: str = choice(
        "auto",
        "auto",
        "dataset",
        "imagenet",
        "clip",
        doc="image mean/std: the "
        "dataset's own, ImageNet's or CLIP's; auto = the dataset's, or ImageNet's when "
        "model.init loads timm weights",
    )
    pin_memory: bool = field(
        default=True,
        metadata={
            "doc": "GPU runs: host batches go through pinned memory, copied without blocking"
        },
    )
    drop_last: bool = True
    # batched augmentation (train split only)
    crop_padding: int = num(0, min=0, doc="random crop after zero padding by this many pixels")
    hflip: bool = False
    randaugment_ops: int = num(0, min=0, max=4, doc="RandAugment-style ops per image (0 = off)")
    randaugment_magnitude: float = num(0.3, min=0.0, max=1.0)
    mixup_alpha: float = num(0.0, min=0.0)
    cutmix_alpha: float = num(0.0, min=0.0)
    mix_prob: float = num(1.0, min=0.0, max=1.0)


@dataclass
class ModelConfig:
    arch: str = "vit_tiny"  # registry name, see `vitscale.models.registry`
    init: str = field(
        default="",
        metadata={
            "doc": "start from these weights: a timm ViT state dict "
            "(.safetensors/.bin/.pt/.pth, with timm's config.json beside it when it came from the "
            "hub), a hub folder, or a `vitscale export` file; the architecture is read from them "
            "(arch/dim/depth/patch_size/head are then ignored), the image size, channels and "
            "classes come from the data"
        },
    )
    init_head: str = choice(
        "auto",
        "auto",
        "keep",
        "reset",
        doc="model.init: keep the weights' classifier "
        "(auto: when its class count matches the data's) or start a new one",
    )
    init_weights: str = choice(
        "auto",
        "auto",
        "raw",
        "ema",
        doc="model.init of a training checkpoint that holds "
        "the weights and their EMA (timm's state_dict and state_dict_ema): which to read; "
        "auto = the raw ones where both are there (timm's validate.py without --use-ema), "
        "the EMA ones where only they are; the choice is announced",
    )
    init_arch: str = field(
        default="",
        metadata={
            "doc": "model.init of timm ViT weights without timm's "
            "config.json beside them: their timm architecture name (e.g. vit_base_patch16_224, "
            "optionally with its pretrained tag, .augreg_in21k), which says what the weights do "
            'not hold (heads, activation, pooling, norms, mean/std); "" = the config.json, else '
            "timm's defaults, announced in a warning"
        },
    )
    init_act: str = choice(
        "auto",
        "auto",
        "gelu",
        "quick_gelu",
        doc="CLIP model.init: the MLP activation "
        "the weights were trained with (not stored in them): OpenAI's CLIP weights and "
        "OpenCLIP's -quickgelu models use QuickGELU; auto = the OpenCLIP configuration's "
        "(model.init_open_clip), else QuickGELU when the file name says quickgelu or openai",
    )
    init_open_clip: str = field(
        default="",
        metadata={
            "doc": "CLIP model.init: the OpenCLIP configuration of "
            "the weights (what they do not hold: head counts, activation, pooling, causal "
            "mask): an OpenCLIP model name (e.g. ViT-H-14, ViT-B-32-quickgelu) or an "
            'open_clip_config.json; "" = the open_clip_config.json beside the weights '
            "file, else OpenCLIP's defaults, announced in a warning"
        },
    )
    freeze: str = choice(
        "none",
        "none",
        "embed",
        "backbone",
        doc="parameters that do not train: embed = the "
        "patch and position embeddings (and model.freeze_blocks blocks); backbone = all but "
        "the head (linear probing)",
    )
    freeze_blocks: int = num(
        0, min=0, doc="with freeze=embed: also freeze the first N transformer blocks"
    )
    patch_size: int = num(0, min=0, doc="0 = the arch's default")
    dim: int = num(0, min=0, doc="0 = the arch's default")
    depth: int = num(0, min=0, doc="0 = the arch's default")
    heads: int = num(0, min=0, doc="0 = the arch's default")
    mlp_ratio: float = num(0.0, min=0.0, doc="0 = the arch's default")
    num_classes: int = num(0, min=0, doc="0 = the dataset's class count")
    head: str = choice(
        "token",
        "token",
        "pool",
        "map",
        doc="the image feature: token = the class token's; pool = the mean of the patch tokens; "
        "map = attention pooling, one learned query (SigLIP's MAP head)",
    )
    norm: str = choice(
        "layernorm", "layernorm", "rmsnorm", doc="every norm of the model (rmsnorm: no bias)"
    )
    mlp: str = choice(
        "mlp",
        "mlp",
        "swiglu",
        "swiglu_packed",
        doc="the blocks' MLP: mlp = fc1, act, fc2; swiglu = silu(fc1_g x) * fc1_x x, then fc2, "
        "with model.mlp_ratio's hidden width per branch; swiglu_packed = the same with one fc1 "
        "[gate; value] gating half of the hidden width (timm's SwiGLUPacked)",
    )
    qk_norm: bool = field(
        default=False, metadata={"doc": "a norm of each head's queries and keys (ViT-22B)"}
    )
    layer_scale: float = num(
        0.0,
        min=0.0,
        doc="per-channel scales of each residual branch, initialized to this value (CaiT, DINOv2: "
        "1e-5); 0 = none",
    )
    reg_tokens: int = num(0, min=0, doc="register tokens after the class token (DINOv2 reg4: 4)")
    rope: str = choice(
        "none",
        "none",
        "cat",
        "mixed",
        "dinov3",
        doc="a 2-D rotary position embedding of queries and keys, as timm's eva family: cat = "
        "EVA02's fixed axial bands; mixed = learned frequencies per block and head; dinov3 = "
        "DINOv3's (models/rope.py); the class and register tokens are not rotated",
    )
    parallel: str = choice(
        "none",
        "none",
        "branches",
        "fused",
        doc="parallel blocks: branches = two attention branches, then two MLP branches (Touvron "
        "et al. 2022); fused = one input projection for attention and MLP side by side (ViT-22B); "
        "none = attention, then MLP",
    )
    pos_embed: bool = field(
        default=True,
        metadata={
            "doc": "a learned absolute position embedding (false: none, as DINOv3 with rope)"
        },
    )
    attention: str = choice("sdpa", "sdpa", "explicit")
    stem: str = choice(
        "patch", "patch", "conv", doc="patch = ViT's stride-p conv; conv = 3x3 conv stages"
    )
    drop_path: float = num(0.0, min=0.0, max=1.0)
    drop_path_mode: str = choice(
        "mask",
        "mask",
        "skip",
        doc="stochastic depth: mask = every sample's branch "
        "computed, then zeroed with probability p (timm); skip = round(p x batch) rows "
        "dropped per block and step, their branch not computed (docs/performance.md)",
    )
    dropout: float = num(0.0, min=0.0, max=1.0)
    patch_dropout: float = num(
        0.0,
        min=0.0,
        max=1.0,
        doc="FLIP's patch dropout, as OpenCLIP's patch_dropout: the fraction of image patch "
        "tokens dropped per sample in training, in [0, 1) (the class token and at least one "
        "patch kept; evaluation sees all); 0 = off (docs/clip.md)",
    )
    patch_dropout_until: float = num(
        1.0,
        min=0.0,
        max=1.0,
        doc="the fraction of train.epochs trained with patch dropout; the epochs after it train "
        "on every token (FLIP's unmasked tail; switched at an epoch's start: an epoch that would "
        "end past the fraction is unmasked). 1 = the whole run",
    )
    # CLIP models (arch clip_*): the text tower and the shared embedding
    embed_dim: int = num(0, min=0, doc="CLIP: shared embedding size (0 = the arch's default)")
    text_dim: int = num(0, min=0, doc="CLIP: text transformer width (0 = the arch's default)")
    text_depth: int = num(0, min=0, doc="CLIP: text transformer layers (0 = the arch's default)")
    text_heads: int = num(0, min=0, doc="CLIP: text attention heads (0 = the arch's default)")
    context_length: int = num(77, min=2, doc="CLIP: tokens per caption (start and end included)")


@dataclass
class ClipConfig:
    loss: str = choice(
        "openclip",
        "openclip",
        "siglip",
        "fastclip_v0",
        "fastclip_v1",
        "fastclip_v2",
        "fastclip_v3",
        "sogclr",
        "isogclr",
        doc="openclip = mini-batch InfoNCE; siglip = SigLIP's pairwise sigmoid loss (a learned "
        "logit_bias beside logit_scale, OpenCLIP's SigLipLoss); the others are FastCLIP's global "
        "contrastive losses",
    )
    gamma_schedule: str = choice(
        "auto",
        "auto",
        "cosine",
        "constant",
        doc="inner-estimator gamma; auto = cosine for fastclip_*, constant for sogclr/isogclr",
    )
    gamma_min: float = num(
        -1.0,
        min=-1.0,
        max=1.0,
        doc="gamma after the decay (and the constant value); "
        "< 0 = the reference's: 0.2 for fastclip_*, 0.8 for sogclr/isogclr",
    )
    gamma_decay_epochs: float = num(
        0.0, min=0.0, doc="epochs of the cosine decay (0 = half of train.epochs)"
    )
    tau_init: float = num(
        0.0,
        min=0.0,
        max=1.0,
        doc="initial temperature (openclip: logit_scale = 1/tau); "
        "0 = the reference's: 0.03 for fastclip_v2/isogclr, 0.1 for siglip, else 0.07",
    )
    tau_lr: float = num(
        -1.0,
        min=-1.0,
        doc="learning rate of learnable temperatures; < 0 = the "
        "reference's: optim.lr (v0), 2e-4 (v3), 0.0133 (v2/isogclr)",
    )
    tau_lr_schedule: str = choice(
        "auto",
        "auto",
        "model",
        "threshold",
        "constant",
        doc="global tau lr: model = the model's lr schedule (v0's), threshold "
        "= divided by tau_lr_cut while tau <= 0.03 (v3's), constant",
    )
    tau_lr_cut: float = num(
        3.0, min=1.0, doc="threshold schedule: divide the tau lr by this while tau <= 0.03"
    )
    rho: float = num(
        -1.0,
        min=-1.0,
        doc="RGCL penalty (fastclip_v2/v3, isogclr); < 0 = the reference's: "
        "6.5 (v3), 7.0 (v2/isogclr)",
    )
    eps: float = num(1e-14, min=0.0, doc="log(eps + g) in the global losses")
    state_dtype: str = choice("fp32", "fp32", "bf16", doc="per-sample u / tau storage")
    shard_state: bool = field(
        default=False,
        metadata={
            "doc": "keep 1/K of the per-sample state on each "
            "of K ranks (by dataset index) instead of all of it on every rank"
        },
    )
    prompt_templates: str = choice(
        "default",
        "default",
        "single",
        doc="zero-shot prompts: the dataset's set or just 'a photo of a {}.'",
    )


@dataclass
class OptimConfig:
    name: str = choice(
        "adamw",
        "adamw",
        "sgd",
        "lamb",
        "muon",
        doc="muon = torch's Muon on the transformer blocks' 2-D weights (the optim.muon_* keys), "
        "AdamW (lr, weight_decay, betas, eps, impl) on the rest",
    )
    impl: str = choice("auto", "auto", "forloop", "foreach", "fused")
    lr: float = num(1e-3, min=0.0)
    weight_decay: float = num(0.05, min=0.0)
    beta1: float = num(0.9, min=0.0, max=1.0)
    beta2: float = num(0.999, min=0.0, max=1.0)
    eps: float = num(1e-8, min=0.0)
    momentum: float = num(0.9, min=0.0, max=1.0)
    nesterov: bool = False
    schedule: str = choice("cosine", "cosine", "linear", "constant")
    schedule_clock: str = choice(
        "steps",
        "steps",
        "time",
        doc="what the lr decay follows: steps = the "
        "optimizer step of train.epochs' steps; time = the training time spent of "
        "train.time_limit_s, so the schedule ends when the time budget ends (the "
        "warm-up stays in steps)",
    )
    warmup_epochs: float = num(0.0, min=0.0)
    warmup_steps: int = num(0, min=0, doc="overrides warmup_epochs when > 0")
    min_lr_ratio: float = num(0.0, min=0.0, max=1.0)
    grad_clip: float = num(0.0, min=0.0, doc="max global grad norm (0 = off)")
    lr_scaling: str = choice(
        "none",
        "none",
        "linear",
        "sqrt",
        doc="scale lr with data.batch_size / lr_ref_batch (keep warmup on)",
    )
    lr_ref_batch: int = num(256, min=1, doc="the global batch that optim.lr was tuned for")
    layer_decay: float = num(
        1.0,
        min=0.0,
        max=1.0,
        doc="layer-wise lr decay (BEiT/timm): block i of L gets "
        "lr x decay^(L + 1 - (i + 1)), the embeddings decay^(L + 1), the head lr; 1 = off",
    )
    muon_lr: float = num(
        0.0,
        min=0.0,
        doc="lr of Muon's group (0 = optim.lr; scaled with the batch as optim.lr is)",
    )
    muon_weight_decay: float = num(
        -1.0, min=-1.0, doc="decoupled weight decay of Muon's group (-1 = optim.weight_decay)"
    )
    muon_momentum: float = num(0.95, min=0.0, max=1.0)
    muon_nesterov: bool = True
    muon_ns_steps: int = num(5, min=1, max=99, doc="Newton-Schulz iterations per update")
    muon_adjust_lr: str = choice(
        "match_rms_adamw",
        "match_rms_adamw",
        "original",
        doc="the lr scale per matrix: match_rms_adamw = 0.2 sqrt(max(A, B)) (Moonshot: AdamW's lr "
        "and weight decay carry over), original = sqrt(max(1, A / B)) (Keller Jordan's; lr ~0.02)",
    )
    muon_ns_dtype: str = choice(
        "auto",
        "auto",
        "bf16",
        "fp32",
        doc="the Newton-Schulz iteration's dtype: bf16 as torch.optim.Muon; auto = bf16 where the "
        "device computes bf16 in hardware, fp32 elsewhere (announced, like train.precision)",
    )


@dataclass
class TrainConfig:
    epochs: float = num(10.0, min=0.0)
    time_limit_s: float = num(
        0.0,
        min=0.0,
        doc="stop training after this many seconds (0 = off; with "
        "several processes checked at log steps)",
    )
    precision: str = choice(
        "fp32",
        "fp32",
        "bf16",
        "fp16",
        "pure_bf16",
        "pure_fp16",
        "bf16_act",
        "auto",
        doc="bf16_act = bf16 autocast with the LayerNorms and the residual stream in bf16 too, the "
        "parameters and optimizer state fp32 (one device or DDP; issue 51); "
        "auto = bf16 where the device computes bf16 in hardware (a CUDA GPU of compute "
        "capability 8.0+, a CPU with avx512_bf16 or amx_bf16), fp32 elsewhere; the choice is "
        "announced and written to the run's config.toml and summary.json",
    )
    master_weights: bool = True  # pure_* modes: keep an fp32 master copy for the optimizer
    loss_scale: float = num(65536.0, min=1.0, doc="initial dynamic loss scale (fp16)")
    accum_steps: int = num(1, min=1, doc="micro-batches per optimizer step")
    label_smoothing: float = num(0.0, min=0.0, max=1.0)
    ema_decay: float = num(0.0, min=0.0, max=1.0, doc="EMA of weights (0 = off)")
    ema_warmup: bool = field(
        default=False,
        metadata={
            "doc": "the EMA's decay warms up as timm's ModelEmaV3(use_warmup=True): update k (from "
            "0) averages with min(train.ema_decay, 1 - (1 + k)^(-2/3)), so that the random initial "
            "weights cannot outweigh a short run"
        },
    )
    min_steps: int = num(
        0,
        min=0,
        doc="the optimizer steps the recipe needs (0 = no minimum): data.batch_rule=min_steps "
        "fits the batch (and, at the smallest batch, the epochs) to give them; a fixed batch "
        "that gives fewer is announced",
    )
    ema_eval: bool = True  # evaluate the EMA weights when EMA is on
    compile: bool = False
    compile_mode: str = choice(
        "default",
        "default",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
        doc="torch.compile mode: reduce-overhead "
        "= CUDA graphs (one launch per step: small, launch-bound models on a GPU)",
    )
    # inductor's own knobs (issue 51), applied to this run's compile only; off = torch's default
    inductor_coordinate_descent: bool = field(
        default=False,
        metadata={
            "doc": "train.compile: inductor's coordinate_descent_tuning (Triton kernels' block "
            "sizes tuned further; max-autotune modes set it already). No effect on a CPU"
        },
    )
    inductor_combo_kernels: bool = field(
        default=False,
        metadata={
            "doc": "train.compile: inductor's combo_kernels (independent small Triton kernels "
            "launched as one). No effect on a CPU"
        },
    )
    inductor_mix_order: str = choice(
        "default",
        "default",
        "on",
        "off",
        doc="train.compile: inductor's triton.mix_order_reduction (a row and a column reduction "
        "of one tensor in one kernel: LayerNorm's backward); default = torch's. No effect on a CPU",
    )
    inductor_gemm: str = choice(
        "default",
        "default",
        "cutlass",
        "cutedsl",
        doc="train.compile with compile_mode=max-autotune(-no-cudagraphs): add CUTLASS or CuTeDSL "
        "(Blackwell) GEMM templates, with their epilogues (bias, GELU), to what max-autotune "
        "chooses among (max_autotune_gemm_backends); CUDA only",
    )
    compile_cache: str = field(
        default="",
        metadata={
            "doc": "train.compile: a file for torch.compiler's Mega Cache: loaded before the first "
            "compile, written after the first optimizer step, so that the next run does not "
            'compile again ("" = off)'
        },
    )
    activation_checkpointing: bool = False
    sdpa_backend: str = choice(
        "auto",
        "auto",
        "flash",
        "cudnn",
        "efficient",
        "math",
        doc="model.attention="
        "sdpa: the kernel scaled_dot_product_attention may use (torch.nn.attention."
        "sdpa_kernel); auto = torch's choice. cudnn and efficient are CUDA kernels "
        "(refused on a CPU); the same function within the kernels' rounding",
    )
    fp8: str = choice(
        "none",
        "none",
        "tensorwise",
        "rowwise",
        doc="torchao float8 training of the transformer "
        "blocks' Linear layers (dynamic scales per tensor or per row) with train.precision=bf16 "
        "or pure_bf16 around them: a GPU with compute capability 8.9+; refused where it was "
        "measured slower than bf16 (docs/performance.md)",
    )
    capture: str = choice(
        "auto",
        "auto",
        "none",
        "step",
        doc="step = the whole training step (forward, backward, "
        "clipping, AdamW with its lr and step count on the device, EMA, the non-finite "
        "watch) as one unit with static shapes: one CUDA graph replay per step on a GPU "
        "(small, launch-bound models); on a CPU the same step runs uncaptured, with the "
        "same numbers as none (docs/gpu.md). auto = step on one CUDA GPU in one process "
        "for a recipe the capture takes, none otherwise (the reason announced)",
    )
    tf32: bool = field(
        default=True,
        metadata={
            "doc": "CUDA: fp32 matmuls and convolutions in TF32 "
            "(tensor cores, 10-bit mantissa); false = IEEE fp32. No effect on CPU"
        },
    )
    cudnn_benchmark: bool = field(
        default=True,
        metadata={
            "doc": "CUDA: cuDNN times its convolution "
            "algorithms once per input shape and keeps the fastest"
        },
    )
    channels_last: bool = field(
        default=False,
        metadata={"doc": "conv stem weights and images in channels-last (NHWC) memory format"},
    )
    eval_hflip_tta: bool = False  # average logits of the image and its mirror at evaluation
    targets: list[float] = field(
        default_factory=list,
        metadata={
            "doc": "target accuracies, 90% = 0.9 (the task's metric: test_accuracy, CLIP's "
            "retrieval_r1): summary.json's time_to_target and the closing line give the training "
            "time of the first evaluation that reached each; only reporting (changeable on resume)",
            "items_in": (0.0, 1.0),  # each in (0, 1]
        },
    )


@dataclass
class StrategyConfig:
    name: str = choice(
        "single",
        "single",
        "ddp",
        "fsdp",
        "hsdp",
        "deepspeed",
        doc="ddp/fsdp/hsdp/deepspeed: launch with torchrun --nproc-per-node N; "
        "ddp = replicas, fsdp = shards, hsdp = replicas of shard groups (strategy/mesh.py)",
    )
    dp_replicate: int = num(
        0,
        min=-1,
        doc="mesh: data-parallel replicas (0 = strategy.name's default, -1 = fill the processes)",
    )
    dp_shard: int = num(
        0,
        min=-1,
        doc="mesh: FSDP2 shard group size (0 = strategy.name's default: all processes for fsdp, "
        "one node for hsdp; -1 = fill)",
    )
    tp: int = num(
        1,
        min=-1,
        doc="mesh: tensor-parallel size (Megatron split of each block's attention and MLP; "
        "fsdp, hsdp or ddp; -1 = fill)",
    )
    sequence_parallel: bool = False  # tp > 1: the norms and residuals on 1/tp of the tokens
    backend: str = choice("auto", "auto", "nccl", "gloo", doc="auto = nccl on GPUs, gloo on CPUs")
    timeout_s: float = num(600.0, min=1.0, doc="collective timeout: a dead rank stops the others")
    bucket_mb: float = num(25.0, min=0.0, doc="DDP gradient bucket size")
    grad_compression: str = choice(
        "none", "none", "bf16", "fp16", doc="DDP: all-reduce gradients in half"
    )
    reduce_dtype: str = choice(
        "fp32", "fp32", "bf16", doc="FSDP: gradient reduce-scatter precision"
    )
    reshard_after_forward: bool = (
        True  # FSDP: free gathered parameters after forward (ZeRO-3 style)
    )
    cpu_offload: bool = False  # FSDP: keep sharded parameters and optimizer state on CPU
    checkpoint_format: str = choice(
        "full",
        "full",
        "sharded",
        doc="FSDP checkpoints: full = model and "
        "optimizer gathered into step_N.pt by the main process; sharded = "
        "each rank writes its shards to step_N.dcp (torch.distributed."
        "checkpoint; for models too large to gather). Other strategies have "
        "one format and ignore it",
    )
    zero_stage: int = num(
        2,
        min=0,
        max=3,
        doc="DeepSpeed ZeRO stage: 0 = data parallel, 1 = optimizer "
        "state sharded, 2 = + gradients, 3 = + parameters",
    )
    offload_optimizer: bool = False  # DeepSpeed: optimizer state and step on the CPU (ZeRO 1-3)
    offload_params: bool = False  # DeepSpeed: parameters on the CPU (ZeRO 3)
    ds_config: str = field(
        default="",
        metadata={
            "doc": "DeepSpeed: JSON file merged over the generated "
            "ds_config (its keys win; batch keys must agree)"
        },
    )
    wall_clock_breakdown: bool = False  # DeepSpeed: forward/backward/step timers in its log
    comms_logger: bool = False  # DeepSpeed: communication summary at each checkpoint
    flops_profiler: bool = False  # DeepSpeed: FLOPs profile of the third step (after warm-up)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    clip: ClipConfig = field(default_factory=ClipConfig)
    # the recipe's [per_device.CLASS.SECTION] tables (DEVICE_CLASSES): keys it sets on one class of
    # device only, over its own and under the user's --set; fastpaths.resolve applies the machine's
    # one and empties this, so a run's config.toml holds the values it ran with
    per_device: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_toml(self) -> str:
        out = []
        for sec, values in self.to_dict().items():
            if sec == PER_DEVICE:
                continue
            out.append(f"[{sec}]")
            out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
            out.append("")
        for cls, sections in self.per_device.items():
            for sec, values in sections.items():
                if not values:  # every key of it named on the command line
                    continue
                out.append(f"[{PER_DEVICE}.{cls}.{sec}]")
                out += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
                out.append("")
        return "\n".join(out)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)


PER_DEVICE = "per_device"
SECTIONS = {f.name: f.type for f in fields(Config) if f.name != PER_DEVICE}
# the classes a recipe's [per_device.CLASS] tables name: the question train.precision=auto asks
DEVICE_CLASSES = {
    "cpu": "a CPU without bf16 instructions",
    "cpu_bf16": "a CPU with bf16 instructions (avx512_bf16 or amx_bf16)",
    "cuda": "a CUDA GPU",
}


def _section_types() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {name: hints[name] for name in SECTIONS}


def _coerce_list(key: str, value: Any, typ: Any, meta) -> list:
    """A list key: a TOML array (`--set train.targets=[0.9,0.91]`), a comma-separated string or
    one value; each item coerced as the list's item type, and in (lo, hi] where the field's
    metadata says `items_in`: (lo, hi)."""
    if isinstance(value, str):
        value = [v for v in value.strip().strip("[]").split(",") if v.strip()]
    elif not isinstance(value, (list, tuple)):
        value = [value]
    (item,) = get_args(typ) or (str,)
    out = [_coerce(f"{key}[{i}]", v, item, {}) for i, v in enumerate(value)]
    lo, hi = meta.get("items_in") or (None, None)
    bad = [v for v in out if lo is not None and not lo < v <= hi]
    if bad:
        raise ConfigError(f"config: {key} must be in ({lo:g}, {hi:g}], got {bad[0]!r}")
    return out


def _coerce(key: str, value: Any, typ: Any, meta) -> Any:
    """Check/convert one value for `key`; raise ConfigError with a one-line message."""
    if get_origin(typ) is list:
        return _coerce_list(key, value, typ, meta)
    if typ is bool:
        if isinstance(value, str) and value.lower() in (
            "true",
            "false",
            "1",
            "0",
            "yes",
            "no",
            "on",
            "off",
        ):
            value = value.lower() in ("true", "1", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key} must be true or false, got {value!r}")
    elif typ is int:
        if isinstance(value, str):
            try:
                value = int(value.replace("_", ""))
            except ValueError:
                raise ConfigError(f"config: {key} must be an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"config: {key} must be an integer, got {value!r}")
    elif typ is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"config: {key} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key} must be a number, got {value!r}")
        value = float(value)
    elif typ is str:
        if not isinstance(value, str):
            value = (
                str(value)
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else value
            )
        if not isinstance(value, str):
            raise ConfigError(f"config: {key} must be a string, got {value!r}")
    choices = meta.get("choices")
    if choices and value not in choices:
        raise ConfigError(
            f"config: {key} must be one of {', '.join(map(str, choices))}; got {value!r}"
            + did_you_mean(str(value), choices)
        )
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"config: {key} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ConfigError(f"config: {key} must be <= {hi}, got {value!r}")
    return value


def set_value(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.key` of `cfg` to `value`, coerced and checked against the schema (ConfigError
    naming the key where the key or the value is not valid; cross-field checks are `check`'s)."""
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"config: key '{dotted}' must look like section.key (sections: {', '.join(SECTIONS)})"
        )
    sec, key = parts
    if sec not in SECTIONS:
        raise ConfigError(f"config: unknown section '{sec}'{did_you_mean(sec, SECTIONS)}")
    section = getattr(cfg, sec)
    fmap = {f.name: f for f in fields(section)}
    if key not in fmap:
        valid = [f"{sec}.{k}" for k in fmap]
        raise ConfigError(f"config: unknown key '{dotted}'{did_you_mean(dotted, valid)}")
    hints = get_type_hints(type(section))
    setattr(section, key, _coerce(dotted, value, hints[key], fmap[key].metadata))


def apply_dict(cfg: Config, data: dict, source: str = "config") -> Config:
    for sec, values in data.items():
        if sec == PER_DEVICE:
            cfg.per_device = per_device_tables(values, source)
            continue
        if not isinstance(values, dict):
            if sec not in SECTIONS:
                raise ConfigError(
                    f"{source}: unknown top-level key '{sec}'{did_you_mean(sec, SECTIONS)}"
                )
            raise ConfigError(f"{source}: [{sec}] must be a table of keys")
        for key, value in values.items():
            try:
                set_value(cfg, f"{sec}.{key}", value)
            except ConfigError as e:
                raise ConfigError(str(e).replace("config:", f"{source}:", 1)) from None
    return cfg


def per_device_tables(value: Any, source: str) -> dict:
    """A recipe's [per_device.CLASS.SECTION] tables, every key checked as the recipe's own keys
    are (on a scratch config: the tables change nothing until fastpaths.resolve applies one)."""
    classes = ", ".join(DEVICE_CLASSES)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: [{PER_DEVICE}] must hold tables [{PER_DEVICE}.CLASS.SECTION]")
    out: dict = {}
    for cls, sections in value.items():
        where = f"[{PER_DEVICE}.{cls}]"
        if cls not in DEVICE_CLASSES:
            raise ConfigError(f"{source}: {where}: unknown device class (classes: {classes})")
        if not isinstance(sections, dict) or not all(
            isinstance(v, dict) for v in sections.values()
        ):
            raise ConfigError(
                f"{source}: {where} must hold tables such as [{PER_DEVICE}.{cls}.train]"
            )
        scratch = Config()
        for sec, values in sections.items():
            for key, v in values.items():
                try:
                    set_value(scratch, f"{sec}.{key}", v)
                except ConfigError as e:
                    raise ConfigError(str(e).replace("config:", f"{source}: {where}", 1)) from None
        out[cls] = {sec: dict(values) for sec, values in sections.items()}
    return out


def set_override(cfg: Config, dotted: str, value: Any) -> None:
    """`set_value`, for a key the user (or a search) names: it wins over every [per_device] table."""
    set_value(cfg, dotted, value)
    sec, _, name = dotted.partition(".")
    named = [name]
    if dotted == "data.batch_size":  # a batch the user names is never changed (data.batch_rule)
        cfg.data.batch_rule = "fixed"
        named.append("batch_rule")
    for sections in cfg.per_device.values():
        for key in named:
            sections.get(sec, {}).pop(key, None)


def with_device_section(cfg: Config, cls: str) -> Config:
    """`cfg` with its [per_device.`cls`] keys set and no tables left (a copy)."""
    out = copy.deepcopy(cfg)
    out.per_device = {}
    for sec, values in cfg.per_device.get(cls, {}).items():
        for key, value in values.items():
            set_value(out, f"{sec}.{key}", value)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"--set '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    raw = raw.strip()
    try:  # TOML literal if it parses (numbers, bools, quoted strings), else the raw string
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value


# the recipe on a command line: CONFIG and --set, shared by the CLI and the lab's commands
def add_overrides(p, help: str = "override one config value (repeatable)") -> None:
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help=help,
    )


def add_recipe_arguments(
    p,
    help: str = "TOML recipe (path, or a name from configs/; default: the Fashion-MNIST recipe)",
    set_help: str = "override one config value (repeatable)",
) -> None:
    """CONFIG and --set, the same for train, info, config and the lab's commands."""
    p.add_argument("config", nargs="?", help=help)
    add_overrides(p, set_help)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- recipe TOML (the default recipe when None) <- `--set` overrides; then checks."""
    cfg = Config()
    path = Path(path) if path else DEFAULT_RECIPE
    if not path.exists() and not path.is_absolute():
        # a shipped recipe by name: `vit_b16_imagenet`, `vit_b16_imagenet.toml`, `configs/tests/tiny.toml`
        rel = Path(*path.parts[1:]) if path.parts[0] == "configs" else path
        for cand in (RECIPES / rel, RECIPES / rel.with_suffix(".toml")):
            if cand.exists():
                path = cand
                break
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    apply_dict(cfg, data, source=str(path))
    for text in overrides:
        set_override(cfg, *parse_override(text))
    check(cfg)
    for cls in cfg.per_device:  # each device's recipe meets the rules too, refused on any machine
        try:
            check(with_device_section(cfg, cls))
        except ConfigError as e:
            raise ConfigError(f"{path}: [{PER_DEVICE}.{cls}]: {e}") from None
    return cfg


def config_from_dict(data: dict) -> Config:
    cfg = apply_dict(Config(), data)
    check(cfg)
    return cfg


def saved_config(saved: dict, overrides=(), source: str = "checkpoint") -> Config:
    """The config a checkpoint saved (state.SavedRun.config), with `--set` overrides, checked."""
    cfg = apply_dict(Config(), saved, source=f"{source} (saved config)")
    for text in overrides:
        set_value(cfg, *parse_override(text))
    check(cfg)
    return cfg


def micro_batch(
    batch_size: int, world_size: int = 1, accum_steps: int = 1, error=ConfigError
) -> int:
    """The per-process micro-batch of a global batch split over processes x accumulation steps;
    a one-line `error` where it does not split evenly (every place that splits a batch asks here)."""
    per, rem = divmod(batch_size, world_size * accum_steps)
    if rem or not per:
        prefix = "config: " if error is ConfigError else ""
        raise error(
            f"{prefix}data.batch_size ({batch_size}) must be a multiple of processes ({world_size}) x "
            f"train.accum_steps ({accum_steps})"
        )
    return per


def check_capture(cfg: Config) -> None:
    """train.capture=step: what a step replayed without host work cannot hold, refused in one line."""
    why = capture_refusal(cfg)
    if why:
        raise ConfigError(f"config: train.capture=step is refused: {why}")


def capture_refusal(cfg: Config) -> str | None:
    """Why the recipe's step cannot be captured as one unit (train.capture=step), or None."""
    t, why = cfg.train, None
    if cfg.strategy.name != "single":
        why = f"it is for one device (strategy.name=single), not {cfg.strategy.name}"
    elif t.precision in ("fp16", "pure_fp16"):
        why = (
            f"train.precision={t.precision}: the loss scaler decides on the host whether a step is "
            "skipped; use bf16 or pure_bf16"
        )
    elif cfg.optim.name != "adamw":
        why = (
            f"optim.name={cfg.optim.name}: its lr and step count live on the host; AdamW keeps them "
            "on the device (capturable)"
        )
    elif cfg.optim.schedule_clock == "time":
        why = "optim.schedule_clock=time reads the host clock each step; use schedule_clock=steps"
    elif cfg.model.patch_dropout and cfg.model.patch_dropout_until < 1:
        why = (
            "model.patch_dropout_until < 1 switches patch dropout off mid-run, which changes the "
            "image tokens a recorded step holds; use patch_dropout_until=1"
        )
    elif t.compile and t.compile_mode in ("reduce-overhead", "max-autotune"):
        why = (
            f"train.compile_mode={t.compile_mode} captures CUDA graphs of its own; use compile_mode="
            "default or max-autotune-no-cudagraphs inside the captured step"
        )
    return why


INDUCTOR_KNOBS = (
    "inductor_coordinate_descent",
    "inductor_combo_kernels",
    "inductor_mix_order",
    "inductor_gemm",
    "compile_cache",
)


def inductor_knobs(train: TrainConfig) -> list[str]:
    """The train.inductor_* (and compile_cache) keys a config sets, as "train.key=value"."""
    defaults = TrainConfig()
    return [
        f"train.{k}={str(getattr(train, k)).lower()}"
        for k in INDUCTOR_KNOBS
        if getattr(train, k) != getattr(defaults, k)
    ]


# train.inductor_gemm -> inductor's max_autotune_gemm_backends (CUTLASS: NVIDIA GPUs with the
# cutlass package; CUTEDSL: Blackwell, SM100+, in torch >= 2.9)
GEMM_BACKENDS = {"cutlass": "ATEN,TRITON,CUTLASS", "cutedsl": "ATEN,TRITON,CUTEDSL"}


def inductor_options(train: TrainConfig) -> dict:
    """The inductor config entries the train.inductor_* keys set ({}: none set)."""
    opts: dict = {}
    if train.inductor_coordinate_descent:
        opts["coordinate_descent_tuning"] = True
    if train.inductor_combo_kernels:
        opts["combo_kernels"] = True
    if train.inductor_mix_order != "default":
        opts["triton.mix_order_reduction"] = train.inductor_mix_order == "on"
    if train.inductor_gemm != "default":
        opts["max_autotune_gemm_backends"] = GEMM_BACKENDS[train.inductor_gemm]
    return opts


def inductor_refusal(train: TrainConfig) -> str | None:
    """A knob of torch.compile without train.compile=true; train.inductor_gemm without a
    max-autotune mode (the GEMM backends are what max-autotune chooses among): one line or None."""
    knobs = inductor_knobs(train)
    if knobs and not train.compile:
        return f"config: {knobs[0]} is an option of torch.compile: it needs train.compile=true"
    if train.inductor_gemm != "default" and not train.compile_mode.startswith("max-autotune"):
        return (
            f"config: train.inductor_gemm={train.inductor_gemm} adds GEMM backends to what "
            "max-autotune chooses among: set train.compile_mode=max-autotune-no-cudagraphs (not "
            f"{train.compile_mode})"
        )
    return None


def check(cfg: Config) -> None:
    """Cross-field checks that one key alone cannot express. What depends on the kind of model
    (its model.init files) is the task's check: tasks.check_config runs both. That the global
    batch splits over processes and micro-batches is checked once, where the number of processes is
    known (the Trainer: `micro_batch`)."""
    if cfg.train.compile_mode != "default" and not cfg.train.compile:
        raise ConfigError(
            f"config: train.compile_mode={cfg.train.compile_mode} needs train.compile=true"
        )
    if cfg.train.compile_mode in ("reduce-overhead", "max-autotune"):  # the modes with CUDA graphs
        if cfg.train.accum_steps > 1:
            raise ConfigError(
                f"config: train.compile_mode={cfg.train.compile_mode} (CUDA graphs) with "
                "train.accum_steps > 1 is refused: a replay overwrites the gradient buffers "
                "the last micro-batch left in .grad (pytorch/pytorch#169545); use "
                "max-autotune-no-cudagraphs or accum_steps=1"
            )
        if cfg.strategy.name != "single":
            raise ConfigError(
                f"config: train.compile_mode={cfg.train.compile_mode} (CUDA graphs) is for "
                f"strategy.name=single (one GPU), not {cfg.strategy.name}; use "
                "max-autotune-no-cudagraphs"
            )
    if cfg.train.capture == "step":
        check_capture(cfg)
    why = inductor_refusal(cfg.train)
    if why:
        raise ConfigError(why)
    if cfg.train.fp8 != "none":
        # auto: checked where it is resolved
        if cfg.train.precision not in ("bf16", "pure_bf16", "auto"):
            raise ConfigError(
                f"config: train.fp8={cfg.train.fp8} runs float8 matmuls inside bf16 training: set "
                f"train.precision=bf16 or pure_bf16 (not {cfg.train.precision})"
            )
    if cfg.train.sdpa_backend != "auto" and cfg.model.attention != "sdpa":
        raise ConfigError(
            f"config: train.sdpa_backend={cfg.train.sdpa_backend} picks a kernel of fused attention: "
            f"it needs model.attention=sdpa (not {cfg.model.attention})"
        )
    if cfg.train.precision == "pure_fp16" and not cfg.train.master_weights:
        raise ConfigError(
            "config: train.precision=pure_fp16 with train.master_weights=false is refused: "
            "torch's loss scaler cannot unscale fp16 gradients, and fp16 optimizer state "
            "underflows AdamW's eps (1e-8 is 0 in fp16); keep master_weights=true or use pure_bf16"
        )
    if cfg.optim.schedule_clock == "time" and not cfg.train.time_limit_s:
        raise ConfigError(
            "config: optim.schedule_clock=time needs train.time_limit_s > 0 (the budget the "
            "lr schedule spans)"
        )
    if cfg.model.patch_dropout >= 1:
        raise ConfigError(
            f"config: model.patch_dropout must be < 1 (the fraction of patch tokens dropped; at "
            f"least one is kept), got {cfg.model.patch_dropout!r}"
        )
    if cfg.model.heads and cfg.model.dim and cfg.model.dim % cfg.model.heads:
        raise ConfigError(
            f"config: model.dim ({cfg.model.dim}) must be divisible by model.heads ({cfg.model.heads})"
        )
