"""timm's own evaluation of a cmhsa checkpoint on an ImageFolder, the way timm's validate.py does it
(timm's dataset, loader and preprocessing from the model's pretrained_cfg); its top-1 equals
``cmhsa eval CKPT --data imagefolder --data-dir DIR`` (tests/test_timm.py checks it).

    python examples/timm_validate.py runs/vit.safetensors DIR/val [--model cmhsa_attn]
"""

from __future__ import annotations

import argparse

import timm
import torch
from timm.data import create_dataset, create_loader, resolve_data_config
from timm.utils import AverageMeter, accuracy

import convit_convert.timm  # noqa: F401  (registers cmhsa_conv, cmhsa_attn, ...)


@torch.inference_mode()
def validate(file: str, root: str, model_name: str = "cmhsa_attn", batch_size: int = 64) -> float:
    """Top-1 (%) of the checkpoint ``file`` on the ImageFolder ``root`` (class folders)."""
    model = timm.create_model(model_name, pretrained=True, pretrained_cfg_overlay=dict(file=file)).eval()
    config = resolve_data_config(model=model)
    dataset = create_dataset("", root=root, input_img_mode="L" if config["input_size"][0] == 1 else "RGB")
    loader = create_loader(
        dataset,
        batch_size=batch_size,
        use_prefetcher=False,
        num_workers=0,
        persistent_workers=False,
        **config,
    )
    top1 = AverageMeter()
    for images, target in loader:
        top1.update(accuracy(model(images), target, topk=(1,))[0].item(), images.size(0))
    return top1.avg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("root", help="an ImageFolder: one folder per class")
    ap.add_argument("--model", default="cmhsa_attn", help="cmhsa_attn or cmhsa_conv (the file's kind)")
    args = ap.parse_args()
    print(f"top-1 {validate(args.checkpoint, args.root, args.model):.2f}%")


if __name__ == "__main__":
    main()
