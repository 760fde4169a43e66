"""Reference models for convcheck: LeNet-5, a small CIFAR CNN, ResNet-18/34/50."""
