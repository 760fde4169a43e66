import os

import torch


def _n(default, env):
    return min(default, int(os.environ.get(env, default)))


class MNIST(torch.utils.data.Dataset):
    """MNIST-shaped synthetic digits: 10 fixed smooth class templates plus per-sample noise and shift, uint8 28x28,
    so a classifier/VAE has something to learn. PS_MNIST_N train samples (default 640), a quarter of that for test."""

    def __init__(self, root, train=True, download=False, transform=None):
        n = int(os.environ.get("PS_MNIST_N", 640))
        self.n = n if train else max(n // 4, 64)
        self.offset = 0 if train else 10 ** 6
        self.transform = transform
        g = torch.Generator().manual_seed(1234)
        coarse = torch.rand(10, 1, 7, 7, generator=g)
        self.templates = torch.nn.functional.interpolate(coarse, size=(28, 28), mode="bilinear",
                                                         align_corners=False)[:, 0]

    def __len__(self):
        return self.n

    @property
    def data(self):
        """torchvision's MNIST.data: every image, uint8 N x 28 x 28 (the siamese example reads it directly)."""
        if not hasattr(self, "_data"):
            self._data, self._targets = self._materialise()
        return self._data

    @property
    def targets(self):
        if not hasattr(self, "_targets"):
            self._data, self._targets = self._materialise()
        return self._targets

    def _materialise(self):
        t, self.transform = self.transform, None
        pairs = [self[i] for i in range(self.n)]
        self.transform = t
        return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        y = int(torch.randint(0, 10, (1,), generator=g))
        dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=g))
        img = torch.roll(self.templates[y], shifts=(dx, dy), dims=(0, 1))
        img = (img + 0.15 * torch.randn(28, 28, generator=g)).clamp(0, 1)
        img = (img * 255).round().to(torch.uint8)
        return (self.transform(img) if self.transform else img), y


class FakeData(torch.utils.data.Dataset):
    """torchvision.datasets.FakeData: random images and labels, each index seeded on its own. Its length is capped
    at PS_FAKE_N (default 320) and the image side replaced by PS_FAKE_SIZE when set."""

    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None, target_transform=None,
                 random_offset=0):
        self.size = _n(size, "PS_FAKE_N") if "PS_FAKE_N" in os.environ else min(size, 320)
        side = os.environ.get("PS_FAKE_SIZE")
        self.image_size = (image_size[0], int(side), int(side)) if side else tuple(image_size)
        self.num_classes, self.transform, self.offset = num_classes, transform, random_offset

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.offset + i)
        img = torch.randint(0, 256, self.image_size, generator=g, dtype=torch.uint8)
        y = int(torch.randint(0, self.num_classes, (1,), generator=g))
        return (self.transform(img) if self.transform else img), y


def _unavailable(*a, **k):
    raise RuntimeError("not in the torchvision shim: use MNIST or FakeData")


ImageFolder = LSUN = CIFAR10 = _unavailable
