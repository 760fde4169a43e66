"""Seeds Python's `random` at interpreter start when PS_SEED_PYRANDOM is set: siamese_network's dataset draws its
pairs with `random.randint` and the script seeds only torch, so two runs of it otherwise see different pairs."""
import os
import random

if os.environ.get("PS_SEED_PYRANDOM"):
    random.seed(int(os.environ["PS_SEED_PYRANDOM"]))
