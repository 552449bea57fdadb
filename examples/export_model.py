#!/usr/bin/env python3
"""Exports the model that `serve --model FILE.pt` serves: a small ResNet-style CNN that reads a
request's 16 numbers as a 1x4x4 image and answers 10 class scores, saved with torch.jit.script
(TorchScript, loaded in C++ with torch::jit::load), with reference inputs and outputs beside it
(FILE.ref.txt: one line per input, its 16 numbers, then ";", then the 10 scores Python computed).
A name ending in .pt2 saves it the way torch 2.15 recommends instead: torch.export with a batch
size from 1 to --max-batch, compiled ahead of time by AOTInductor into a package that C++ loads
with torch::inductor::AOTIModelPackageLoader (no Python, no TorchScript interpreter).

    /opt/troupe-venv/bin/python examples/export_model.py model.pt [--width 16] [--seed 0]
    /opt/troupe-venv/bin/python examples/export_model.py model.pt2 [--max-batch 64]

Run it with the project's venv (tools/setup.sh): the same torch as the C++ side. A .pt2 needs a
C++ compiler (g++) and takes about 40 s on 2 cores; it is compiled for this machine's CPU (its
instruction set), so build it where it will be served. The same seed gives the same weights in
both formats.
"""
import argparse
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # not needed here
import torch  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    """A residual block: conv-bn-relu-conv-bn, plus the input."""

    def __init__(self, width: int):
        super().__init__()
        self.c1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.b1(self.c1(x)))
        return torch.relu(x + self.b2(self.c2(y)))


class TinyResNet(nn.Module):
    """[N, C*S*S] -> [N, 10]: each row as a CxSxS image (1x4x4 by default: serve's 16 numbers),
    a stem, residual blocks, global average pooling and a linear classifier."""

    def __init__(self, width: int = 16, classes: int = 10, channels: int = 1, side: int = 4,
                 blocks: int = 2):
        super().__init__()
        self.channels = channels
        self.side = side
        self.stem = nn.Sequential(nn.Conv2d(channels, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), self.channels, self.side, self.side)
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def export_package(model: nn.Module, out: str, max_batch: int, inputs: int):
    """torch.export with a dynamic batch size, then AOTInductor: the package, loaded back."""
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    program = torch.export.export(model, (torch.randn(4, inputs),),
                                  dynamic_shapes={"x": {0: batch}})
    import torch.fx.experimental._config as fx_config

    # Without these the package silently takes a narrower range than exported (a convolution's
    # guard specializes the batch below or above 16) and refuses batches of 1.
    with fx_config.patch(backed_size_oblivious=True):
        torch._inductor.aoti_compile_and_package(
            program, package_path=out, inductor_configs={"aot_inductor.check_lowerbound": False})
    return torch._inductor.aoti_load_package(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the TorchScript model (e.g. model.pt)")
    ap.add_argument("--width", type=int, default=16, help="channels of the CNN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--references", type=int, default=8, help="reference rows to write")
    ap.add_argument("--channels", type=int, default=1, help="channels of an input image")
    ap.add_argument("--side", type=int, default=4, help="an input image is side x side")
    ap.add_argument("--blocks", type=int, default=2, help="residual blocks")
    ap.add_argument("--max-batch", type=int, default=64,
                    help=".pt2: the largest batch the package takes (serve's --max-batch)")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = TinyResNet(a.width, channels=a.channels, side=a.side, blocks=a.blocks)
    inputs = a.channels * a.side * a.side
    # Batch statistics that are not the identity, as a trained model has.
    with torch.no_grad():
        model.train()
        for _ in range(4):
            model(torch.randn(64, inputs))
    model.eval()
    if a.out.endswith(".pt2"):
        run = export_package(model, a.out, a.max_batch, inputs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script's deprecation notice
            run = torch.jit.script(model)
        run.save(a.out)
    x = torch.randn(a.references, inputs)
    with torch.no_grad():
        y = run(x)
    with open(a.out + ".ref.txt", "w") as f:
        for xi, yi in zip(x.tolist(), y.tolist()):
            f.write(" ".join(repr(v) for v in xi) + " ; " + " ".join(repr(v) for v in yi) + "\n")
    print(f"wrote {a.out} and {a.out}.ref.txt ({a.references} reference rows)")


if __name__ == "__main__":
    main()
