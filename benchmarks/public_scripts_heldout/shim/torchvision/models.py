"""A small ResNet in torchvision's layout (conv1, bn1, relu, maxpool, layer1-4 of BasicBlocks, avgpool, fc), one block a
stage: ``resnet18`` here is that (torchvision's is not importable; widths below)."""
import torch.nn as nn


class BasicBlock(nn.Module):
    def __init__(self, inp, out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inp != out:
            self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128), num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inp = widths[0]
        for k, w in enumerate(widths):
            setattr(self, f"layer{k + 1}", nn.Sequential(BasicBlock(inp, w, 1 if k == 0 else 2)))
            inp = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inp, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


def resnet18(pretrained=False, weights=None, **kw):
    """widths 64-32-64-64 here (the first stage at 64, as torchvision's: the siamese example replaces conv1 with a
    64-channel one), one block a stage."""
    if pretrained or weights is not None:
        raise RuntimeError("no pretrained weights in the shim")
    kw.setdefault("widths", (64, 32, 64, 64))
    return ResNet(**kw)
