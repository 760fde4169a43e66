"""Models a careless (or unlucky) user points convcheck at; each fails in its own way.

All take 1x4x4 inputs and give 3 classes, so a run needs ``--input-shape 1,4,4 --classes 3``.
"""

import torch
import torch.nn as nn

SHAPE, CLASSES = (1, 4, 4), 3


def good():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, CLASSES))


class _NoParams(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :CLASSES]


def no_parameters():
    return _NoParams()


def frozen():
    m = good()
    for p in m.parameters():
        p.requires_grad_(False)
    return m


class _IntegerOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc(x.flatten(1)).long()


def integer_output():
    return _IntegerOutput()


class _Detached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc(x.flatten(1)).detach()


def detached_output():
    return _Detached()


class _TupleOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc(x.flatten(1)), x


def tuple_output():
    return _TupleOutput()


def batchnorm1d():
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, CLASSES))


def _fails_at_step_3(exc: BaseException):
    """A model class whose forward raises ``exc`` in training step 3: the third version of its weights
    it sees (the initial ones, after step 1, after step 2). Parity never steps an optimizer, so only a
    training arm gets there, whatever number of forwards the checks before it make."""

    class FailsAtStep3(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, CLASSES)
            self.versions = set()

        def forward(self, x):
            if self.training and torch.is_grad_enabled():
                self.versions.add(float(self.fc.weight.detach().double().sum()))
                if len(self.versions) >= 3:
                    raise exc
            return self.fc(x.flatten(1))

    return FailsAtStep3


raises_at_step_3 = _fails_at_step_3(ValueError("the user's model broke at a later step"))
out_of_memory_at_step_3 = _fails_at_step_3(RuntimeError(
    "[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "274877906944 bytes"))
memory_error_at_step_3 = _fails_at_step_3(MemoryError())
interrupted_at_step_3 = _fails_at_step_3(KeyboardInterrupt())
disk_full_at_step_3 = _fails_at_step_3(OSError(28, "No space left on device"))


def needs_an_argument(width):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, width))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        if self.training:
            raise ValueError("a block that cannot train")
        return self.fc(x)


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), _Block())
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.head(self.encoder(x))


def nested():
    return _Nested()


def returns_42():
    return 42


def returns_none():
    return None


def raises():
    raise RuntimeError("the weights file is missing")


_built = {"n": 0}


def raises_on_second_build():
    _built["n"] += 1
    if _built["n"] >= 2:
        raise RuntimeError("only one model per process")
    return good()


class _WrongShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(25, CLASSES)

    def forward(self, x):
        return self.fc(x.flatten(1))


def wrong_shape():
    return _WrongShape()


class _FlagChanger(nn.Module):
    """Changes global math flags in its forward: convcheck must put them back."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, CLASSES)

    def forward(self, x):
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
        torch.set_float32_matmul_precision("medium")
        return self.fc(x.flatten(1))


def flag_changer():
    return _FlagChanger()


not_callable = 42
