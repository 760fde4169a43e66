import torch
from torch.utils.data import Dataset

class Noisy(Dataset):
    """64 samples of 1x8x8 in 4 classes; a random flip as augmentation."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.proto = torch.randn(4, 1, 8, 8, generator=g)
        self.y = torch.randint(0, 4, (64,), generator=g)
        self.noise = torch.randn(64, 1, 8, 8, generator=g) * 0.5
    def __len__(self):
        return 64
    def __getitem__(self, i):
        x = self.proto[self.y[i]] + self.noise[i]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x.float(), int(self.y[i])

def dataset():
    return Noisy()

def two_inputs():
    g = torch.Generator().manual_seed(1)
    for _ in range(1000):
        y = torch.randint(0, 3, (8,), generator=g)
        yield {"image": torch.randn(8, 1, 8, 8, generator=g) + y[:, None, None, None].float(),
               "extra": torch.randn(8, 2, generator=g), "target": y}


def three_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def changing_shapes():
    g = torch.Generator().manual_seed(3)
    for n in (8, 8, 4, 8):
        yield torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def unseeded():
    import os

    for _ in range(100):
        seed = int.from_bytes(os.urandom(4), "little")
        g = torch.Generator().manual_seed(seed)
        yield torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def broken():
    raise OSError("no such shard: /data/train-00001")


def nothing():
    return None
