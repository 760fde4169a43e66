import torch


class Compose:
    def __init__(self, ts):
        self.ts = list(ts)

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class ToTensor:
    """uint8 HxW or CxHxW tensor -> float CxHxW in [0, 1] (what torchvision's ToTensor does to a PIL image)."""
    def __call__(self, x):
        if x.dim() == 2:
            x = x.unsqueeze(0)
        return x.to(torch.float32).div(255) if x.dtype == torch.uint8 else x.to(torch.float32)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


def _identity(*a, **k):
    return lambda x: x


Resize = CenterCrop = RandomResizedCrop = RandomHorizontalFlip = _identity
