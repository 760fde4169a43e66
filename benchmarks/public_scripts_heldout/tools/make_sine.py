"""time_sequence_prediction's generate_sine_wave.py, the same formula and seed, smaller (N sequences of length L)
so the LBFGS runs stay short on 2 cores. Usage: python make_sine.py OUT.pt [N] [L]"""
import sys

import numpy as np
import torch

np.random.seed(2)
T = 20
out = sys.argv[1]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 23
L = int(sys.argv[3]) if len(sys.argv) > 3 else 200
x = np.empty((N, L), 'int64')
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype('float64')
torch.save(data, open(out, 'wb'))
