"""A map-style Dataset with a random horizontal flip: convcheck applies it once per batch, for every arm."""

import torch
from torch.utils.data import Dataset


class Shapes(Dataset):
    """2000 noisy 3x32x32 images of 10 class patterns."""

    def __init__(self, n: int = 2000):
        g = torch.Generator().manual_seed(123)
        self.patterns = torch.nn.functional.interpolate(torch.randn(10, 3, 4, 4, generator=g), size=32,
                                                        mode="bilinear", align_corners=False)
        self.labels = torch.randint(0, 10, (n,), generator=g)
        self.noise_seed = torch.randint(0, 2**31, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(int(self.noise_seed[i]))
        x = self.patterns[self.labels[i]] + 0.8 * torch.randn(3, 32, 32, generator=g)
        if torch.rand(()) < 0.5:  # augmentation with the global RNG: convcheck seeds it
            x = x.flip(-1)
        return x, int(self.labels[i])


def shapes():
    return Shapes()
