"""DCGAN trained with two DeepSpeed engines (discriminator and generator), on synthetic images.

Re-created (trimmed, rewritten) from DeepSpeedExamples `training/gan/gan_deepspeed_train.py` (with its
`gan_model.py` and `utils.py`), commit 45b4b7156c8794a3452a5a7d03dbd8d797068569. Kept as upstream:
`add_config_arguments`, two `initialize(args=, model=, model_parameters=, optimizer=)` calls with client torch
Adam optimizers, `netD.zero_grad()` on the raw module, two `model_engineD.backward` calls before one
`model_engineD.step()`, the generator loss flowing through netD. Dropped: torchvision datasets, tensorboard,
image dumps, `torch.cuda` calls (CPU run). The networks are scaled down to 16x16 images.
The library is a switch: COMPAT_LIB=deepspeed (default) or COMPAT_LIB=zeroshard.
"""

import argparse
import importlib
import json
import os
import random

import numpy as np
import torch
import torch.nn as nn

deepspeed = importlib.import_module(os.environ.get("COMPAT_LIB", "deepspeed"))


def get_argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="GAN")
    parser.add_argument("--batchSize", type=int, default=8, help="input batch size")
    parser.add_argument("--samples", type=int, default=32, help="synthetic training images")
    parser.add_argument("--nz", type=int, default=8, help="size of the latent z vector")
    parser.add_argument("--ngf", type=int, default=8)
    parser.add_argument("--ndf", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.0002)
    parser.add_argument("--beta1", type=float, default=0.5)
    parser.add_argument("--manualSeed", type=int, default=999)
    parser.add_argument("--local_rank", type=int, default=-1, help="local_rank for distributed training")
    return parser


def set_seed(value: int) -> None:
    random.seed(value)
    torch.manual_seed(value)
    np.random.seed(value)


def weights_init(m: nn.Module) -> None:
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


class Generator(nn.Module):
    def __init__(self, ngf: int, nc: int, nz: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),  # 4x4
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),  # 8x8
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),  # 16x16
            nn.Tanh(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ndf: int, nc: int) -> None:
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),  # 8x8
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),  # 4x4
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.main(input).view(-1, 1).squeeze(1)


def train(args: argparse.Namespace) -> None:
    set_seed(args.manualSeed)
    nc = 3
    images = torch.rand(args.samples, nc, 16, 16) * 2 - 1
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(args.samples))
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True, num_workers=0)
    device = torch.device("cpu")
    nz = int(args.nz)

    netG = Generator(int(args.ngf), nc, nz).to(device)
    netG.apply(weights_init)
    netD = Discriminator(int(args.ndf), nc).to(device)
    netD.apply(weights_init)

    criterion = nn.BCELoss()
    real_label = 1
    fake_label = 0

    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    model_engineD, optimizerD, _, _ = deepspeed.initialize(
        args=args, model=netD, model_parameters=netD.parameters(), optimizer=optimizerD
    )
    model_engineG, optimizerG, _, _ = deepspeed.initialize(
        args=args, model=netG, model_parameters=netG.parameters(), optimizer=optimizerG
    )

    losses = []
    for _epoch in range(args.epochs):
        for data in dataloader:
            # (1) discriminator: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)

            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            errD = errD_real + errD_fake
            model_engineD.step()

            # (2) generator: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            model_engineG.step()
            losses.append([errD.item(), errG.item()])

    if int(os.environ.get("RANK", "0")) == 0:
        print("COMPAT_RESULT " + json.dumps({"losses": losses}), flush=True)


def main() -> None:
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(args)


if __name__ == "__main__":
    main()
