#!/usr/bin/env python3
"""Exports the model that `serve --model FILE.pt` serves: a small ResNet-style CNN that reads a
request's 16 numbers as a 1x4x4 image and answers 10 class scores, saved with torch.jit.script
(TorchScript, loaded in C++ with torch::jit::load), with reference inputs and outputs beside it
(FILE.ref.txt: one line per input, its 16 numbers, then ";", then the 10 scores Python computed).

    /opt/troupe-venv/bin/python examples/export_model.py model.pt [--width 16] [--seed 0]

Run it with the project's venv (tools/setup.sh): the same torch as the C++ side. torch 2.15 warns
that torch.jit.script is deprecated in favour of torch.export; the C++ path for torch.export is
an AOTInductor package (.pt2), which troupe's serve does not load yet.
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
    """[N, 16] -> [N, 10]: the 16 numbers as a 1x4x4 image, a stem, two residual blocks,
    global average pooling and a linear classifier."""

    def __init__(self, width: int = 16, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(Block(width), Block(width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), 1, 4, 4)
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the TorchScript model (e.g. model.pt)")
    ap.add_argument("--width", type=int, default=16, help="channels of the CNN")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--references", type=int, default=8, help="reference rows to write")
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = TinyResNet(a.width)
    # Batch statistics that are not the identity, as a trained model has.
    with torch.no_grad():
        model.train()
        for _ in range(4):
            model(torch.randn(64, 16))
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script's deprecation notice
        scripted = torch.jit.script(model)
    scripted.save(a.out)
    x = torch.randn(a.references, 16)
    with torch.no_grad():
        y = scripted(x)
    with open(a.out + ".ref.txt", "w") as f:
        for xi, yi in zip(x.tolist(), y.tolist()):
            f.write(" ".join(repr(v) for v in xi) + " ; " + " ".join(repr(v) for v in yi) + "\n")
    print(f"wrote {a.out} and {a.out}.ref.txt ({a.references} reference rows)")


if __name__ == "__main__":
    main()
